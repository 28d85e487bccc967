"""`hpctrain sync RUN --to tensorboard|wandb|mlflow`: replay a run's metrics into a tracker from the login node.

For clusters whose compute nodes cannot reach the tracker: the ranks write metrics.jsonl (always) and
events.jsonl into the run folder, and the login node replays them. The figures and tags are those rank 0
writes live (hpctrain.runs.tracking.step_events), plus `run/attempt` (the attempt that produced each step:
where it steps up, an attempt began), the validation loss among them. A step that a resumed attempt
ran again counts with its last values, as in the summary.

Idempotent by step, per tag: only steps beyond what the tracker already holds are written, so a second sync
writes nothing and a sync after more training appends the new steps. What "already holds" means:
TensorBoard: the event files in RUN/metrics/tensorboard, read back with TensorBoard's EventAccumulator (the
node's own files included: a sync after a live TensorBoard run adds nothing); MLflow: the MLflow run's metric
history; W&B: the last step this command synced (RUN/metrics/synced-wandb.json; W&B drops steps lower than
its run's last step anyway). Tracker libraries are imported here, inside the functions, never by the CLI.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hpctrain.errors import HpcUsageError
from hpctrain.runs.folder import RunFolder, iter_jsonl, write_private
from hpctrain.runs.tracking import (
    MlflowMonitor,
    Scalar,
    attempt_starts,
    run_config,
    step_events,
)
from hpctrain.spec.model import Spec

SYNC_TARGETS = ("tensorboard", "wandb", "mlflow")


@dataclass
class SyncResult:
    """What one sync wrote: `steps` new optimizer steps (0 on a repeat), into `target`."""

    backend: str
    target: str
    steps: int
    events: int
    attempts: list[tuple[int, int]] = field(default_factory=list)  # (attempt, first step) boundaries

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "target": self.target, "steps": self.steps, "events": self.events,
                "attempts": [{"attempt": a, "step": s} for a, s in self.attempts]}


def run_events(folder: RunFolder) -> tuple[list[Scalar], list[tuple[int, int]]]:
    """Every scalar a sync may write, in step order, and the attempt boundaries (attempt, start step)."""
    last: dict[int, dict[str, Any]] = {}
    for rec in iter_jsonl(folder.metrics_jsonl):
        if isinstance(rec.get("step"), int):
            last[int(rec["step"])] = rec  # a resumed attempt's re-run steps replace the earlier values
    evs = list(iter_jsonl(folder.events_jsonl))
    starts = attempt_bounds(folder, evs, list(iter_jsonl(folder.metrics_jsonl)))
    out: list[Scalar] = []
    for step in sorted(last):
        out += step_events(last[step], next((a for a, s in reversed(starts) if s < step), None))
    out.sort(key=lambda e: e[2])
    return out, starts


def attempt_bounds(folder: RunFolder, evs: list[dict[str, Any]], recs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(attempt, the step it started from) for every attempt that trained, as the other reports count attempts
    (hpctrain.runs.history: in-job restarts and requeues too). The trainer says where it started (rank 0's
    `train` start event); a user's script does not, so its attempt's first metrics record after the attempt's start
    says it; without start times, each place where the step goes down (a rerun) begins the next attempt."""
    from hpctrain.collect.summary import from_folder
    from hpctrain.runs import history

    told = {a.attempt: a.step for a in attempt_starts(evs)}
    steps = [r for r in recs if isinstance(r.get("step"), int)]
    try:
        rows = history.expand(from_folder(folder.path).attempts, folder.path)
    except (OSError, ValueError, TypeError, KeyError):
        rows = []
    out = dict(told)
    for row in rows:
        k, start = int(row["attempt"]), row.get("started")
        if k in out or not isinstance(start, (int, float)):
            continue
        later = [r for r in steps if isinstance(r.get("time"), (int, float)) and r["time"] >= start - 5]
        if later:
            out[k] = later[0]["step"] - 1
    if len(out) < 2:  # no times: a step going down is a rerun
        cuts = [i for i in range(1, len(steps)) if steps[i]["step"] <= steps[i - 1]["step"]]
        nums = [int(r["attempt"]) for r in rows] if len(rows) == len(cuts) + 1 else list(range(len(cuts) + 1))
        if cuts:
            out = {nums[0]: steps[0]["step"] - 1} | {nums[j + 1]: steps[c]["step"] - 1 for j, c in enumerate(cuts)}
    return sorted(out.items())


def _new(events: Iterable[Scalar], last_step: dict[str, int]) -> list[Scalar]:
    """The events past the last step each tag already has (a tag's repeat at one step: the later one)."""
    latest: dict[tuple[str, int], Scalar] = {}
    for tag, value, step in events:
        if step > last_step.get(tag, -1):
            latest[(tag, step)] = (tag, value, step)
    return sorted(latest.values(), key=lambda e: e[2])


