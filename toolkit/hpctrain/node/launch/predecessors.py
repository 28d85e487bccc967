"""An in-job restart's new ranks wait for the ranks of the step it ended to be gone from their node.

The in-job driver (hpctrain.fault.injob) does not wait for the ended step's srun (srun waits for the dead node's
answer); it cancels the step and starts the next one at once, with HPCTRAIN_INJOB_RESTART = k. A rank of the
ended step may still be dying on a surviving node: holding its GPU's memory, writing its last beat. Each new
rank looks in /proc for this run's processes of an earlier step (HPCTRAIN_INJOB_RESTART below its own, same
HPCTRAIN_RUN_DIR), waits a few seconds for them, then kills what is left: that step was cancelled, and SLURM's
own KillWait can be 30 s. Processes in another PID namespace (another container) are not seen. Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from hpctrain.states import INJOB_RESTART_ENV

RESTART_ENV = INJOB_RESTART_ENV
GRACE_S = 5.0  # for the ended step's ranks to exit by themselves before they are killed


def restart_of(environ: dict[str, str]) -> int:
    """The in-job restart number of a process environment (0: the job's first step)."""
    v = environ.get(RESTART_ENV, "")
    return int(v) if v.isdigit() else 0


def _environ(d: Path) -> dict[str, str] | None:
    try:
        raw = (d / "environ").read_bytes()
    except OSError:
        return None  # gone, or another user's
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def find(run_dir: str, restart: int, proc: Path = Path("/proc")) -> list[int]:
    """Pids of this run's processes of an earlier in-job step on this node (never this process)."""
    me, out = os.getpid(), []
    for d in proc.iterdir() if proc.is_dir() else ():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        env = _environ(d)
        # A step's own processes carry the variable (the driver sets it on every step, 0 on the first); the batch
        # script and the driver do not, and a process that is not hpctrain's node entry (srun, a shell) is left.
        if env and env.get("HPCTRAIN_RUN_DIR") == run_dir and RESTART_ENV in env and restart_of(env) < restart \
                and b"hpctrain.node" in _cmdline(d):
            out.append(int(d.name))
    return out


def _cmdline(d: Path) -> bytes:
    try:
        return (d / "cmdline").read_bytes()
    except OSError:
        return b""


def wait_gone(run_dir: str, restart: int, log: Callable[[str], None], grace_s: float = GRACE_S) -> int:
    """Wait (bounded) for the earlier step's processes on this node to exit, kill the rest; how many there were."""
    pids = find(run_dir, restart) if restart > 0 and run_dir else []
    found = len(pids)
    if not pids:
        return 0
    log(f"{len(pids)} process(es) of the step before this in-job restart still on this node: waiting {grace_s:g} s")
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [p for p in pids if _alive(p)]
    for p in pids:
        log(f"killing pid {p} of the ended step")
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [p for p in pids if _alive(p)]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, its parent not yet told) holds no memory
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
