"""Rank 0's metrics (metrics/metrics.jsonl) per attempt: progress, speed, and work lost.

The file is appended by every attempt of a run and may end in a half-written line (the writer was
killed mid-write, or the filesystem is still flushing): bad lines are skipped, never fatal.

Stdlib only.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.runs.checkpoints import complete_steps


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(records with an integer step, number of unreadable lines skipped)."""
    try:
        data = path.read_bytes()
    except OSError:
        return [], 0
    records, bad = [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8", errors="strict"))
            step = int(obj["step"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            bad += 1
            continue
        if isinstance(obj, dict):
            obj["step"] = step
            records.append(obj)
    return records, bad


def complete_checkpoints(ckpt_dir: Path) -> list[int]:
    """Steps of checkpoints that finished writing (the rule of hpctrain.runs.checkpoints)."""
    return complete_steps(ckpt_dir)


def split_by_attempt(records: list[dict[str, Any]], starts: list[float | None]) -> list[list[dict[str, Any]]]:
    """Records of each attempt (index = attempt position).

    An "attempt" key in a record wins. Otherwise, with every attempt's start time known, a record
    belongs to the last attempt that started before it. Otherwise the file is cut where the step
    count goes backwards (a resume from an older checkpoint) and the pieces go to the attempts in
    order -- the last piece to the last attempt when there are fewer pieces than attempts.
    """
    n = max(1, len(starts))
    out: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    if records and all("attempt" in r for r in records):
        for r in records:
            k = _int(r.get("attempt"))
            if k is not None and 0 <= k < n:
                out[k].append(r)
        return out
    if starts and all(s is not None for s in starts):
        for r in records:
            t = _float(r.get("time"))
            k = 0
            if t is not None:
                for i, s in enumerate(starts):
                    if s is not None and t >= s - 5:  # a few seconds of clock skew between nodes
                        k = i
            out[k].append(r)
        return out
    pieces: list[list[dict[str, Any]]] = []
    for r in records:
        if not pieces or r["step"] <= pieces[-1][-1]["step"]:
            pieces.append([])
        pieces[-1].append(r)
    offset = max(0, n - len(pieces))  # earlier attempts with no metrics at all (failed before step 1)
    for i, piece in enumerate(pieces[-n:]):
        out[offset + i] = piece
    return out


@dataclass
class AttemptMetrics:
    first_step: int | None = None
    last_step: int | None = None
    steps_done: int = 0
    last_loss: float | None = None
    tokens_per_s: float | None = None
    trained_tokens_per_s: float | None = None  # the tokens the loss covers (SFT: the responses)
    tflops: float | None = None
    mfu: float | None = None
    last_checkpoint_step: int | None = None
    lost_steps: int | None = None
    first_time: float | None = None
    last_time: float | None = None
    step_interval_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("first_step", "last_step", "steps_done", "last_loss", "tokens_per_s",
                                              "trained_tokens_per_s", "tflops", "mfu", "last_checkpoint_step",
                                              "lost_steps")}


def attempt_metrics(recs: list[dict[str, Any]], earlier: list[dict[str, Any]], disk_ckpts: list[int]) -> AttemptMetrics:
    """Progress and speed of one attempt; `earlier` are the records of the attempts before it.

    Lost work = last step - the newest complete checkpoint at or before it. Checkpoints are known
    from the records (ckpt_s > 0 on the step that saved one) and from the resume point (the step
    before an attempt's first step); the checkpoints/ folder is the fallback for metrics written
    without ckpt_s.
    """
    m = AttemptMetrics()
    if not recs:
        return m
    steps = [r["step"] for r in recs]
    m.first_step, m.last_step = steps[0], steps[-1]
    m.steps_done = len(set(steps))
    m.last_loss = _float(recs[-1].get("loss"))
    # Medians, skipping the first step of an attempt (compilation, warm-up) when there are others.
    steady = recs[1:] if len(recs) > 2 else recs
    m.tokens_per_s = _median(steady, "tokens_per_s")
    m.trained_tokens_per_s = _median(steady, "trained_tokens_per_s")
    m.tflops = _median(steady, "tflops")
    m.mfu = _median(steady, "mfu")
    times = [t for t in (_float(r.get("time")) for r in recs) if t is not None]
    if times:
        m.first_time, m.last_time = times[0], times[-1]
    if len(times) > 1:
        m.step_interval_s = statistics.median(b - a for a, b in itertools.pairwise(times))
    ckpts = {r["step"] for r in [*earlier, *recs] if (_float(r.get("ckpt_s")) or 0) > 0}
    if m.first_step > 1:
        ckpts.add(m.first_step - 1)  # resumed from here
    if not any("ckpt_s" in r for r in recs):
        ckpts.update(disk_ckpts)
    known = [s for s in ckpts if s <= m.last_step]
    m.last_checkpoint_step = max(known) if known else None
    m.lost_steps = m.last_step - (m.last_checkpoint_step or 0)
    return m


def _median(recs: list[dict[str, Any]], key: str) -> float | None:
    vals = [v for v in (_float(r.get(key)) for r in recs) if v is not None]
    return float(statistics.median(vals)) if vals else None


def _float(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None  # NaN/inf are not JSON


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def resource_hours(elapsed_s: float | None, nodes: int, gpus_per_node: int, cpus_per_node: int) -> tuple[float, float]:
    """(GPU-hours, CPU-hours). A GPU run reports GPU-hours and 0 CPU-hours; a CPU run (0 GPUs per
    node) reports 0 GPU-hours and the CPU cores it held, so CPU runs never look like free GPU time."""
    if not elapsed_s or elapsed_s <= 0 or nodes <= 0:
        return 0.0, 0.0
    hours = elapsed_s / 3600.0
    if gpus_per_node > 0:
        return nodes * gpus_per_node * hours, 0.0
    return 0.0, nodes * max(1, cpus_per_node) * hours