def _need(module: str, backend: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise HpcUsageError(f"--to = {backend!r}: {module} is not installed here. Fix: pip install "
                            f"'hpctrain[{backend}]' on this machine (the login node), then sync again")


def sync(folder: RunFolder, spec: Spec, to: str) -> SyncResult:
    """Replay the run folder's metrics into the tracker `to` (see the module's doc for what is skipped)."""
    if to not in SYNC_TARGETS:
        raise HpcUsageError(f"--to = {to!r}: not a tracker sync writes to. Fix: use one of {', '.join(SYNC_TARGETS)}")
    if not folder.metrics_jsonl.is_file():
        raise HpcUsageError(f"RUN = {folder.run_id!r}: no {folder.metrics_jsonl} yet (the run has trained no step). "
                            "Fix: sync once it has; `hpctrain status RUN` shows where it stands")
    _need(to, to)
    events, starts = run_events(folder)
    writer = {"tensorboard": _tensorboard, "wandb": _wandb, "mlflow": _mlflow}[to]
    target, written = writer(folder, spec, events)
    return SyncResult(to, target, len({s for _, _, s in written}), len(written), starts)


# ------------------------------------------------------------------------------------------------ TensorBoard
def tensorboard_last_steps(logdir: str) -> dict[str, int]:
    """The last step of every scalar tag in a TensorBoard log folder, read with TensorBoard's own reader. A tag
    left with no value is not in it: a resumed attempt's restart mark purges every tag's later steps, and DeepSpeed's
    own tags of a user's script (Train/Samples/*, counted in samples) can lose them all."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: max(steps) for tag in acc.Tags().get("scalars", [])
            if (steps := [e.step for e in acc.Scalars(tag)])}


def _tensorboard(folder: RunFolder, spec: Spec, events: list[Scalar]) -> tuple[str, list[Scalar]]:
    """Append to RUN/metrics/tensorboard with tensorboard's event writer (torch's SummaryWriter needs torch, which
    a login node lacks); a fresh events file per sync, in step order, so TensorBoard never sees a restart."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    logdir = folder.tensorboard_dir
    new = _new(events, tensorboard_last_steps(str(logdir)) if logdir.is_dir() else {})
    if new:
        logdir.mkdir(parents=True, exist_ok=True)
        writer = EventFileWriter(str(logdir), filename_suffix=".hpctrain-sync")
        now = time.time()
        for tag, value, step in new:
            writer.add_event(Event(wall_time=now, step=step,
                                   summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))
        writer.close()
    return str(logdir), new


# ------------------------------------------------------------------------------------------------ W&B
def _wandb(folder: RunFolder, spec: Spec, events: list[Scalar]) -> tuple[str, list[Scalar]]:
    """Into the W&B run whose id is the run id (resume allowed: the run the ranks wrote to, if they did), one
    wandb.log per step in step order. WANDB_MODE=offline writes RUN/metrics/wandb/offline-run-* for `wandb sync`."""
    ledger = folder.sync_ledger("wandb")
    try:
        done = int(json.loads(ledger.read_text(encoding="utf-8"))["step"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        done = -1
    new = [e for e in events if e[2] > done]
    if not new:
        return f"W&B run {folder.run_id} (nothing past step {done})", []
    import wandb

    t = spec.tracking
    run = wandb.init(id=folder.run_id, resume="allow", project=t.project, entity=t.entity or None,
                     group=t.group or None, name=spec.name, dir=str(folder.metrics_dir),
                     config=run_config(folder))
    try:
        by_step: dict[int, dict[str, float]] = {}
        for tag, value, step in new:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            run.log(by_step[step], step=step)
    finally:
        run.finish()
    write_private(ledger, json.dumps({"step": new[-1][2], "time": time.time()}) + "\n")
    return f"W&B run {folder.run_id} ({run.settings.mode}, {folder.wandb_dir})", new


# ------------------------------------------------------------------------------------------------ MLflow
def _mlflow(folder: RunFolder, spec: Spec, events: list[Scalar]) -> tuple[str, list[Scalar]]:
    """Into the MLflow run tagged with the run id (the one the ranks wrote to, if they did)."""
    t = spec.tracking
    monitor = MlflowMonitor(t.mlflow_uri, folder.mlflow_dir, t.project, folder.run_id)
    tags = {tag for tag, _, _ in events}
    last = {tag: max(steps) for tag in tags if (steps := monitor.steps(tag))}
    new = _new(events, last)
    if new:
        monitor.write_events(new)
        monitor.log_config(run_config(folder))
    return f"MLflow run {monitor.run_id} ({t.mlflow_uri or folder.mlflow_dir})", new
