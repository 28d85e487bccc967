"""The rank side of the hang watchdog: a thread in every rank writing its progress (format: hpctrain.runs.beats).

The watchdog itself (hpctrain.fault.watchdog) runs in the batch script, outside the ranks, so that a hung
Python cannot stop it; it reads what this writes. Stdlib only.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hpctrain.node.monitor.gpustats import GpuStats
from hpctrain.node.monitor.metrics import attempt_number
from hpctrain.runs import beats


class RankBeat:
    """A daemon thread writing this rank's progress to metrics/ranks/rank-R.json every `interval_s`.

    The training loop only sets attributes (`step`, `phase`); the thread does the I/O, so the cost
    does not depend on the step rate. A rank hung in Python code still beats, but its step stays
    behind its peers' (they wait in the next collective): that names it. A dead or GIL-stuck rank
    stops beating: its file goes stale.
    """

    def __init__(self, metrics_dir: Path, rank: int, interval_s: float = 5.0, gpu: GpuStats | None = None) -> None:
        self.dir = beats.ranks_dir(Path(metrics_dir))
        self.rank, self.interval_s = rank, max(0.2, interval_s)
        self.step, self.phase = 0, "start"
        # Seconds from a step's start to its collective, last COMPUTE_WINDOW steps: the time this rank
        # itself needs, without the wait for its peers (which makes every rank's full step equally long).
        self.compute_s: collections.deque[float] = collections.deque(maxlen=beats.COMPUTE_WINDOW)
        self._since = time.monotonic()
        self.gpu = gpu
        self.host = socket.gethostname()
        self.job = os.environ.get("SLURM_JOB_ID", "")
        self.restart = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
        self.attempt = attempt_number()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failed = False
        self._thread = threading.Thread(target=self._loop, name=f"hpctrain-beat-{rank}", daemon=True)

    def start(self) -> RankBeat:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def set(self, step: int, phase: str) -> None:
        now = time.monotonic()
        if phase == "reduce" and self.phase == "compute" and step == self.step:
            self.compute_s.append(round(now - self._since, 4))
        elif phase == "compute" and (step, phase) != (self.step, self.phase):
            self._since = now
        self.step, self.phase = step, phase

    def stop(self, phase: str = "done") -> None:
        self.phase = phase
        self._stop.set()
        self.write()

    def write(self) -> None:
        with self._lock:  # a beat built before fail() must not land after it
            if not self._failed:
                self._put(beats.beat_name(self.rank), self._record())

    def fail(self, exc: BaseException) -> None:
        """This rank's training raised: stop beating and leave failed-JOB-RESTART-R.json for the watchdog
        (its own file name, so one directory listing a second finds it without reading every beat)."""
        self._stop.set()
        with self._lock:
            was, self.phase, self._failed = self.phase, beats.FAILED, True
            rec = {**self._record(), "was": was, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            self._put(beats.beat_name(self.rank), rec)
            self._put(beats.failed_name(self.job, self.restart, self.rank), rec)

    def _record(self) -> dict[str, Any]:
        rec = {"rank": self.rank, "host": self.host, "step": self.step, "phase": self.phase, "time": time.time(),
               "job": self.job, "restart": self.restart, "attempt": self.attempt, "pid": os.getpid(),
               "compute_s": list(self.compute_s)}
        if self.gpu is not None:
            rec.update(self.gpu.read())
        return rec

    def _put(self, name: str, rec: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a full or flaky filesystem must not cost a training step
            beats.write_record(self.dir, name, rec)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.write()
            self._stop.wait(self.interval_s)
