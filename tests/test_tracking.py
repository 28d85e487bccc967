"""Trackers: [tracking] backends / --track, DeepSpeed's monitor on a real run, and `hpctrain sync`.

The DeepSpeed test trains one two-attempt run (a crash after step 4, a resume from step-3) with every tracker
on, W&B offline (no network), and reads what each tracker's own reader sees. The sync tests replay a run
folder's metrics.jsonl twice into TensorBoard, MLflow and W&B (offline) and count the steps.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain.cli.main import cli
from hpctrain.errors import HpcUsageError
from hpctrain.runs.folder import RunFolder
from hpctrain.runs.tracking import RUN_ID_TAG
from hpctrain.spec.model import resolve
from runkit import losses_by_step, make_run, torchrun

RUN_ID = "trk-20261201-101010-abcd"


def _invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output


def _offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> dict[str, str]:
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _mlflow_steps(folder: RunFolder, tag: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps of `tag` in the MLflow run of RUN_ID, read with MLflow's client from the run folder's file store."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this
    client = MlflowClient(tracking_uri=folder.mlflow_dir.as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string=f"tags.`{RUN_ID_TAG}` = '{RUN_ID}'")
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, tag))


def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _tags(logdir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return list(acc.Tags()["scalars"])


# ---------------------------------------------------------------------------------------------- spec
def test_bad_backend_is_refused_with_the_known_names() -> None:
    with pytest.raises(HpcUsageError) as err:
        resolve(None, {"model.config": "llama-tiny", "tracking.backends": "tensorbord"}, check=False)
    msg = str(err.value)
    assert msg.startswith("tracking.backends = 'tensorbord': not a tracker hpctrain knows "
                          "(did you mean 'tensorboard'?)")
    assert "tensorboard, wandb, csv, mlflow" in msg and "--track" in msg
    code, out = _invoke("plan", "--model", "llama-tiny", "--track", "tensorboard,tensorboard")
    assert code == 2 and "tracking.backends = 'tensorboard': listed twice" in out


def test_track_flag_and_defaults_render_the_monitor_blocks() -> None:
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.deepspeed import build_ds_config

    default = resolve(None, {"model.config": "llama-tiny"}, check=False)
    assert default.tracking.backends == ("tensorboard",)  # on by default: small and offline
    cfg = build_ds_config(default, make_plan(default))
    assert cfg["tensorboard"] == {"enabled": True, "output_path": "metrics", "job_name": "tensorboard"}
    assert "wandb" not in cfg and "csv_monitor" not in cfg
    off = resolve(None, {"model.config": "llama-tiny", "tracking.backends": "none"}, check=False)
    assert off.tracking.backends == ()
    assert not {"tensorboard", "wandb", "csv_monitor"} & set(build_ds_config(off, make_plan(off)))


# ---------------------------------------------------------------------------------------------- sync
def _fake_run(tmp: Path) -> RunFolder:
    """A run folder as two attempts leave it: steps 1-4, then a resume from step 2 that ran 3-6."""
    folder = RunFolder(make_run(tmp / RUN_ID))
    lines = [{"step": s, "loss": 6.0 - s / 10, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": None} for s in (1, 2, 3, 4)]
    lines += [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_per_s": 120.0, "ckpt_blocking_s": 0.5 * (s == 6),
               **({"eval_loss": 4.25, "eval_ppl": 70.1} if s == 4 else {})} for s in (3, 4, 5, 6)]
    folder.metrics_dir.mkdir(parents=True, exist_ok=True)
    folder.metrics_jsonl.write_text("".join(json.dumps(r) + "\n" for r in lines))
    evs = [{"kind": "start", "time": 1.0, "rank": 0, "attempt": 0},
           {"kind": "train", "time": 2.0, "rank": 0, "event": "start", "step": 0},
           {"kind": "start", "time": 3.0, "rank": 0, "attempt": 1},
           {"kind": "train", "time": 4.0, "rank": 0, "event": "start", "step": 2},
           {"kind": "train", "time": 5.0, "rank": 0, "event": "finished", "step": 6, "next_batch_loss": 4.5}]
    folder.events_jsonl.write_text("".join(json.dumps(e) + "\n" for e in evs))
    return folder


def test_sync_twice_writes_no_duplicate_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _fake_run(tmp_path)
    code, out = _invoke("sync", str(folder.path), "--to", "tensorboard")
    assert code == 0, out
    assert "synced 6 steps" in out and "attempt 0 from step 0, attempt 1 from step 2" in out
    code, again = _invoke("sync", str(folder.path), "--to", "tensorboard")
    assert code == 0 and "nothing new to sync" in again
    loss = _scalars(folder.tensorboard_dir, "train/loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]  # once each, after two syncs
    assert dict(loss)[3] == pytest.approx(4.7)  # the resumed attempt's value of a re-run step
    assert _scalars(folder.tensorboard_dir, "run/attempt") == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0),
                                                               (6, 1.0)]
    # eval/loss is the validation loss of the metrics lines ([train] eval_every), never the finished event's
    # loss on the next training batch (the export check).
    assert _scalars(folder.tensorboard_dir, "eval/loss") == [(4, 4.25)]
    assert _scalars(folder.tensorboard_dir, "eval/ppl") == [(4, pytest.approx(70.1))]
    assert _scalars(folder.tensorboard_dir, "checkpoint/blocking_s") == [(6, 0.5)]

    # MLflow: the same, read back from the MLflow run's own history (file store in the run folder).
    assert _invoke("sync", str(folder.path), "--to", "mlflow")[0] == 0
    assert "nothing new" in _invoke("sync", str(folder.path), "--to", "mlflow")[1]
    assert _mlflow_steps(folder, "train/loss", monkeypatch) == [1, 2, 3, 4, 5, 6]

    # W&B offline (no network): one offline run of id RUN_ID; the second sync starts no W&B run at all.
    _offline_wandb(monkeypatch, tmp_path)
    assert _invoke("sync", str(folder.path), "--to", "wandb")[0] == 0
    code, again = _invoke("sync", str(folder.path), "--to", "wandb")
    assert code == 0 and "nothing new" in again
    runs = sorted(p.name for p in folder.wandb_dir.glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].endswith(RUN_ID)


def test_sync_without_the_library_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    folder = _fake_run(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    code, out = _invoke("sync", str(folder.path), "--to", "mlflow")
    assert code == 2 and "mlflow is not installed here" in out and "pip install 'hpctrain[mlflow]'" in out


# ---------------------------------------------------------------------------------------------- a real run
@pytest.mark.deepspeed
def test_two_attempt_run_writes_every_tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    env = _offline_wandb(monkeypatch, tmp_path)
    run = make_run(tmp_path / RUN_ID, tracking={"backends": ["tensorboard", "wandb", "csv", "mlflow"]},
                   checkpoint={"every_steps": 3, "keep": 2, "export_hf": False})
    first = torchrun(run, 2, env={**env, "HPCTRAIN_FAIL_AT_STEP": "4"})
    assert first.returncode != 0
    second = torchrun(run, 2, env={**env, "HPCTRAIN_ATTEMPT": "1"})
    assert second.returncode == 0, f"{second.stdout[-3000:]}\n{second.stderr[-3000:]}"
    folder = RunFolder(run)

    # TensorBoard's own reader: one loss series over steps 1-6 (the resumed attempt's steps replace the crashed
    # attempt's re-run ones), equal to metrics.jsonl's; the attempt steps up where the resume began.
    loss = _scalars(folder.tensorboard_dir, "train/loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert dict(loss) == pytest.approx(losses_by_step(run))
    assert _scalars(folder.tensorboard_dir, "run/attempt") == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 1.0), (5, 1.0),
                                                               (6, 1.0)]
    assert "eval/loss" not in _tags(folder.tensorboard_dir)  # no validation split: no validation loss
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder.tensorboard_dir), size_guidance={"tensors": 0})
    acc.Reload()  # the run's config as TensorBoard text: resolved spec, plan, ds_config
    text = acc.Tensors("hpctrain/config/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert all(k in text for k in ('"zero_stage": 3', '"tracking"', '"zero_optimization"'))
    # W&B offline: one offline run per attempt, every one of them the run id (`wandb sync` makes one run of them).
    runs = sorted(folder.wandb_dir.glob("offline-run-*"))
    assert len(runs) == 2 and {p.name.rsplit("-", 4)[-4:] == RUN_ID.split("-") for p in runs} == {True}
    assert all((p / f"run-{RUN_ID}.wandb").is_file() for p in runs)
    # DeepSpeed's CSV monitor and hpctrain's MLflow monitor got the same figures.
    assert (folder.csv_dir / "train_loss.csv").read_text().splitlines()[0] == "step,loss"
    assert set(_mlflow_steps(folder, "train/loss", monkeypatch)) == {1, 2, 3, 4, 5, 6}  # + the re-run step 4
    # A sync after the live run finds every step in TensorBoard already.
    code, out = _invoke("sync", str(run), "--to", "tensorboard")
    assert code == 0 and "nothing new to sync" in out, out
    assert os.environ["WANDB_MODE"] == "offline" and isinstance(first, subprocess.CompletedProcess)


def test_sync_counts_a_scripts_attempts_without_trainer_events(tmp_path: Path) -> None:
    """A user's script writes no `train` start event: its two attempts (the rerun started again from step 1)
    come from attempts.jsonl's start times, or, without them, from the step going down (was "none recorded")."""
    from hpctrain.collect.sync import attempt_bounds

    folder = RunFolder(make_run(tmp_path / RUN_ID))
    recs = [{"step": s, "time": 100.0 + s} for s in range(1, 58)] + [{"step": s, "time": 500.0 + s}
                                                                    for s in range(1, 61)]
    assert attempt_bounds(folder, [], recs) == [(0, 0), (1, 0)]  # no start times: the rerun's step 1
    folder.attempts_jsonl.write_text("".join(json.dumps(a) + "\n" for a in (
        {"attempt": 0, "job_id": "9", "state": "PREEMPTED", "started": 99.0},
        {"attempt": 1, "job_id": "10", "state": "COMPLETED", "started": 490.0})))
    assert attempt_bounds(folder, [], recs) == [(0, 0), (1, 0)]
    resumed = recs[:57] + [{"step": s, "time": 500.0 + s} for s in range(58, 61)]  # no step goes down
    assert attempt_bounds(folder, [], resumed) == [(0, 0), (1, 57)]
