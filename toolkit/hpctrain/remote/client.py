"""The laptop's half of the login node's hpctrain server (hpctrain.remote.serve): find it, start it, talk to it.

The server is reached through a unix socket in the private control folder that the shared ssh connection
forwards to the server's socket on the login node (`ssh -O forward -L LOCAL:REMOTE`): a command costs a
channel on the open connection and a fork there, not an sshd session, a login shell and a Python start.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from hpctrain.remote import wire
from hpctrain.remote.site import Remote

NO_SERVER_ENV = "HPCTRAIN_REMOTE_NO_SERVER"  # set (tests, or a login node that forbids forwarding): plain ssh
START_TIMEOUT_S = 90.0  # a Python start with hpctrain's imports on a busy login node
_PERSIST_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def key(remote: Remote) -> str:
    """One server per login-node environment: remote_dir, the hpctrain command and the site's variables."""
    env = "\0".join(f"{k}={v}" for k, v in sorted(remote.env.items()))
    return hashlib.sha256(f"{remote.remote_dir}\0{remote.hpctrain}\0{env}".encode()).hexdigest()[:12]


def local_path(control: Path, remote: Remote) -> Path:
    """The forwarded socket on the laptop, beside the shared connection's control socket."""
    return control.with_name(f"{control.name}.{key(remote)}.srv")


def idle_s(remote: Remote) -> float:
    """The server stops after the site's persist time without a request (0: never; it still stops with the
    shared connection)."""
    value = remote.persist
    if value == "yes":
        return 0.0
    return max(60.0, float(value.rstrip("smhdw")) * _PERSIST_UNIT.get(value[-1], 1))


def enabled(remote: Remote) -> bool:
    """persist = "no" keeps no connection open between commands, so nothing can be forwarded: plain ssh."""
    return remote.persist != "no" and not os.environ.get(NO_SERVER_ENV)


def hello(path: Path, timeout: float = 30.0) -> tuple[socket.socket, dict[str, Any]] | None:
    """A connection to the server behind PATH and its greeting; None when nothing answers (no forward, or a
    forward whose server has stopped: ssh accepts, then closes) or the server asks to be started afresh."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
        frames, pending = wire.Frames(), []  # type: ignore[var-annotated]
        got = wire.recv_one(sock, frames, pending)
        if got is None or got[0] != wire.HELLO:
            sock.close()
            return None
        doc = json.loads(got[1])
        if doc.get("restart"):
            sock.close()
            return None
        sock.settimeout(None)
        return sock, doc
    except (OSError, ValueError):
        sock.close()
        return None


def start(argv: list[str], log: Path) -> dict[str, Any] | None:
    """Run `hpctrain remote serve` over the shared connection (ARGV: its ssh command) in a session of its own
    that outlives this process, and wait for its ready line. The server never writes to that ssh's stdout
    again: when ssh's session ends (the shared connection closed), the server sees its stdout's reader gone
    and stops. Returns the ready line, or None when the login node's hpctrain has no server (an older
    version: the caller falls back to plain ssh); raises StartFailed with ssh's exit status and stderr."""
    with open(log, "ab") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)
    assert proc.stdout is not None
    line = _line_within(proc.stdout, START_TIMEOUT_S)
    proc.stdout.close()
    if line:
        try:
            return dict(json.loads(line))
        except ValueError:
            pass
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    text = log.read_text(errors="replace")[-4000:]
    if "no such command" in text.lower() and "serve" in text:
        return None
    raise StartFailed(rc, text)


class StartFailed(Exception):
    def __init__(self, rc: int, stderr: str) -> None:
        super().__init__(rc, stderr)
        self.rc, self.stderr = rc, stderr


def _line_within(stream: IO[bytes], timeout: float) -> bytes:
    """The first line of STREAM, or b'' at EOF or after TIMEOUT seconds (a server that never got ready)."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = stream.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        data = os.read(fd, 4096)
        if not data:
            return b""
        buf += data
    return buf.split(b"\n", 1)[0]


def call(sock: socket.socket, request: dict[str, Any], capture: bool) -> tuple[int | None, str, str]:
    """Send REQUEST on SOCK and stream the answer: (exit status, stdout, stderr), the two texts only when
    CAPTURE (else they went to ours as they came). A None status: the connection was cut off."""
    if request.get("tty"):
        size = shutil.get_terminal_size()
        request = {**request, "winsize": [size.lines, size.columns]}
    out, err = bytearray(), bytearray()
    frames, pending = wire.Frames(), []  # type: ignore[var-annotated]
    try:
        sock.sendall(wire.pack_json(wire.REQUEST, request))
    except OSError:
        sock.close()
        return None, "", ""
    try:
        while True:
            try:
                got = wire.recv_one(sock, frames, pending)
            except (OSError, ValueError):
                got = None
            if got is None:
                return None, out.decode(errors="replace"), err.decode(errors="replace")
            kind, payload = got
            if kind == wire.EXIT:
                return int(payload or b"1"), out.decode(errors="replace"), err.decode(errors="replace")
            if capture:
                (out if kind == wire.STDOUT else err).extend(payload)
                continue
            # Our own stdout closed early (`| head`) raises here, as a local command's would: not the link's.
            stream = sys.stdout if kind == wire.STDOUT else sys.stderr
            stream.buffer.write(payload)
            stream.flush()
            if kind == wire.STDERR:
                err[:] = (err + payload)[-4000:]
    finally:
        sock.close()


def rsh(path: Path) -> str:
    """rsync's -e through the server (hpctrain.remote.pipe): words quoted as rsync's -e parser reads them."""
    words = [sys.executable, "-m", "hpctrain.remote.pipe", str(path)]
    return " ".join(f"'{w}'" if "'" not in w else f'"{w}"' for w in words)
