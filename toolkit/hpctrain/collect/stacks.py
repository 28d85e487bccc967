"""Ask every rank of a running job for its Python stacks and read them back (`hpctrain stacks`, the watchdog).

How: note the size of every stacks/attempt-K.rank-R.txt, send hpctrain.runs.stacks.STACK_SIGNAL to the
job's steps (`scancel -s URG JOB`, which reaches the ranks on every node; a local job's ranks by pid from
their heartbeats), then wait until each expected rank's file grew and stopped growing, bounded by a
timeout. What a file gained is that rank's dump; its header names rank, host and pid. Ranks that did not
answer in time are reported as missing, with their last heartbeat. Stdlib only (the watchdog runs it).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hpctrain.runs import stacks as rs
from hpctrain.runs.beats import read_beats
from hpctrain.runs.folder import RunFolder

SETTLE_S = 0.5  # a file that stopped growing this long holds its whole dump (faulthandler writes it at once)


@dataclasses.dataclass
class StackReport:
    dumps: list[rs.Dump]
    missing: list[int]  # expected ranks without a dump in time
    waited_s: float
    stacks_dir: Path

    def groups(self) -> list[rs.Group]:
        return rs.group(self.dumps)

    def to_dict(self) -> dict[str, Any]:
        return {"stacks_dir": str(self.stacks_dir), "waited_s": round(self.waited_s, 2), "missing": self.missing,
                "dumped": sorted(d.rank for d in self.dumps),
                "groups": [{"ranks": list(g.ranks), "hosts": list(g.hosts), "label": g.label(),
                            "threads": g.dump.to_dict()["threads"]} for g in self.groups()]}


def slurm_sender(job: str) -> Callable[[], None]:
    def send() -> None:
        from hpctrain import slurmcommands as commands

        commands.signal_steps(job, rs.STACK_SIGNAL_NAME)

    return send


def local_sender(run_dir: Path) -> Callable[[], None]:
    """A local job: its ranks run on this machine; signal each pid the newest job's beats name (an older
    job's pid may belong to another process by now)."""
    from hpctrain.collect.stragglers import newest_job_beats

    def send() -> None:
        for b in newest_job_beats(read_beats(run_dir)):
            try:
                os.kill(int(b["pid"]), rs.STACK_SIGNAL)
            except (KeyError, ValueError, OSError):
                continue

    return send


def request(run_dir: Path, send: Callable[[], None], expected: Iterable[int], timeout_s: float = 15.0,
            poll_s: float = 0.2) -> StackReport:
    """Send the signal (`send`) and collect one dump per expected rank; bounded by `timeout_s`."""
    sdir = RunFolder(run_dir).stacks_dir
    want = set(expected)
    before = rs.sizes(sdir)
    t0 = time.monotonic()
    send()
    grown: dict[Path, tuple[int, float]] = {}  # path -> (size, when it last changed)
    ranks: dict[Path, int] = {}
    while True:
        now = time.monotonic()
        for p, size in rs.sizes(sdir).items():
            if p not in before:  # made after the snapshot (a rank that just started): its header is no dump
                before[p] = _header_size(p)
            if size <= before[p]:
                continue
            if grown.get(p, (None, 0.0))[0] != size:
                grown[p] = (size, now)
            if p not in ranks:
                head = rs.read_header(p)
                if head is not None:
                    ranks[p] = int(head["rank"])
        settled = all(now - changed >= SETTLE_S for _, changed in grown.values())
        if want <= set(ranks.values()) and settled or now - t0 >= timeout_s:
            break
        time.sleep(poll_s)
    dumps = [d for p in sorted(grown) if (d := _read_dump(p, before.get(p, 0))) is not None]
    got = {d.rank for d in dumps}
    return StackReport(sorted(dumps, key=lambda d: d.rank), sorted(want - got), time.monotonic() - t0, sdir)


def _read_dump(path: Path, offset: int) -> rs.Dump | None:
    head = rs.read_header(path)
    if head is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    threads = rs.parse_dump(text)
    if not threads:
        return None
    return rs.Dump(int(head["rank"]), str(head.get("host", "?")), int(head.get("pid", 0)), path, threads)


def write_json(path: Path, rec: dict[str, Any]) -> None:
    """A JSON record beside the dumps (the watchdog's: which ranks answered before its cancel)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    os.replace(tmp, path)


def _header_size(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return len(f.readline())
    except OSError:
        return 0


def expected_ranks(run_dir: Path) -> list[int]:
    """range(world size) from plan.json, else the ranks that ever beat."""
    import json

    try:
        world = int(json.loads(RunFolder(run_dir).plan_json.read_text())["world_size"])
        return list(range(world))
    except (OSError, ValueError, KeyError, TypeError):
        return sorted({int(b["rank"]) for b in read_beats(run_dir) if "rank" in b})


def format_report(rep: StackReport, title: str) -> str:
    """The text `hpctrain stacks` prints: one block per group of ranks with identical stacks."""
    lines = [(f"{title}: {len(rep.dumps)} rank(s) dumped in {rep.waited_s:.1f} s, "
             f"{len(rep.groups())} distinct stack(s); files in {rep.stacks_dir}")]
    for g in rep.groups():
        lines += ["", g.label() + ":"]
        main = rs.main_thread(g.dump)
        others = [t for t in g.dump.threads if t is not main]
        if main is not None:
            lines.append("  main thread (most recent call first):")
            lines += [f"    {f}" for f in main.frames] or ["    <no Python frame>"]
        for i, t in enumerate(others, 1):
            lines.append(f"  other thread {i} of {len(others)}:")
            lines += [f"    {f}" for f in t.frames] or ["    <no Python frame>"]
    if rep.missing:
        lines += ["", (f"no dump from rank(s) {rs.rank_ranges(rep.missing)} within {rep.waited_s:.0f} s "
                  "(process gone, or not started yet)")]
    return "\n".join(lines)
