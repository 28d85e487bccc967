"""The login node's half of a fast remote command: one warm hpctrain that forks a child per command.

Every command sent as `ssh login hpctrain ...` pays an sshd session, the login shell's rc files and a Python
start with hpctrain's imports on the login node (BENCHMARKS.md, "From a laptop": ~0.9 s of a 1.4 s status).
`hpctrain remote serve` pays them once: started by the laptop over the shared connection, it imports the
CLI, listens on a unix socket (a private 0700 folder under remote_dir) that ssh forwards to the laptop over
the same connection (`ssh -O forward -L`), and runs each request in a forked child: a CLI command (argv, cwd,
env; stdout/stderr streamed back, a pseudo-terminal for `status --watch`) or a shell line (rsync's server end,
the few shell lines of hpctrain.remote.forward). A submit runs detached from the connection, its answer
written into its upload folder as the ssh path does, so a dropped connection never doubles it.

It stops by itself: after `idle_s` without a request, when its ssh session ends (its stdout's reader is gone:
the laptop's shared connection closed), and when the installed hpctrain changed under it (a greeting that says so; the
laptop starts a fresh one).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import termios
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain import __version__
from hpctrain.remote import wire

# A unix socket path must fit sockaddr_un (108 bytes on Linux, 104 on macOS): ssh connects to it by name.
MAX_SOCKET_PATH = 100
RunCli = Callable[[list[str]], int]


def socket_for(remote_dir: str, key: str) -> str:
    """Where the server of KEY listens on the login node: REMOTE_DIR/.serve/KEY.sock, or a private folder
    under /tmp named from REMOTE_DIR when that path is too long for a socket."""
    path = f"{remote_dir.rstrip('/')}/.serve/{key}.sock"
    if len(path.encode()) <= MAX_SOCKET_PATH:
        return path
    return f"/tmp/hpctrain-serve-{hashlib.sha256(remote_dir.encode()).hexdigest()[:12]}/{key}.sock"


def _private_dir(path: Path) -> None:
    """The socket's folder, made 0700 and refused unless it is ours alone: who reaches the socket runs
    commands as us."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SystemExit(f"hpctrain remote serve: {path} is not a folder private to you (owner {st.st_uid}, "
                         f"mode {stat.S_IMODE(st.st_mode):o}). Fix: remove it")


def _fingerprint() -> tuple[tuple[str, int], ...]:
    """The installed hpctrain's files (name, mtime): a reinstall or an edit changes it."""
    root = Path(__file__).resolve().parents[1]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [(os.path.join(folder, f), os.stat(os.path.join(folder, f)).st_mtime_ns)
                for f in files if f.endswith(".py")]
    return tuple(sorted(out))


def _listen(path: str) -> socket.socket | None:
    """A listening socket at PATH; None when a live server already listens there (two laptops' commands
    started one each at the same moment)."""
    _private_dir(Path(path).parent)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return None
    except OSError:
        pass
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


def serve(path: str, idle_s: float, run_cli: RunCli) -> int:
    """Listen at PATH until idle for IDLE_S seconds (0: never), stdin closes, or hpctrain changes."""
    listener = _listen(path)
    print(json.dumps({"socket": path, "pid": os.getpid(), "version": __version__, "reused": listener is None}),
          flush=True)
    if listener is None:
        return 0
    remote_dir = os.getcwd()
    fingerprint = _fingerprint()
    children: set[int] = set()
    last = time.monotonic()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # The ssh session's end is seen on stdout: its reader (sshd) goes away, and poll says POLLERR/POLLHUP on
    # the writer. (stdin cannot tell: ssh gives the session /dev/null or EOF, and closes any fd it inherits.)
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    poller.register(sys.stdout.fileno(), 0)
    try:
        while True:
            events = dict(poller.poll(1000))
            children -= _reaped(children)
            if children:
                last = time.monotonic()
            if events.get(sys.stdout.fileno(), 0) & (select.POLLERR | select.POLLHUP):
                return 0  # the ssh session ended: the laptop's shared connection is gone
            if events.get(listener.fileno(), 0) & select.POLLIN:
                conn, _ = listener.accept()
                last = time.monotonic()
                if _fingerprint() != fingerprint:
                    # gone from the path first: the laptop starts the new server as soon as it reads this
                    listener.close()
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    conn.sendall(wire.pack_json(wire.HELLO, {"restart": True, "version": __version__}))
                    conn.close()
                    return 0
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    code = 1
                    try:
                        code = _handle(conn, remote_dir, run_cli)
                    except BaseException:  # noqa: BLE001 - a handler's traceback goes to the server's log
                        traceback.print_exc()
                    finally:
                        os._exit(code)
                conn.close()
                children.add(pid)
            elif idle_s and not children and time.monotonic() - last > idle_s:
                return 0
    finally:
        if listener.fileno() >= 0:  # not closed above for a changed hpctrain
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)


