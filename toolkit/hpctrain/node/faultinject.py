"""Fault injection for the tests: the node calls `inject` at a step boundary and halfway through a checkpoint.

HPCTRAIN_FAULT_INJECT="hang:rank=1,step=10;ckpt-crash:step=12;crash:step=7;raise:step=3;slow:rank=1,step=2,s=0.3"
makes a rank hang, die (os._exit) with a checkpoint half written, die, raise like a user bug, or take `s`
seconds longer on every step from step 2 on (a straggler; with `first=1` only in the attempt that started at
step 0: a run kept alive until a signal or a kill comes, whose resumed attempt then trains at full speed).
Unset (every real run): one environment lookup per call. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from hpctrain.runs.folder import RunFolder


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: HPCTRAIN_FAULT_INJECT="hang:rank=1,step=5;ckpt-crash:step=10;raise:step=3"."""

    kind: str  # hang | crash | ckpt-crash | raise | slow
    step: int
    rank: int | None = None  # None: every rank
    every_attempt: bool = False  # raise: a user bug fails every attempt; the others fire once
    seconds: float = 0.0  # slow: the delay added to each step from `step` on
    first_only: bool = False  # slow with first=1: only in an attempt that started at step 0, not a resumed one


FAULT_KINDS = ("hang", "crash", "ckpt-crash", "raise", "slow")


def parse_faults(text: str) -> list[Fault]:
    """Parse HPCTRAIN_FAULT_INJECT; a malformed entry is an error naming it (a test typo must not pass)."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, args = item.partition(":")
        kw = dict(a.split("=", 1) for a in args.split(",") if "=" in a)
        if kind not in FAULT_KINDS or "step" not in kw:
            raise ValueError(f"HPCTRAIN_FAULT_INJECT entry {item!r}: expected KIND:step=N[,rank=R][,s=SECONDS]"
                             "[,first=1] "
                             f"with KIND one of {', '.join(FAULT_KINDS)}")
        out.append(Fault(kind, int(kw["step"]), int(kw["rank"]) if "rank" in kw else None, kind == "raise",
                         float(kw.get("s", 0.0)), kw.get("first") == "1"))
    return out


def fire_once(run_dir: str | Path, name: str) -> bool:
    """True the first time for this run (a marker RUN/metrics/faults/NAME is left), False ever after: an
    injected fault fires once, so the retry passes."""
    marker = RunFolder(run_dir).metrics_dir / "faults" / name
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{time.time()}\n")
    return True


def inject(where: str, step: int, step0: int, rank: int, log: Any = None) -> None:
    """Test hook the node calls at `where` ("step": step N computed, before its collective; "checkpoint":
    step N's checkpoint half written). Each fault fires once per run and rank (a marker in
    $HPCTRAIN_RUN_DIR/metrics/faults/; without a run dir: only in an attempt that started before N), so
    the retry passes; `raise` is a user bug and fires every time."""
    text = os.environ.get("HPCTRAIN_FAULT_INJECT", "")
    if not text:
        return
    run_dir = os.environ.get("HPCTRAIN_RUN_DIR", "")
    for f in parse_faults(text):
        if f.kind == "slow" and where == "step" and step >= f.step and f.rank in (None, rank):
            if not (f.first_only and step0 > 0):
                time.sleep(f.seconds)  # every step, every attempt (but a resumed one with first=1): a slower rank
            continue
        if f.step != step or (f.rank is not None and f.rank != rank) or f.kind == "slow":
            continue
        if (where == "checkpoint") != (f.kind == "ckpt-crash"):
            continue
        if not f.every_attempt:
            if not run_dir:
                if step0 >= step:
                    continue
            elif not fire_once(run_dir, f"{f.kind}-step{step}-rank{rank}"):
                continue
        if log is not None:
            log.info("fault injection: %s at step %d on rank %d", f.kind, step, rank)
            for h in getattr(log, "handlers", []):
                h.flush()
        if f.kind == "raise":
            raise ValueError(f"user code failed at step {step} (injected by HPCTRAIN_FAULT_INJECT)")
        if f.kind == "hang":
            while True:  # a rank that stops making progress without dying
                time.sleep(3600)
        os._exit(17)  # crash / ckpt-crash: die now, no cleanup
