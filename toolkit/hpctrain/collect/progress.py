"""Where a running run stands, from its folder alone: step / total, loss, tokens/s, ETA, last checkpoint.

`hpctrain status RUN --watch` reads this every few seconds, so it reads only the tail of metrics.jsonl
(TAIL_BYTES), never the whole file. The ETA comes from the recent step rate: the steps of the newest
attempt among the last RATE_WINDOW records, over the time they took. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import tomllib

from hpctrain.runs.checkpoints import choose_resume
from hpctrain.runs.folder import RunFolder

TAIL_BYTES = 256 << 10  # ~1,000 step records: enough for the rate window, cheap on a shared filesystem
RATE_WINDOW = 20  # steps the rate (and so the ETA) is measured over


@dataclasses.dataclass(frozen=True)
class Progress:
    step: int | None
    total: int | None
    loss: float | None
    tokens_per_s: float | None
    step_s: float | None  # seconds per step over the recent window
    eta_s: float | None
    checkpoint: int | None  # step a resume starts from (hpctrain.runs.checkpoints.choose_resume)
    updated: float | None  # time of the newest step record

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tail_records(path: Path, limit: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The step records in the last `limit` bytes of metrics.jsonl (a line cut by the seek is dropped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > limit:
        lines = lines[1:]
    out = []
    for raw in lines:
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def total_steps(folder: Path) -> int | None:
    try:
        with open(RunFolder(folder).spec_toml, "rb") as f:
            return int(tomllib.load(f)["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return None


def current_attempt(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest attempt's records: after the last time the step went down (a resume redoes steps)."""
    start = 0
    for i in range(1, len(recs)):
        if recs[i]["step"] <= recs[i - 1]["step"]:
            start = i
    return recs[start:]


def since(recs: list[dict[str, Any]], start: float, skew_s: float = 5.0) -> list[dict[str, Any]]:
    """The records written from `start` on (an attempt's start, hpctrain.runs.history), a little clock skew allowed:
    a retry that resumes at the very step its predecessor stopped shows no step going down."""
    out = []
    for r in recs:
        try:
            if float(r["time"]) >= start - skew_s:
                out.append(r)
        except (KeyError, TypeError, ValueError):
            continue
    return out


def step_rate(recs: list[dict[str, Any]], window: int = RATE_WINDOW) -> float | None:
    """Seconds per step over the last `window` records of the newest attempt; None with fewer than 2."""
    cur = current_attempt(recs)[-(window + 1):]
    if len(cur) < 2:
        return None
    try:
        dt = float(cur[-1]["time"]) - float(cur[0]["time"])
    except (KeyError, TypeError, ValueError):
        return None
    steps = cur[-1]["step"] - cur[0]["step"]
    return dt / steps if steps > 0 and dt > 0 else None


def read_progress(folder: Path, total: int | None = None, *, started: float | None = None,
                  waiting: bool = False) -> Progress:
    """Where the run stands. The rate, and so the ETA, comes from the current attempt's own steps only: those
    written since `started` (the attempt's start) when given; none while the attempt waits (`waiting`: queued, or
    its nodes not yet up) or before it has two steps of its own."""
    paths = RunFolder(folder)
    total = total_steps(folder) if total is None else total
    recs = tail_records(paths.metrics_jsonl)
    resume = choose_resume(paths.checkpoints_dir).step  # what the next attempt resumes from
    last = recs[-1] if recs else {}
    step = last.get("step")
    per_step = None if waiting else step_rate(since(recs, started) if started is not None else recs)
    eta = per_step * max(0, total - step) if per_step is not None and total is not None and step is not None else None
    return Progress(step=step, total=total, loss=_num(last.get("loss")), tokens_per_s=_num(last.get("tokens_per_s")),
                    step_s=per_step, eta_s=eta, checkpoint=resume,
                    updated=_num(last.get("time")))


def _num(v: Any) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None