def _reaped(children: set[int]) -> set[int]:
    done = set()
    for pid in children:
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got = pid
        if got:
            done.add(pid)
    return done


# --------------------------------------------------------------------------------------------------
# One connection: the handler (a fork of the server) runs the request in a fork of its own and pumps.

def _handle(conn: socket.socket, remote_dir: str, run_cli: RunCli) -> int:
    conn.sendall(wire.pack_json(wire.HELLO, {"version": __version__, "remote_dir": remote_dir}))
    frames, pending = wire.Frames(), []  # type: ignore[var-annotated]
    conn.settimeout(60)
    first = wire.recv_one(conn, frames, pending)
    if first is None or first[0] != wire.REQUEST:
        return 0  # a connection that only wanted the greeting
    req: dict[str, Any] = json.loads(first[1])
    conn.settimeout(None)
    if req.get("stage"):
        return _detached(conn, req, run_cli)
    tty = bool(req.get("tty"))
    if tty:
        master, slave = os.openpty()
        _winsize(slave, req.get("winsize"))
        fds = {0: slave, 1: slave, 2: slave}
        reads = {master: wire.STDOUT}
        stdin_w = master
    else:
        in_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fds = {0: in_r, 1: out_w, 2: err_w}
        reads = {out_r: wire.STDOUT, err_r: wire.STDERR}
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(req, fds, run_cli, tty)
    for fd in set(fds.values()):
        os.close(fd)
    if not req.get("stdin"):
        if stdin_w not in reads:
            os.close(stdin_w)
        stdin_w = -1
    return _pump(conn, pid, reads, stdin_w, frames, pending, tty)


def _winsize(fd: int, size: Any) -> None:
    if isinstance(size, list) and len(size) == 2:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", int(size[0]), int(size[1]), 0, 0))


