"""The rank side of stack dumps: `faulthandler` registered on hpctrain.runs.stacks.STACK_SIGNAL (SIGURG).

`install` opens this rank's stacks/attempt-K.rank-R.txt for appending, writes its header line, and
registers faulthandler on the signal with that file (all threads, no chaining: SIGURG has no other
handler in this process). The file stays open for the life of the process: faulthandler writes to its
descriptor from the signal handler. Stdlib only.
"""

from __future__ import annotations

import faulthandler
import os
import socket
from pathlib import Path
from typing import IO

from hpctrain.runs import stacks

_OPEN: list[IO[str]] = []  # kept alive: faulthandler holds only the descriptor


def install(stacks_dir: Path, rank: int, attempt: int, job: str) -> Path:
    """Make this process dump every thread's stack to its file on STACK_SIGNAL; returns the file."""
    path = stacks.stack_file(stacks_dir, attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - must outlive this call (see _OPEN)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    f.write(stacks.header_line(rank, host, os.getpid(), job, attempt))
    f.flush()
    faulthandler.register(stacks.STACK_SIGNAL, file=f, all_threads=True, chain=False)
    for old in _OPEN:  # a second install in one process (tests): the new file replaces the old one
        old.close()
    _OPEN[:] = [f]
    return path


def uninstall() -> None:
    faulthandler.unregister(stacks.STACK_SIGNAL)
    for old in _OPEN:
        old.close()
    _OPEN.clear()
