"""Stack dumps of the ranks: the signal, the files under RUN_DIR/stacks/, their parser and the grouping.

Every rank registers `faulthandler` on STACK_SIGNAL at start (hpctrain.node.monitor.stacks) with its own file,
stacks/attempt-K.rank-R.txt, that begins with one header line naming the rank, host, pid and job. A signal
appends one dump of every thread. faulthandler writes it from C inside the signal handler, without the GIL,
so a rank stuck in a collective or in a C loop holding the GIL still answers.

The signal is SIGURG, not USR1/USR2/TERM: USR2 and TERM mean "checkpoint and stop" (SLURM's time-limit
signal, preemption), USR1 may be caught by NCCL (submitit's warning) and its default action kills a process
that did not register it. SIGURG's default action is to ignore it, and `scancel -s URG` reaches every
process of the job's steps: the DeepSpeed runner, container runtimes (apptainer, a Go program, already
ignores SIGURG) and shell wrappers outlive it; only the ranks dump.

The requester (hpctrain.collect.stacks) notes each file's size, sends the signal, and reads what was
appended: one dump per file. Stdlib only: the node, the watchdog and the CLI import this.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STACK_SIGNAL = signal.SIGURG
STACK_SIGNAL_NAME = "URG"  # as scancel -s takes it
HEADER = "# hpctrain stacks "
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[([^\]]*)\])? \(most recent call first\):")


def stack_file(stacks_dir: Path, attempt: int, rank: int) -> Path:
    return Path(stacks_dir) / f"attempt-{attempt}.rank-{rank}.txt"


def header_line(rank: int, host: str, pid: int, job: str, attempt: int) -> str:
    return HEADER + json.dumps({"rank": rank, "host": host, "pid": pid, "job": job, "attempt": attempt}) + "\n"


def read_header(path: Path) -> dict[str, Any] | None:
    """The header of a stack file, or None when it is not one (or unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return None
    if not first.startswith(HEADER):
        return None
    try:
        rec = json.loads(first[len(HEADER):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "rank" in rec else None


def sizes(stacks_dir: Path) -> dict[Path, int]:
    """Every stack file's size now: what was there before a request (a dump is what gets appended)."""
    out = {}
    for p in sorted(Path(stacks_dir).glob("attempt-*.rank-*.txt")):
        try:
            out[p] = p.stat().st_size
        except OSError:
            continue
    return out


@dataclasses.dataclass(frozen=True)
class Thread:
    current: bool  # the thread the signal interrupted
    frames: tuple[str, ...]  # 'File "x.py", line 3 in f', most recent call first


@dataclasses.dataclass(frozen=True)
class Dump:
    rank: int
    host: str
    pid: int
    path: Path
    threads: tuple[Thread, ...]  # as faulthandler lists them: newest thread first, the main thread last

    def key(self) -> tuple[tuple[str, ...], ...]:
        """What "the same stack" means: the same frames in every thread (thread ids and order aside)."""
        return tuple(sorted(t.frames for t in self.threads))

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "file": str(self.path),
                "threads": [{"current": t.current, "frames": list(t.frames)} for t in self.threads]}


def parse_dump(text: str) -> tuple[Thread, ...]:
    """faulthandler's text (one dump of all threads) -> its threads; lines it does not know are skipped."""
    threads: list[Thread] = []
    current: bool | None = None
    frames: list[str] = []
    for raw in text.splitlines():
        m = _THREAD.match(raw)
        if m:
            if current is not None:
                threads.append(Thread(current, tuple(frames)))
            current, frames = m.group(1) == "Current thread", []
        elif current is not None and raw.startswith("  ") and raw.strip():
            frames.append(raw.strip())
    if current is not None:
        threads.append(Thread(current, tuple(frames)))
    return tuple(threads)


@dataclasses.dataclass(frozen=True)
class Group:
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    dump: Dump  # the lowest rank's, standing for all

    def label(self) -> str:
        word = "rank" if len(self.ranks) == 1 else "ranks"
        return f"{word} {rank_ranges(self.ranks)} ({','.join(self.hosts)})"


def group(dumps: Iterable[Dump]) -> list[Group]:
    """Ranks with identical stacks collapsed into one group; the smallest groups first (the odd rank out
    is usually the one to look at), then by lowest rank."""
    by_key: dict[tuple[tuple[str, ...], ...], list[Dump]] = {}
    for d in sorted(dumps, key=lambda d: d.rank):
        by_key.setdefault(d.key(), []).append(d)
    groups = [Group(tuple(d.rank for d in ds), tuple(dict.fromkeys(d.host for d in ds)), ds[0])
              for ds in by_key.values()]
    return sorted(groups, key=lambda g: (len(g.ranks), g.ranks[0]))


def rank_ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def main_thread(dump: Dump) -> Thread | None:
    """The main thread: faulthandler lists threads newest first, so the interpreter's first is last."""
    return dump.threads[-1] if dump.threads else None