def _child(req: dict[str, Any], fds: dict[int, int], run_cli: RunCli, tty: bool) -> None:
    """The request's process: its own session (the handler signals the whole group when the laptop goes),
    stdio on the pipes or the terminal, then the CLI command or the shell line. Never returns."""
    code = 1
    try:
        os.setsid()
        if tty:
            fcntl.ioctl(fds[1], termios.TIOCSCTTY, 0)
        for target, fd in fds.items():
            os.dup2(fd, target)
        for fd in set(fds.values()):
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.environ.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        if req.get("shell"):
            os.chdir(req.get("cwd") or os.path.expanduser("~"))
            os.execvp("sh", ["sh", "-c", str(req["shell"])])
        if req.get("cwd"):
            os.makedirs(req["cwd"], exist_ok=True)
            os.chdir(req["cwd"])
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # logs --follow streams lines
        code = run_cli([str(a) for a in req.get("argv", [])])
    except KeyboardInterrupt:
        code = 130
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the command's traceback goes back to the laptop's stderr
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _pump(conn: socket.socket, pid: int, reads: dict[int, bytes], stdin_w: int, frames: wire.Frames,
          pending: list[tuple[bytes, bytes]], tty: bool) -> int:
    """Stream the child's output to the laptop until it ends, then its exit status; the laptop's input goes
    to the child on a thread of its own (each direction moves on its own: rsync's stream never deadlocks).
    The laptop gone (Ctrl-C, a dropped link): the child's whole group is stopped."""
    gone = threading.Event()

    def inbound() -> None:
        fd = stdin_w
        try:
            for kind, payload in pending:
                fd = _to_child(kind, payload, fd, tty)
            while data := conn.recv(65536):
                for kind, payload in frames.feed(data):
                    fd = _to_child(kind, payload, fd, tty)
        except (OSError, ValueError):
            pass
        gone.set()

    threading.Thread(target=inbound, daemon=True).start()
    status: int | None = None
    ended_at = 0.0
    while reads:
        ready, _, _ = select.select(list(reads), [], [], 0.5)
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError as exc:  # a pseudo-terminal whose last writer closed reads EIO, not EOF
                if exc.errno != errno.EIO:
                    raise
                data = b""
            if data:
                try:
                    conn.sendall(wire.pack(reads[fd], data))
                except OSError:
                    gone.set()
            else:
                os.close(fd)
                del reads[fd]
        if gone.is_set() and status is None:
            _stop(pid)
            return 0
        if status is None:
            got, raw = os.waitpid(pid, os.WNOHANG)
            if got:
                status, ended_at = raw, time.monotonic()
        elif time.monotonic() - ended_at > 2.0:
            break  # the command ended; a process it left behind holds the pipe: do not wait for it
    if status is None:
        _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    with contextlib.suppress(OSError):
        conn.sendall(wire.pack(wire.EXIT, str(128 - code if code < 0 else code).encode()))
    return 0


def _to_child(kind: bytes, payload: bytes, stdin_w: int, tty: bool) -> int:
    """One frame from the laptop: input for the child (empty: end of input) or a terminal's new size."""
    if kind == wire.STDIN and stdin_w >= 0:
        try:
            if payload:
                view = memoryview(payload)
                while view:
                    view = view[os.write(stdin_w, view):]
                return stdin_w
        except OSError:  # the child closed its input or ended: what it did not read is dropped
            pass
        if not tty:
            os.close(stdin_w)
            return -1
    elif kind == wire.WINSIZE and tty and stdin_w >= 0:
        _winsize(stdin_w, json.loads(payload))
    return stdin_w


def _stop(pid: int) -> None:
    for sig in (signal.SIGHUP, signal.SIGTERM):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _detached(conn: socket.socket, req: dict[str, Any], run_cli: RunCli) -> int:
    """A submit that outlives the connection, exactly as hpctrain.remote.forward.detached_submit on the ssh
    path: its pid, out, err, then rc in the upload folder STAGE; answered when done if the laptop still waits."""
    stage = Path(str(req["stage"]))
    stage.mkdir(parents=True, exist_ok=True)
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setsid()  # the laptop's going (the handler ending) must not reach it
        (stage / "pid").write_text(f"{os.getpid()}\n")
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(stage / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(stage / "err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        code = 1
        try:
            for target, fd in ((0, null), (1, out), (2, err)):
                os.dup2(fd, target)
            os.environ.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
            os.makedirs(req["cwd"], exist_ok=True)
            os.chdir(req["cwd"])
            code = run_cli([str(a) for a in req["argv"]])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            (stage / "rc.part").write_text(f"{code}\n")
            os.replace(stage / "rc.part", stage / "rc")
            os._exit(code)
    os.waitpid(pid, 0)
    try:
        conn.sendall(wire.pack(wire.STDERR, (stage / "err").read_bytes()))
        conn.sendall(wire.pack(wire.STDOUT, (stage / "out").read_bytes()))
        conn.sendall(wire.pack(wire.EXIT, (stage / "rc").read_text().strip().encode()))
    except OSError:
        pass  # the laptop is gone; its next command reads the answer from STAGE
    return 0
