"""What hpctrain tells a tracker: the names of the trackers, and the scalar figures of a metrics.jsonl record.

One table for both writers: rank 0 during training (hpctrain.node.monitor.tracking, through DeepSpeed's monitor) and
`hpctrain sync` on the login node (hpctrain.collect.sync, replaying metrics.jsonl), so a figure has the same
tag whichever wrote it, and a sync into the folder the node wrote fills in missing steps only.

The x axis is the optimizer step (metrics.jsonl's `step`), the step hpctrain's logs, summary and checkpoints
count in. Stdlib only: the node and the login side import it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from hpctrain.runs.folder import RunFolder

# The trackers a run may name in [tracking] backends / --track (DeepSpeed's monitor blocks, and MLflow,
# which DeepSpeed 0.19.8 has no monitor for: hpctrain.node.monitor.tracking.MlflowMonitor).
TRACKERS = ("tensorboard", "wandb", "csv", "mlflow")
# The module each one needs, and the hpctrain extra that installs it.
TRACKER_MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "csv": "", "mlflow": "mlflow"}
TRACKER_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "csv": "", "mlflow": "mlflow"}

# metrics.jsonl field -> tracker tag. A field that is absent, null or not a finite number is not written.
STEP_TAGS: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "trained_tokens_per_s": "train/trained_tokens_per_s",  # the tokens the loss covers (SFT: the responses)
    "tflops": "train/tflops_per_device",
    "mfu": "train/mfu",
    "padding_frac": "train/padding_frac",
    "loss_scale": "train/loss_scale",
    "gpu_mem_gb": "memory/gpu_max_allocated_gb",
    "gpu_reserved_gb": "memory/gpu_max_reserved_gb",
    "host_mem_gb": "memory/host_rss_gb",
    "host_peak_gb": "memory/host_peak_gb",
    "ckpt_blocking_s": "checkpoint/blocking_s",
    "ckpt_write_s": "checkpoint/write_s",
    "ckpt_gbps": "checkpoint/write_gbps",
    # The validation loss and perplexity ([train] eval_every, on the steps that evaluated): the one meaning of
    # eval_loss, as in the summary and the plot.
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/ppl",
}
# Written only where measured: a checkpoint's seconds on its step (not zeros between), GPU memory on GPU ranks.
ONLY_WHEN_POSITIVE = frozenset({"ckpt_blocking_s", "ckpt_write_s", "ckpt_gbps", "gpu_mem_gb", "gpu_reserved_gb"})
# The attempt that wrote each step: where it steps up, an attempt began (a boundary on the step axis).
ATTEMPT_TAG = "run/attempt"

# The tag that finds an hpctrain run's MLflow run again (MLflow chooses its own run ids).
RUN_ID_TAG = "hpctrain.run_id"

Scalar = tuple[str, float, int]  # (tag, value, step): DeepSpeed's monitor event (Monitor.write_events)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def step_events(record: dict[str, Any], attempt: int | None = None) -> list[Scalar]:
    """The scalar events of one metrics.jsonl record, in STEP_TAGS order, and the attempt that wrote it."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return []
    out: list[Scalar] = []
    for key, tag in STEP_TAGS.items():
        value = _number(record.get(key))
        if value is None or (key in ONLY_WHEN_POSITIVE and value <= 0):
            continue
        out.append((tag, value, step))
    if attempt is not None:
        out.append((ATTEMPT_TAG, float(attempt), step))
    return out


@dataclass(frozen=True)
class AttemptStart:
    """Where an attempt began training: its number and the step it started from (0, or the resume point)."""

    attempt: int
    step: int


def attempt_starts(events: Iterable[dict[str, Any]]) -> Iterator[AttemptStart]:
    """Attempt boundaries from events.jsonl: rank 0's `train` event "start" (which carries the step it
    starts from) numbered by the attempt of rank 0's `start` event before it."""
    attempt = 0
    for ev in events:
        if ev.get("rank") != 0:
            continue
        if ev.get("kind") == "start" and isinstance(ev.get("attempt"), int):
            attempt = int(ev["attempt"])
        elif ev.get("kind") == "train" and ev.get("event") == "start" and isinstance(ev.get("step"), int):
            yield AttemptStart(attempt, int(ev["step"]))


class MlflowMonitor:
    """DeepSpeed's Monitor interface (`write_events([(tag, value, step), ...])`) for MLflow, which DeepSpeed
    0.19.8 has no monitor for. One MLflow run per hpctrain run: MLflow makes its own run ids, so the run is
    found again by its tag `hpctrain.run_id` (every attempt and `hpctrain sync` append to it).

    `uri` "" = a file store at `store_dir` (MLflow 3 keeps its file store behind MLFLOW_ALLOW_FILE_STORE; a
    run folder on a shared filesystem has no database server). mlflow is imported here, not at module level.
    """

    def __init__(self, uri: str, store_dir: Path, experiment: str, run_id: str) -> None:
        import os

        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            store_dir.mkdir(parents=True, exist_ok=True)
            uri = store_dir.absolute().as_uri()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        runs = self.client.search_runs([exp_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        self.run_id: str = runs[0].info.run_id if runs else self.client.create_run(
            exp_id, run_name=run_id, tags={RUN_ID_TAG: run_id}).info.run_id

    def write_events(self, event_list: list[Scalar]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value, step in event_list]
        for i in range(0, len(metrics), 1000):  # MLflow's log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def steps(self, tag: str) -> set[int]:
        """The steps of `tag` already in the MLflow run."""
        return {m.step for m in self.client.get_metric_history(self.run_id, tag)}

    def log_config(self, config: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, config, "hpctrain_config.json")


class TensorBoardWriter:
    """DeepSpeed's Monitor interface (`write_events`) into TensorBoard event files, with tensorboard's own writer:
    no torch (DeepSpeed's TensorBoardMonitor needs torch's SummaryWriter and an initialized process group, which
    the node entry that wraps a user's script and the login node have not). One new events file in `logdir`,
    flushed at every write: TensorBoard shows the steps as they come."""

    def __init__(self, logdir: Path, suffix: str) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self.writer = EventFileWriter(str(logdir), filename_suffix=suffix)

    def write_events(self, event_list: list[Scalar], wall_time: float | None = None) -> None:
        import time

        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        now = time.time() if wall_time is None else wall_time
        for tag, value, step in event_list:
            self.writer.add_event(Event(wall_time=now, step=step,
                                        summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))
        self.writer.flush()

    def restart_at(self, step: int) -> None:
        """A SessionLog START at `step`: TensorBoard's reader drops the values earlier files hold from that step
        on (the steps a resumed attempt runs again), as torch's SummaryWriter(purge_step=...) makes it do."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def run_config(folder: RunFolder) -> dict[str, Any]:
    """The tracker run's config: the resolved spec, the plan and the DeepSpeed config, as the run folder has them."""
    return {"spec": tomllib.loads(folder.spec_toml.read_text(encoding="utf-8")),
            "plan": json.loads(folder.plan_json.read_text(encoding="utf-8")),
            "ds_config": json.loads(folder.ds_config_json.read_text(encoding="utf-8"))}
