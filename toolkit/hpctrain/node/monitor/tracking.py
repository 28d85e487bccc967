"""Rank 0's trackers: DeepSpeed's own monitor, with hpctrain's figures written through it.

`deepspeed.initialize` builds DeepSpeed's MonitorMaster (deepspeed.monitor: TensorBoard, W&B, CSV) on rank 0
from ds_config.json's monitor blocks (hpctrain.render.deepspeed.monitor_blocks). hpctrain writes its own
figures into that monitor with `write_events`, at the optimizer step: loss, lr, tokens/s, TFLOPS/MFU, memory,
padding, checkpoint seconds (hpctrain.runs.tracking.STEP_TAGS), the attempt that wrote the step, and the eval
loss at the end. DeepSpeed 0.19.8 has no MLflow monitor: hpctrain.runs.tracking.MlflowMonitor
has the same interface and is written beside it.

W&B: DeepSpeed's block takes project, team and group only; the run's id, resume and folder come from the
environment wandb.init reads (`wandb_env`): the id is the hpctrain run id and resume is allowed, so every
attempt appends to one W&B run. A site profile may set WANDB_MODE=offline for nodes without internet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from typing import Any

from hpctrain.node.monitor.metrics import log
from hpctrain.node.runconf import NodeInputError
from hpctrain.runs.folder import RunFolder
from hpctrain.runs.tracking import (
    TRACKER_EXTRA,
    TRACKER_MODULE,
    MlflowMonitor,
    Scalar,
    TensorBoardWriter,
    run_config,
    step_events,
)
from hpctrain.spec.model import Spec


def check_available(spec: Spec) -> None:
    """Every tracker the spec names is importable here (checked on every rank before any collective, so that
    a missing package fails the job in seconds with the fix, not rank 0 alone inside deepspeed.initialize)."""
    missing = [b for b in spec.tracking.backends
               if TRACKER_MODULE[b] and importlib.util.find_spec(TRACKER_MODULE[b]) is None]
    if missing:
        extras = ",".join(TRACKER_EXTRA[b] for b in missing)
        raise NodeInputError(
            f"[tracking] backends names {', '.join(missing)}, not installed in this node's Python. Fix: install "
            f"them into the node's environment or image (pip install 'hpctrain[{extras}]'), or leave them out "
            f"(--track tensorboard, --track none)")


def wandb_env(paths: RunFolder, spec: Spec) -> dict[str, str]:
    """The variables wandb.init reads that DeepSpeed's wandb block cannot set: one W&B run per hpctrain run."""
    return {"WANDB_RUN_ID": paths.run_id, "WANDB_RESUME": "allow", "WANDB_DIR": str(paths.metrics_dir.absolute()),
            "WANDB_NAME": spec.name}


def prepare_env(paths: RunFolder, spec: Spec, rank: int) -> None:
    """Before deepspeed.initialize (which calls wandb.init on rank 0)."""
    if rank == 0 and "wandb" in spec.tracking.backends:
        os.environ.update(wandb_env(paths, spec))
        # WANDB_SERVICE names the wandb service of the process that exported it (sbatch passes the submitting
        # shell's environment on): a service on another host, or one still holding this run id for an
        # attempt that died, refuses the run ("run ID ... is in use"). This rank starts its own.
        os.environ.pop("WANDB_SERVICE", None)


