"""The login node's hpctrain server (hpctrain.remote.serve) on this machine, without ssh: a real
`hpctrain remote serve` on a unix socket, spoken to by the laptop's client (hpctrain.remote.client).

A CLI command and its exit status, a shell line with a megabyte both ways (no deadlock), rsync through the
pipe (hpctrain.remote.pipe) as a submit's upload uses it, a command stopped when the laptop goes, a detached
submit's files, and the server stopping by itself: when its ssh session's end closes its stdout, and when idle.
Through a real sshd, with the forward over the shared connection: tests/test_remote_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import wait_until
from hpctrain.remote import client, wire
from hpctrain.remote.serve import MAX_SOCKET_PATH, socket_for
from hpctrain.remote.site import Remote

HPCTRAIN = str(Path(sys.executable).parent / "hpctrain")


def _start(folder: Path, idle: float = 0) -> tuple[subprocess.Popen[bytes], Path]:
    path = folder / "srv" / "s.sock"
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HPCTRAIN_ON_LOGIN": "1", "HPCTRAIN_STATE_DIR": str(folder / "state")}
    proc = subprocess.Popen([HPCTRAIN, "remote", "serve", "--socket", str(path), "--idle", str(idle)], cwd=folder,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())  # bounded: the test's own timeout; it prints once listening
    assert ready["socket"] == str(path) and not ready["reused"]
    return proc, path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    proc, path = _start(tmp_path_factory.mktemp("serve"))
    try:
        yield path
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _call(path: Path, request: dict[str, object]) -> tuple[int | None, str, str]:
    got = client.hello(path)
    assert got is not None
    return client.call(got[0], request, capture=True)


def test_socket_is_private_and_path_fits(server: Path, tmp_path: Path) -> None:
    assert oct(server.stat().st_mode & 0o777) == "0o600" and oct(server.parent.stat().st_mode & 0o777) == "0o700"
    long = str(tmp_path / ("d" * 120))
    assert socket_for(long, "k" * 12).startswith("/tmp/hpctrain-serve-")
    assert len(socket_for(long, "k" * 12)) <= MAX_SOCKET_PATH and socket_for("/s/u", "k") == "/s/u/.serve/k.sock"
    remote = Remote(site="s", host="h", persist="10m")
    assert client.idle_s(remote) == 600 and client.idle_s(Remote(site="s", host="h", persist="yes")) == 0
    assert not client.enabled(Remote(site="s", host="h", persist="no"))


def test_cli_command_and_its_exit_status(server: Path) -> None:
    rc, out, err = _call(server, {"argv": ["--version"]})
    assert rc == 0 and "hpctrain, version" in out and not err
    rc, out, err = _call(server, {"argv": ["status", "no-such-run"]})
    assert rc != 0 and "no-such-run" in err and "Traceback" not in err


def test_shell_line_with_a_megabyte_both_ways(server: Path) -> None:
    """Input and output each move on their own: `cat` of 1 MB does not deadlock on full pipes."""
    got = client.hello(server)
    assert got is not None
    sock, _ = got
    data = os.urandom(1 << 20)
    sock.sendall(wire.pack_json(wire.REQUEST, {"shell": "cat; echo done >&2", "stdin": True}))

    def send() -> None:  # as hpctrain.remote.pipe does: input on a thread of its own, output read meanwhile
        for i in range(0, len(data), 65536):
            sock.sendall(wire.pack(wire.STDIN, data[i:i + 65536]))
        sock.sendall(wire.pack(wire.STDIN))
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    frames, pending, out, err = wire.Frames(), [], bytearray(), bytearray()  # type: ignore[var-annotated]
    sock.settimeout(120)
    while (frame := wire.recv_one(sock, frames, pending)) is not None and frame[0] != wire.EXIT:
        (out if frame[0] == wire.STDOUT else err).extend(frame[1])
    sender.join(timeout=60)
    sock.close()
    assert frame == (wire.EXIT, b"0") and bytes(out) == data and err == b"done\n"


def test_rsync_through_the_pipe(server: Path, tmp_path: Path) -> None:
    """rsync -e hpctrain.remote.pipe: the upload of a submit, through the server (here to this machine)."""
    src = tmp_path / "code it's"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A = 1\n" * 1000)
    (src / "big.bin").write_bytes(os.urandom(8 << 20))  # many frames each way
    dest = tmp_path / "dest dir"
    argv = ["rsync", "-a", "-s", f"--rsync-path=mkdir -p -- '{dest}' && rsync", "-e", client.rsh(server), "--",
            f"{src}/", f"host:{dest}/"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (dest / "pkg" / "a.py").read_text() == "A = 1\n" * 1000
    assert (dest / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    back = tmp_path / "back"  # and the other way, as `remote pull` fetches a run folder
    argv = ["rsync", "-a", "-s", "-e", client.rsh(server), "--", f"host:{dest}/", f"{back}/"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (back / "big.bin").read_bytes() == (src / "big.bin").read_bytes()


def test_the_command_stops_when_the_laptop_goes(server: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    got = client.hello(server)
    assert got is not None
    sock, _ = got
    sock.sendall(wire.pack_json(wire.REQUEST, {"shell": f"echo $$ > '{pidfile}'; exec sleep 300"}))
    pid = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 60, "the command to start", 0.05))
    sock.close()  # Ctrl-C on the laptop, or a dropped link

    def gone() -> bool:
        try:
            os.kill(pid, 0)
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
        except ProcessLookupError:
            return True
    wait_until(gone, 60, "the command to be stopped", 0.1)


def test_detached_submit_writes_its_answer(server: Path, tmp_path: Path) -> None:
    stage = tmp_path / "uploads" / "s1"
    rc, out, _ = _call(server, {"argv": ["--version"], "cwd": str(stage / "cwd"), "stage": str(stage)})
    assert rc == 0 and "hpctrain, version" in out
    assert (stage / "rc").read_text().strip() == "0" and (stage / "pid").is_file()
    assert "hpctrain, version" in (stage / "out").read_text()


def test_server_stops_with_its_session_and_when_idle(tmp_path: Path) -> None:
    proc, path = _start(tmp_path / "a")
    assert proc.stdout is not None
    proc.stdout.close()  # what sshd's end of the session does when the shared connection closes
    proc.wait(timeout=60)
    assert not path.exists()
    proc, path = _start(tmp_path / "b", idle=1)
    t0 = time.monotonic()
    proc.wait(timeout=60)
    assert time.monotonic() - t0 >= 1 and not path.exists()
