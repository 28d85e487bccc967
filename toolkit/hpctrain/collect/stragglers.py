"""Ranks and hosts persistently slower than the others, from the per-rank compute times in the heartbeats.

Each beat carries `compute_s`: the seconds each of the rank's last COMPUTE_WINDOW (20) steps took from
its start to the step's collective (hpctrain.runs.beats), i.e. the rank's own work without the final wait
for its peers (ZeRO-3's gathers inside the step still sync them). A rank is a straggler when the median of
its window is at least RATIO (1.2) times the median of the other ranks' medians and at least MIN_EXCESS_S
(5 ms) above it (tiny CPU steps jitter by more than 20 %). The other ranks, not all: with 2 ranks the
slow one would otherwise raise the reference itself, and so would a slow half of a larger job.
A median over the window is above only if more than half of the rank's recent steps were slow: one
garbage-collection pause does not name a rank. A host is named when every rank on it is a straggler.
Needs MIN_STEPS steps from at least 2 ranks of the newest job. Stdlib only.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from hpctrain.runs.beats import read_beats

RATIO = 1.2
MIN_EXCESS_S = 0.005
MIN_STEPS = 5


def newest_job_beats(beats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The beats of the job (and run of it) that beat last: an earlier attempt's rank files are left behind."""
    if not beats:
        return []
    last = max(beats, key=lambda b: float(b.get("time", 0)))
    key = (str(last.get("job")), str(last.get("restart", "0")))
    return [b for b in beats if (str(b.get("job")), str(b.get("restart", "0"))) == key]


def find(beats: list[dict[str, Any]], ratio: float = RATIO,
         min_excess_s: float = MIN_EXCESS_S) -> dict[str, Any] | None:
    """The straggler verdict of one job's beats, or None when there is too little to compare."""
    medians: dict[int, float] = {}
    hosts: dict[int, str] = {}
    steps = 0
    for b in beats:
        vals = [float(v) for v in b.get("compute_s") or [] if isinstance(v, (int, float))]
        if len(vals) >= MIN_STEPS and "rank" in b:
            medians[int(b["rank"])] = statistics.median(vals)
            hosts[int(b["rank"])] = str(b.get("host", "?"))
            steps = max(steps, len(vals))
    if len(medians) < 2:
        return None
    typical = statistics.median(medians.values())
    slow = []
    for r, m in sorted(medians.items()):
        others = statistics.median([v for q, v in medians.items() if q != r])
        if m >= ratio * others and m - others >= min_excess_s:
            slow.append({"rank": r, "host": hosts[r], "median_s": round(m, 4), "others_s": round(others, 4),
                         "ratio": round(m / others, 2) if others else None})
    slow_ranks = {s["rank"] for s in slow}
    by_host: dict[str, list[int]] = {}
    for r, h in hosts.items():
        by_host.setdefault(h, []).append(r)
    slow_hosts = sorted(h for h, rs in by_host.items() if set(rs) <= slow_ranks)
    return {"window_steps": steps, "ratio": ratio, "median_s": round(typical, 4), "ranks_compared": len(medians),
            "slow_ranks": slow, "slow_hosts": slow_hosts}


def of_run(folder: Path) -> dict[str, Any] | None:
    return find(newest_job_beats(read_beats(folder)))


def describe(verdict: dict[str, Any] | None) -> str | None:
    """One line for `hpctrain summary`, or None when no rank is slow."""
    if not verdict or not verdict["slow_ranks"]:
        return None
    ranks = ", ".join(f"rank {s['rank']} on {s['host']} {s['median_s'] * 1000:.0f} ms vs {s['others_s'] * 1000:.0f} ms "
                      f"({s['ratio']}x)" for s in verdict["slow_ranks"])
    hosts = f"; slow host(s): {', '.join(verdict['slow_hosts'])}" if verdict["slow_hosts"] else ""
    return (f"stragglers: {ranks} (median compute per step, against the other ranks' median; >= {verdict['ratio']}x "
            f"over the last {verdict['window_steps']} steps of {verdict['ranks_compared']} ranks){hosts}")
