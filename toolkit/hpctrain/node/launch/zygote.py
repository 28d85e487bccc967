"""Warm ranks: one process per node that has imported torch, DeepSpeed, transformers and the trainer once, and
forks every rank of a training step from that state, so that an in-job restart (and the spare that takes over a
dead node) skips the imports that were most of its seconds (a cold rank on the 2-core test machine: ~20 s of
imports with six ranks starting together, against well under a second from fork to the trainer's entry).

    python -m hpctrain.node.launch.zygote serve STOP_FILE        # one per node (the in-job driver's srun step)
    python -m hpctrain.node.launch.zygote run MODULE [ARGS...]   # each rank's task, in place of `python -m MODULE`

`serve` listens on an abstract unix socket named after the job (abstract names live in the network namespace:
one per node, nothing on the filesystem) and only for its own user (SO_PEERCRED), imports, then serves on one
thread: a request is read, the rank forked, and a pidfd tells when it exits. `run` hands the zygote its stdin,
stdout and stderr (SCM_RIGHTS), its environment, directory and the module to run, and exits with the rank's
status; when no zygote answers on its node (none started, still dead after a node failure, a refused request)
it execs `python -u -m MODULE ARGS` instead: a cold start, never a failure.

Signals: a forked rank belongs to the zygote's step, so SLURM's job-wide signals (the time-limit USR2,
`scancel --signal`, SIGURG for stacks) reach it there, once; `run` ignores them instead of forwarding (a second
copy would stop a rank twice). When `run` dies (its step cancelled, srun's --kill-on-bad-exit), the zygote kills
its rank; a request of a later in-job restart kills what is left of the earlier ones on the node first (the warm
twin of hpctrain.node.launch.predecessors, which cannot see forked ranks: /proc/PID/environ is the zygote's).
The zygote itself ignores the job-wide signals and ends when the driver asks (the stop file) or with the job.

Forking after the imports is safe because they start no thread that matters: torch's import leaves one idle
native thread and jemalloc's background thread, neither holding a lock across fork (jemalloc has fork
handlers); no process group, no OpenMP region, no CUDA context exists before the fork (a GPU zygote never touches
the device). Stdlib at module level: `run` must start in milliseconds.
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Signals the job sends to every step (SLURM's --signal=USR2@N, scancel --signal, SIGURG for stacks, a cancel's
# TERM): the forked ranks get them in the zygote's step; the zygote and each rank's `run` ignore them.
JOB_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGURG, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# What the zygote imports before it serves: what every rank of hpctrain's trainer imports before its first step.
# The second line is what deepspeed.initialize and the first ZeRO-3 step import lazily (measured on this project's
# CPU lab, torch 2.13 / DeepSpeed 0.19.8: 160 more packages, 5.2 s of one core per rank, 5.0 s of it these);
# a name this install lacks is skipped.
WARM_IMPORTS = ("torch", "torch.distributed", "deepspeed", "transformers", "transformers.models.llama.modeling_llama",
                "torch._inductor.compile_fx", "torch._dynamo.debug_utils", "torch._dynamo.backends.common",
                "torch._inductor.autotune_process", "torch.utils.tensorboard", "networkx", "fsspec",
                "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3",
                "submitit", "submitit.core.submission", "hpctrain.node.launch.main", "hpctrain.node.train",
                "hpctrain.node.data.loader", "hpctrain.node.data.tokenize", "hpctrain.node.model.build",
                "hpctrain.node.model.zero_offload", "hpctrain.node.monitor.tracking", "hpctrain.node.monitor.heartbeat",
                "hpctrain.node.monitor.gpustats", "hpctrain.spec.presets")
STOP_POLL_S = 0.5  # how often an idle zygote looks for its stop file
KILL_WAIT_S = 5.0  # for an earlier restart's ranks, SIGKILLed, to be reaped before the next one is forked
_HEADER = struct.Struct("!I")


def socket_name(job_id: str) -> bytes:
    """The abstract socket of the job's zygote on this node (per network namespace, so per node)."""
    return b"\0hpctrain-zygote-" + job_id.encode() + b"-" + str(os.getuid()).encode()


def restart_of(env: dict[str, str]) -> int:
    from hpctrain.states import INJOB_RESTART_ENV

    v = env.get(INJOB_RESTART_ENV, "")
    return int(v) if v.isdigit() else 0


