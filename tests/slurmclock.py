"""SLURM's pre-timeout signal, timed from what a job is seen doing rather than from constants.

A job submitted with `--time 00:01:00 --signal USR2@20` is signalled anywhere from its start to 40 s in
(slurmctld's time-limit pass runs on its own clock), and a busy 2-core machine took 39 s to start a rank: a
fixed short limit signals ranks that have not begun to train, and what the test then sees is start-up, not
the checkpoint on the signal. So the job is submitted with a limit it never reaches, and `TimeLimitClock`
moves the limit (`scontrol update TimeLimit`, root on the test cluster) once the run has logged training
steps, to the first whole minute that makes SLURM's own USR2 come within about a minute. The signal stays
SLURM's: only its time is chosen.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import run_cmd


def elapsed_s(job: str) -> int:
    """The job's run time as squeue shows it ("M:SS", "H:MM:SS" or "D-HH:MM:SS")."""
    text = run_cmd(["squeue", "-h", "-j", job, "-o", "%M"], timeout=30).stdout.strip()
    days, _, clock = text.rpartition("-")
    secs = 0
    for part in clock.split(":"):
        secs = secs * 60 + int(part)
    return int(days or 0) * 86400 + secs


def signal_minutes(elapsed: int, signal_s: int, margin_s: int = 10) -> int:
    """The whole-minute limit whose USR2@signal_s falls margin_s to margin_s + 60 s after `elapsed`."""
    return -(-(elapsed + signal_s + margin_s) // 60)


def first_job_id(run: Path) -> str | None:
    """The run's first job id: attempts.jsonl opens with the submission's intent line (no job id), then the job."""
    path = run / "attempts.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        try:
            note = json.loads(line)
        except ValueError:  # a line cut mid-write
            continue
        if note.get("job_id"):
            return str(note["job_id"])
    return None


def last_step(run: Path) -> int:
    """The highest step in the run's metrics; a line cut mid-write is skipped (the collector's reader)."""
    from hpctrain.collect.metrics import read_metrics

    return max((int(r["step"]) for r in read_metrics(run / "metrics" / "metrics.jsonl")[0] if "step" in r),
               default=0)


class TimeLimitClock(threading.Thread):
    """Once `run` has logged step `after_step`, gives its first job a limit whose USR2@signal_s comes within
    about a minute. With `restore_min`, once attempt 0 has checkpointed on that signal, gives the long limit
    back, so that a requeued attempt runs to its end however slowly it starts. Bounded: every wait raises
    after its timeout; the test reads `.error` and `.events` (what it did, for a failure message)."""

    def __init__(self, run: Path, signal_s: int, *, after_step: int = 1, restore_min: int | None = None,
                 train_timeout_s: float = 900) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.signal_s, self.after_step = run, signal_s, after_step
        self.restore_min, self.train_timeout_s = restore_min, train_timeout_s
        self.stop = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # noqa: BLE001 - reported by the test that reads .error
            self.error = exc

    def _wait(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            self.stop.wait(1.0)
        raise AssertionError(f"time-limit clock: no {what} within {timeout:.0f}s ({self.events})")

    def _work(self) -> None:
        run = self.run_dir
        job = str(self._wait(lambda: first_job_id(run), 120, "job id"))
        # Steps logged: the start-up, however long it took, is behind us.
        self._wait(lambda: last_step(run) >= self.after_step, self.train_timeout_s, "training steps")
        elapsed = elapsed_s(job)
        self._set_limit(job, signal_minutes(elapsed, self.signal_s), f"attempt 0 training after {elapsed} s")
        if self.restore_min is None:
            return
        log0 = run / "logs" / "attempt-0.rank-0.log"
        self._wait(lambda: log0.exists() and "checkpointed at step" in log0.read_text(errors="replace"), 300,
                   "checkpoint on the time-limit signal in attempt 0")
        self._set_limit(job, self.restore_min, "attempt 0 checkpointed; the requeued attempt must not be signalled")

    def _set_limit(self, job: str, minutes: int, why: str) -> None:
        run_cmd(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], timeout=30)
        self.events.append(f"TimeLimit={minutes} min ({why})")