class Tracker:
    """hpctrain's figures into DeepSpeed's monitor (and MLflow's) on rank 0; a no-op on the other ranks."""

    def __init__(self, monitor: Any, extra: list[MlflowMonitor], rank: int) -> None:
        self.monitor, self.extra, self.rank = monitor, extra, rank

    @classmethod
    def for_engine(cls, engine: Any, paths: RunFolder, spec: Spec, rank: int) -> Tracker:
        monitor = getattr(engine, "monitor", None)
        if monitor is not None:
            # The engine writes lr (and the loss scale) itself at step = samples seen; W&B drops any step lower
            # than the last one it got, so hpctrain's per-optimizer-step figures would vanish there. hpctrain
            # writes lr and the loss scale itself, at the optimizer step; the monitor's writers stay DeepSpeed's.
            monitor.enabled = False
        extra: list[MlflowMonitor] = []
        t = spec.tracking
        if rank == 0 and "mlflow" in t.backends:
            extra.append(MlflowMonitor(t.mlflow_uri, paths.mlflow_dir, t.project, paths.run_id))
        return cls(monitor, extra, rank)

    def write(self, events: list[Scalar]) -> None:
        if self.rank != 0 or not events:
            return
        if self.monitor is not None:
            self.monitor.write_events(events)
        for m in self.extra:
            m.write_events(events)

    def step(self, record: dict[str, Any], attempt: int) -> None:
        self.write(step_events(record, attempt))

    def resumed_at(self, step: int) -> None:
        """A resumed attempt writes again from step+1: TensorBoard gets a SessionLog START there, which its reader
        takes as a restart and drops the earlier attempts' values from that step on (the steps re-run after the
        checkpoint), as torch's SummaryWriter(purge_step=...) does. W&B keeps a step's first values; CSV all."""
        tb = getattr(getattr(self.monitor, "tb_monitor", None), "summary_writer", None)
        if self.rank != 0 or tb is None or step <= 0:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        tb.file_writer.add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
        tb.flush()

    def log_config(self, paths: RunFolder) -> None:
        """The run's resolved spec, plan and DeepSpeed config as the tracker run's config."""
        if self.rank != 0:
            return
        config = run_config(paths)
        if getattr(self.monitor, "wandb_monitor", None) is not None:
            import wandb

            wandb.config.update(config, allow_val_change=True)
        tb = getattr(getattr(self.monitor, "tb_monitor", None), "summary_writer", None)
        if tb is not None:
            tb.add_text("hpctrain/config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
            tb.flush()
        for m in self.extra:
            m.log_config(config)

    def close(self) -> None:
        """At the end of training: TensorBoard's file flushed, the W&B run finished (a resumed attempt reopens it)."""
        if self.rank != 0:
            return
        tb = getattr(getattr(self.monitor, "tb_monitor", None), "summary_writer", None)
        if tb is not None:
            tb.close()
        if getattr(self.monitor, "wandb_monitor", None) is not None:
            import wandb

            wandb.finish()


class ScriptTracker:
    """A user's program's figures in its trackers while it runs: the node entry on rank 0 follows metrics.jsonl
    (what hpctrain.runtime.report() appends) and writes each new record as the trainer's Tracker.step does: the
    same tags and attempt (hpctrain.runs.tracking.step_events), a restart mark where a resumed attempt begins,
    the run's config. TensorBoard through TensorBoardWriter (DeepSpeed's TensorBoardMonitor needs a process group
    in this process), MLflow through MlflowMonitor, as the trainer. W&B and CSV: `hpctrain sync` (the W&B run
    would be this wrapper's, beside the one the program may open itself). A tracker that fails costs a log line:
    the program trains on, and `hpctrain sync` fills in what is missing (by step, per tag)."""

    def __init__(self, paths: RunFolder, spec: Spec, attempt: int, poll_s: float = 1.0) -> None:
        self.paths, self.spec, self.attempt, self.poll_s = paths, spec, attempt, poll_s
        try:  # records already there are earlier attempts' (their trackers, or sync, wrote them)
            self.offset = paths.metrics_jsonl.stat().st_size
        except OSError:
            self.offset = 0
        self.monitors: list[Any] | None = None  # opened at the first record: a program that never reports opens none
        self.steps = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="hpctrain-script-tracker", daemon=True)

    @classmethod
    def wanted(cls, spec: Spec) -> bool:
        return any(b in spec.tracking.backends for b in ("tensorboard", "mlflow"))

    def start(self) -> ScriptTracker:
        self.thread.start()
        return self

    def close(self) -> None:
        """After the program ended: what it reported last is written, the files closed."""
        self.done.set()
        self.thread.join(timeout=60)
        for m in self.monitors or []:
            if isinstance(m, TensorBoardWriter):
                m.close()

    def _follow(self) -> None:
        while True:
            last = self.done.is_set()
            try:
                self._drain()
            except Exception as err:  # noqa: BLE001 - a tracker's failure must not stop the program (class doc)
                log.warning("writing the program's metrics to its trackers stopped: %s (hpctrain sync fills them in)",
                            err)
                return
            if last:
                return
            self.done.wait(self.poll_s)

    def _drain(self) -> None:
        """Every whole line appended since the last call (a line being written waits for the next)."""
        try:
            with open(self.paths.metrics_jsonl, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        whole = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                self._write(rec)

    def _write(self, rec: dict[str, Any]) -> None:
        if self.monitors is None:
            self.monitors = self._open(first_step=int(rec["step"]))
        events = step_events(rec, self.attempt)
        for m in self.monitors:
            m.write_events(events)
        self.steps += 1

    def _open(self, first_step: int) -> list[Any]:
        out: list[Any] = []
        if "tensorboard" in self.spec.tracking.backends:
            tb = TensorBoardWriter(self.paths.tensorboard_dir, f".hpctrain-script.attempt-{self.attempt}")
            if first_step > 1:  # a resumed attempt: the steps it runs again replace the earlier attempt's
                tb.restart_at(first_step)
            out.append(tb)
        if "mlflow" in self.spec.tracking.backends:
            t = self.spec.tracking
            ml = MlflowMonitor(t.mlflow_uri, self.paths.mlflow_dir, t.project, self.paths.run_id)
            ml.log_config(run_config(self.paths))
            out.append(ml)
        return out