# ------------------------------------------------------------------------------------------------ the client
def run(module: str, args: Sequence[str], job_id: str | None = None) -> int:
    """One rank, forked by this node's zygote when one answers, else started cold (exec): the rank's status."""
    job = os.environ.get("SLURM_JOB_ID", "") if job_id is None else job_id
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    sock = _connect(job) if job else None
    if sock is not None:
        code = _run_warm(sock, module, args)
        if code is not None:
            return code
    for sig in JOB_SIGNALS:  # a cold rank handles them itself, as before
        signal.signal(sig, signal.SIG_DFL)
    os.execv(sys.executable, [sys.executable, "-u", "-m", module, *args])
    return 1  # not reached


def _connect(job: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(socket_name(job))
    except OSError:
        s.close()
        return None
    return s


def _run_warm(sock: socket.socket, module: str, args: Sequence[str]) -> int | None:
    """Ask for the rank; wait for its exit. None when the zygote refused or died before the fork (go cold)."""
    req = json.dumps({"module": module, "args": list(args), "env": dict(os.environ), "cwd": os.getcwd(),
                      "sent": time.time()}).encode()
    try:
        sock.sendmsg([_HEADER.pack(len(req)), req],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]).tobytes())])
        f = sock.makefile("rb")
        first = f.readline().split()
        if len(first) != 2 or first[0] != b"pid":
            return None  # refused (or it died while importing): a cold start
        last = f.readline().split()
    except OSError:
        return None
    if len(last) != 2 or last[0] != b"exit":
        print("hpctrain: this node's zygote went away while its rank ran", file=sys.stderr, flush=True)
        return 1
    code = int(last[1])
    if code < 0:  # died by a signal: so does this task, for srun and the driver's classifier
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    return code


# ------------------------------------------------------------------------------------------------ the zygote
class _Rank:
    def __init__(self, conn: socket.socket, pid: int, restart: int) -> None:
        self.conn, self.pid, self.restart = conn, pid, restart
        self.pidfd = os.pidfd_open(pid)


def serve(stop_file: str, job_id: str | None = None, imports: Sequence[str] = WARM_IMPORTS) -> int:
    """Import, then fork ranks on request until `stop_file` (the in-job driver's, when the training is over)
    exists. Returns 0 in the zygote; in a forked rank,
    the rank's exit status (the caller exits with it: the interpreter's own shutdown, as a cold rank's)."""
    import selectors

    job = os.environ.get("SLURM_JOB_ID", "") if job_id is None else job_id
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(socket_name(job))  # first: a rank that connects meanwhile waits for the imports, not goes cold
    lsock.listen(64)
    t0 = time.time()
    # What hpctrain.node.dist.prepare_process_env sets before a cold CPU rank imports torch: libgomp reads the
    # thread count once, when torch loads it, so here (six forked ranks with two threads each on two cores ran
    # their steps 4x slower); each rank then sets its own below.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK") or "1")
    _warm_up(imports)
    # Out of the collector's sight: the ranks' garbage collections then never write to (copy) the shared pages.
    gc.freeze()
    imported = time.time()
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"hpctrain zygote on {host}: imports done in {imported - t0:.1f} s; serving job {job}", file=sys.stderr,
          flush=True)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ, "listen")
    ranks: list[_Rank] = []
    stop = Path(stop_file)
    while not stop.exists():
        for key, _ in sel.select(STOP_POLL_S):
            what = key.data
            if what == "listen":
                conn, _ = lsock.accept()
                if _peer_uid(conn) != os.getuid():
                    conn.close()
                    continue
                sel.register(conn, selectors.EVENT_READ, ("request", conn))
            elif what[0] == "request":
                conn = what[1]
                sel.unregister(conn)
                got = _read_request(conn)
                if got is None:
                    conn.close()
                    continue
                req, fds = got
                _kill_earlier(ranks, restart_of(req["env"]), sel)
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    lsock.close()
                    for r in ranks:
                        r.conn.close()
                        os.close(r.pidfd)
                    return _become_rank(conn, req, fds, {"imported_s": round(imported - t0, 2),
                                                        "ready": round(imported, 3), "host": host,
                                                        "zygote_pid": os.getppid()})
                for fd in fds:
                    os.close(fd)
                rank = _Rank(conn, pid, restart_of(req["env"]))
                ranks.append(rank)
                sel.register(conn, selectors.EVENT_READ, ("client", rank))
                sel.register(rank.pidfd, selectors.EVENT_READ, ("exit", rank))
                _send(conn, f"pid {pid}\n")
            elif what[0] == "client":  # its `run` died (or wrote, which it never does): the rank goes too
                rank = what[1]
                if rank in ranks:  # not already reaped in this same round
                    sel.unregister(rank.conn)
                    _kill(rank.pid)
            elif what[0] == "exit" and what[1] in ranks:
                _reap(what[1], sel)
                ranks.remove(what[1])
    for r in ranks:
        _kill(r.pid)
    print(f"hpctrain zygote on {host}: stopping (the job's training is over)", file=sys.stderr, flush=True)
    return 0


