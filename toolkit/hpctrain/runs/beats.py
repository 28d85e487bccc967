"""The per-rank heartbeat files under RUN_DIR/metrics/ranks/: their names, fields and readers.

Every rank writes them (hpctrain.node.monitor.heartbeat.RankBeat); the hang watchdog, which the batch script runs
beside the ranks, reads them (hpctrain.fault.watchdog). Both sides import this module, so the format is
defined once. Stdlib only.

* `rank-R.json`: rank R's latest beat, rewritten atomically every few seconds:
  {"rank", "host", "step" (the step it works on), "phase" (one of PHASES, or "failed"), "time" (unix),
  "job" (SLURM_JOB_ID), "restart" (SLURM_RESTART_COUNT), "attempt" (the K of logs/attempt-K: one per srun step
  of an in-job restart), "pid", "compute_s" (seconds from each of the last
  COMPUTE_WINDOW steps' start to its collective: the rank's own step time, without waiting for its peers;
  hpctrain.collect.stragglers compares them), and on GPU ranks with the `gpu` extra "gpu_util" (%),
  "gpu_mem_used_gb", "gpu_temp_c"}.
* `failed-JOB-RESTART-R.json`: written once when rank R's training raised: the beat record plus "was" (the
  phase it failed in) and "error". A name of its own, so that one directory listing a second finds it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpctrain.runs.folder import RunFolder

RANKS_DIR = "ranks"
PHASES = ("start", "compute", "reduce", "checkpoint", "done")  # order matters: later = further along
FAILED = "failed"
COMPUTE_WINDOW = 20  # steps of per-rank compute time a beat carries


def ranks_dir(metrics_dir: Path) -> Path:
    return Path(metrics_dir) / RANKS_DIR


def beat_name(rank: int | str) -> str:
    return f"rank-{rank}.json"


def failed_name(job: str, restart: str, rank: int | str) -> str:
    return f"failed-{job}-{restart}-{rank}.json"


def write_record(directory: Path, name: str, rec: dict[str, Any]) -> None:
    """Replace DIRECTORY/NAME atomically: a reader sees the old record or the new one, never half of one."""
    tmp = Path(directory) / f".{name}.tmp"
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, Path(directory) / name)


def _records(run_dir: Path, pattern: str) -> list[dict[str, Any]]:
    out = []
    for p in sorted(ranks_dir(RunFolder(run_dir).metrics_dir).glob(pattern)):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or a crash mid-write before the atomic rename existed
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_beats(run_dir: Path, job: str | None = None, restart: str | None = None,
               attempt: int | None = None) -> list[dict[str, Any]]:
    """Per-rank beats (of `job` and its run `restart` only, when given: files left by an earlier attempt
    or an earlier run of a requeued job are ignored; with `attempt`, of that srun step's ranks only: a rank of
    the step an in-job restart ended may still write once while it dies)."""
    return [rec for rec in _records(run_dir, beat_name("*"))
            if (job is None or str(rec.get("job")) == str(job))
            and (restart is None or str(rec.get("restart", "0")) == str(restart))
            and _of_attempt(rec, attempt)]


def read_failures(run_dir: Path, job: str, restart: str | None = None,
                  attempt: int | None = None) -> list[dict[str, Any]]:
    """The failed-JOB-RESTART-R.json records ranks of this job (and run of it) left when training raised."""
    return [rec for rec in _records(run_dir, failed_name(job, restart or "*", "*"))
            if "rank" in rec and _of_attempt(rec, attempt)]


def _of_attempt(rec: dict[str, Any], attempt: int | None) -> bool:
    """A record of that attempt; one without the field (written before it existed) counts for any."""
    return attempt is None or "attempt" not in rec or str(rec["attempt"]) == str(attempt)
