"""Per-rank logs, rank-0 metrics JSONL and heartbeat (the files `collect` reads)."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hpctrain.runs.folder import HEARTBEAT, METRICS_JSONL

log = logging.getLogger("hpctrain.node")


def attempt_number(env: dict[str, str] | None = None) -> int:
    """K in logs/attempt-K.rank-R.log: HPCTRAIN_ATTEMPT (the attempt a resubmission starts at, set by
    hpctrain.fault.supervisor) plus SLURM's restart count (each requeue of that job is one more), or on the
    local executor the restarts hpctrain.node.launch.entry.NodeJob counts."""
    env = dict(os.environ) if env is None else env
    keys = ("HPCTRAIN_ATTEMPT", "SLURM_RESTART_COUNT", "HPCTRAIN_LOCAL_RESTARTS")
    return sum(int(env[k]) for k in keys if env.get(k, "").isdigit())


def setup_logging(logs_dir: Path, rank: int, attempt: int) -> Path:
    """One file per (attempt, rank), appended; rank 0 also writes human-readable lines to stdout."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    path = logs_dir / f"attempt-{attempt}.rank-{rank}.log"
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    fh = logging.FileHandler(path, mode="a")
    fh.setFormatter(fmt)
    log.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        log.addHandler(sh)
    # DeepSpeed's own INFO chatter goes to stdout on every rank; keep warnings only.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return path


def host_mem_gb() -> float:
    """Resident set size of this process now (not the peak), GB."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def host_peak_gb() -> float:
    """Peak resident set size of this process so far (ru_maxrss), GB: what the host must hold."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class MetricsWriter:
    """Rank 0 appends one JSON object per optimizer step and rewrites the heartbeat atomically."""

    def __init__(self, metrics_dir: Path, rank: int) -> None:
        self.dir = metrics_dir
        self.rank = rank
        self.host = socket.gethostname()
        if rank == 0:
            metrics_dir.mkdir(parents=True, exist_ok=True)

    def step(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with open(self.dir / METRICS_JSONL, "a") as fh:
            fh.write(json.dumps(record, sort_keys=False) + "\n")
        self.heartbeat(int(record["step"]))

    def heartbeat(self, step: int, state: str = "training") -> None:
        if self.rank != 0:
            return
        tmp = self.dir / ".heartbeat.tmp"
        tmp.write_text(json.dumps({"step": step, "time": time.time(), "rank": self.rank, "host": self.host,
                                   "state": state}) + "\n")
        os.replace(tmp, self.dir / HEARTBEAT)

    def event(self, record: dict[str, Any]) -> None:
        """Rank 0's training milestones (start with the resume point, stopped-on-signal, finished) as `train`
        events in the run folder's events.jsonl, beside the ranks' start/stop/failure events."""
        if self.rank != 0:
            return
        from hpctrain.runs import events

        events.append_event(self.dir.parent, events.Event(kind=events.TRAIN, time=time.time(), rank=self.rank,
                                                          host=self.host, extra=record))


def step_line(r: dict[str, Any]) -> str:
    """The human-readable step line of the job log."""
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"tok/s {r['tokens_per_s']:.0f}"]
    if r.get("trained_tokens_per_s") is not None:  # the tokens the loss covers (SFT: the responses)
        parts.append(f"trained tok/s {r['trained_tokens_per_s']:.0f}")
    if r.get("mfu") is not None:
        parts.append(f"mfu {100 * r['mfu']:.1f}%")
    parts.append(f"pad {100 * r['padding_frac']:.1f}%")
    if r.get("gpu_mem_gb"):
        parts.append(f"gpu {r['gpu_mem_gb']:.1f}GB")
    parts.append(f"rss {r['host_mem_gb']:.2f}GB")
    if r.get("ckpt_s"):
        parts.append(f"ckpt {r['ckpt_s']:.1f}s")
    if r.get("eval_loss") is not None:
        ppl = f" ppl {r['eval_ppl']:.2f}" if r.get("eval_ppl") is not None else ""
        parts.append(f"eval loss {r['eval_loss']:.4f}{ppl}")
    return " | ".join(parts)