def _warm_up(names: Sequence[str]) -> None:
    import importlib

    from hpctrain.node.launch import imports

    imports.install()  # before deepspeed, as a cold rank does (no mlflow for its autotuner)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a module a rank may not need; the rank imports it if it does
            print(f"hpctrain zygote: import {name} failed: {exc}", file=sys.stderr, flush=True)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    conn.settimeout(10.0)
    try:
        fds = array.array("i")
        msg, anc, _, _ = conn.recvmsg(_HEADER.size + (1 << 20), socket.CMSG_LEN(3 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if len(msg) < _HEADER.size:
            raise ValueError("short request")
        (n,) = _HEADER.unpack(msg[:_HEADER.size])
        body = msg[_HEADER.size:]
        while len(body) < n:
            chunk = conn.recv(n - len(body))
            if not chunk:
                raise ValueError("request cut short")
            body += chunk
        req = json.loads(body)
        if len(fds) != 3 or not isinstance(req.get("env"), dict) or not isinstance(req.get("module"), str):
            raise ValueError("malformed request")
    except (OSError, ValueError) as exc:
        print(f"hpctrain zygote: refused a request: {exc}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        return None
    conn.settimeout(None)
    return req, list(fds)


def _kill_earlier(ranks: list[_Rank], restart: int, sel: Any) -> None:
    """The ranks of an earlier in-job step of this job on this node, killed and reaped (bounded) before the
    later step's rank starts: the driver has ended that step, and SLURM's own kill can take KillWait."""
    old = [r for r in ranks if r.restart < restart]
    for r in old:
        _kill(r.pid)
    deadline = time.monotonic() + KILL_WAIT_S
    for r in old:
        code = -signal.SIGKILL  # what its client says if it is not reaped in time (a rank stuck in the kernel)
        while time.monotonic() < deadline:
            pid, status = os.waitpid(r.pid, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.01)
        _reap(r, sel, code)
        ranks.remove(r)


def _reap(rank: _Rank, sel: Any, code: int | None = None) -> None:
    """Tell the rank's client how it ended (waited for here unless `code` is known) and forget it."""
    if code is None:
        _, status = os.waitpid(rank.pid, 0)
        code = os.waitstatus_to_exitcode(status)
    for obj in (rank.conn, rank.pidfd):
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(obj)
    _send(rank.conn, f"exit {code}\n")
    rank.conn.close()
    os.close(rank.pidfd)


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _send(conn: socket.socket, text: str) -> None:
    with contextlib.suppress(OSError):  # its `run` is gone; the rank is killed when that is seen
        conn.sendall(text.encode())


def _become_rank(conn: socket.socket, req: dict[str, Any], fds: list[int], warm: dict[str, Any]) -> int:
    """In the forked child: the client's stdio, environment and directory, default signals, then the module
    as `python -m` runs it. Returns its exit status."""
    import io
    import runpy

    conn.close()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("SLURM_CPUS_PER_TASK") or ""
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit():  # the rank's own count (prepare_process_env's rule), not the zygote's
        torch.set_num_threads(int(threads))
    # `python -u`: unbuffered stdout/stderr on the client's descriptors
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    from hpctrain.node import phases

    phases.note("zygote", {**warm, "forked": round(time.time(), 3), "asked": req.get("sent")})
    sys.argv = [req["module"], *req.get("args", [])]
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "serve":  # [--imports a,b]: what to import instead (tests: no torch)
        names = argv[3].split(",") if len(argv) >= 4 and argv[2] == "--imports" else WARM_IMPORTS
        return serve(argv[1], imports=[n for n in names if n])
    if len(argv) >= 2 and argv[0] == "run":
        return run(argv[1], argv[2:])
    print("usage: python -m hpctrain.node.launch.zygote serve STOP_FILE [--imports M,...] | run MODULE [ARGS...]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
