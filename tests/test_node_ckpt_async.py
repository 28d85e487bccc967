"""Asynchronous checkpoints: the snapshot, the writer's markers, and real DeepSpeed runs on CPU (gloo).

The loss trajectory does not depend on when checkpoints are taken (resume is bit-identical), so one
synchronous uninterrupted run per (world, ZeRO) is the reference for every async crash-and-resume run.
"""

from __future__ import annotations

import subprocess
import time
from collections import OrderedDict
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from hpctrain.node.checkpointing import checkpoint as ckpt
from hpctrain.node.checkpointing import ckpt_async
from runkit import events, losses_by_step, make_run, metrics, torchrun


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"


# ------------------------------------------------------------------------------------------ no process group
def test_snapshot_is_a_frozen_copy_that_keeps_sharing(tmp_path: Path) -> None:
    flat = torch.arange(10, dtype=torch.float32)
    sd = OrderedDict(a=flat[:4], b=flat[4:], tied=flat[:4], n=torch.nn.Parameter(torch.ones(3)), i=7,
                     s=torch.Size([2, 3]), nested={"x": [torch.zeros(2, dtype=torch.int64)], "e": torch.empty(0)})
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    arena = ckpt_async.Arena(pin=False)
    snap = ckpt_async.snapshot(sd, arena, {})
    flat.add_(100)  # training goes on: the snapshot must not change
    assert snap["a"].tolist() == [0, 1, 2, 3] and snap["b"].tolist() == [4, 5, 6, 7, 8, 9]
    assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()
    assert isinstance(snap["n"], torch.nn.Parameter) and snap["s"] == torch.Size([2, 3])
    assert snap._metadata == {"": {"version": 1}}
    ckpt_async.write_file(snap, tmp_path / "f.pt")
    back = torch.load(tmp_path / "f.pt", weights_only=False)
    assert back["tied"].tolist() == [0, 1, 2, 3] and back["nested"]["x"][0].dtype == torch.int64
    import zipfile

    records = [n for n in zipfile.ZipFile(tmp_path / "f.pt").namelist() if "/data/" in n and n[-1].isdigit()]
    assert len(records) == 4  # flat (once, not per view), n, x, e
    before = arena.capacity
    arena.reset()
    ckpt_async.snapshot(sd, arena, {})
    assert arena.capacity == before  # buffers are reused across saves


def test_writer_marks_done_and_rank0_finalises(tmp_path: Path) -> None:
    io = ckpt_async.CheckpointIO(None, async_mode=True, pin=False, rank=0, world=2, wait_s=5)
    tmp = tmp_path / ".tmp-step-3"
    tmp.mkdir()
    io.begin(3, tmp)
    io.save({"w": torch.ones(4)}, str(tmp / "a.pt"))
    calls = []
    job = io.seal(lambda: calls.append("final") or 123, None)
    time.sleep(0.3)
    assert not job.done.is_set() and (tmp / ".done" / "rank-0").is_file()  # waiting for rank 1's marker
    (tmp / ".done" / "rank-1").write_text("0\n")
    assert io.wait() is job and job.error is None and calls == ["final"] and job.total_bytes == 123


def test_writer_failure_is_reported_and_marked(tmp_path: Path) -> None:
    io = ckpt_async.CheckpointIO(None, async_mode=True, pin=False, rank=1, world=2, wait_s=5)
    tmp = tmp_path / ".tmp-step-3"
    tmp.mkdir()
    io.begin(3, tmp)
    io.save({"w": torch.ones(4)}, str(tmp / "missing-dir" / "a.pt"))
    io.seal(None, None)
    job = io.wait()
    assert job is not None and job.error is not None
    assert (tmp / ".done" / "rank-1.failed").is_file()
    with pytest.raises(ckpt_async.CheckpointWriteError, match="rank-1 could not write"):
        ckpt_async.wait_markers(tmp, 2, time.time() + 1)


def test_rank0_gives_up_on_a_missing_rank(tmp_path: Path) -> None:
    (tmp_path / ".done").mkdir()
    (tmp_path / ".done" / "rank-0").write_text("1\n")
    with pytest.raises(ckpt_async.CheckpointWriteError, match=r"ranks \[1\] did not report"):
        ckpt_async.wait_markers(tmp_path, 2, time.time() + 0.2)


def test_auto_mode_needs_gpu_and_host_memory() -> None:
    one_b = ckpt.estimate_state_bytes(10**9, dp=1, zero=3, precision="bf16")
    assert one_b == 14 * 10**9
    assert ckpt.choose_async("auto", True, one_b, 1, 128 * 10**9)[0]
    on, why = ckpt.choose_async("auto", True, one_b, 8, 128 * 10**9)
    assert not on and "exceeds half the free host memory" in why
    assert not ckpt.choose_async("auto", False, 1, 1, 10**12)[0]
    assert ckpt.choose_async(True, False, 1, 1, None) == (True, "[checkpoint] async_save = true")


def test_no_snapshot_buffers_without_a_scheduled_save(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A run that saves only on a signal neither writes in the background nor reserves the snapshot's host
    memory (at 3B with optimizer offload that was ~45 GB of pinned memory beside CPU Adam's); one that saves
    by steps reserves the rank's whole state."""
    from hpctrain.node.checkpointing.checkpointer import Checkpointer, StopFlag
    from hpctrain.spec.model import from_toml_text
    from runkit import spec_toml, tiny_tables

    on, why = ckpt.choose_async("auto", True, 10**9, 1, 10**12, scheduled=False)
    assert not on and "no save is scheduled" in why
    seen: list[dict[str, object]] = []
    monkeypatch.setattr(ckpt_async, "install", lambda engine, **kw: seen.append(kw))
    monkeypatch.setattr(ckpt, "host_available_bytes", lambda: 10**12)
    for every in (0, 5):
        spec = from_toml_text(spec_toml(tiny_tables(checkpoint={"every_steps": every, "export_hf": False})))
        Checkpointer.for_run(object(), spec, tmp_path, StopFlag(run_dir=tmp_path), rank=0, world=1, dp=1, zero=3,
                             use_gpu=True, n_params=10**9)
    state = ckpt.estimate_state_bytes(10**9, 1, 3, spec.train.precision)
    assert [(kw["async_mode"], kw["reserve_bytes"]) for kw in seen] == [(False, 0), (True, state)]


# ------------------------------------------------------------------------------------------ real DeepSpeed
CASES = {"w2-zero3": (2, 3), "w1-zero2": (1, 2), "w2-zero2": (2, 2), "w1-zero3": (1, 3)}


@pytest.fixture(scope="module", params=list(CASES))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per (world, ZeRO): a sync reference, an async run that crashes after step 6 and resumes from
    step-4, and (w2-zero3) an async run killed while step-4 is still being written."""
    world, zero = CASES[request.param]
    base = tmp_path_factory.mktemp(request.param)
    common: dict = {"train": {"steps": 8}, "parallel": {"zero": zero}}
    ref = make_run(base / "sync", checkpoint={"every_steps": 4, "async_save": False}, **common)
    _ok(torchrun(ref, world))
    out = {"sync": ref}
    crash = make_run(base / "async", checkpoint={"every_steps": 4, "async_save": True}, **common)
    # The crash comes once step-4 is on disk: on a busy machine the writer may lag two tiny steps behind.
    crash_env = {"HPCTRAIN_FAIL_AT_STEP": "6", "HPCTRAIN_FAIL_AFTER_WRITES": "1"}
    assert torchrun(crash, world, env=crash_env).returncode != 0
    _ok(torchrun(crash, world))
    out["async"] = crash
    if request.param == "w2-zero3":
        # Each background file write takes 2 s: step-4's write is still going when every rank dies at
        # step 5, so step-2 (complete) is the resume point.
        kill = make_run(base / "kill", checkpoint={"every_steps": 2, "async_save": True}, **common)
        first = torchrun(kill, world, env={"HPCTRAIN_FAIL_AT_STEP": "5", "HPCTRAIN_CKPT_WRITE_DELAY_S": "2"})
        assert first.returncode != 0
        out["kill_ckpts"] = base / "kill-after-crash"
        import shutil

        shutil.copytree(kill / "checkpoints", out["kill_ckpts"])
        _ok(torchrun(kill, world))
        out["kill"] = kill
    return out


@pytest.mark.deepspeed
def test_async_resume_matches_sync_trajectory(runs: dict[str, Path]) -> None:
    ref, run = losses_by_step(runs["sync"]), losses_by_step(runs["async"])
    assert sorted(run) == list(range(1, 9))
    for step in range(1, 9):
        assert run[step] == ref[step], (step, run[step], ref[step])
    starts = [e["resumed_from"] for e in events(runs["async"]) if e["event"] == "start"]
    assert starts == [None, "step-4"]
    log = (runs["async"] / "logs" / "attempt-0.rank-0.log").read_text()
    assert "checkpoints: asynchronous ([checkpoint] async_save = true)" in log
    saved = [r for r in metrics(runs["async"]) if r.get("ckpt_blocking_s")]
    assert {r["ckpt_mode"] for r in saved} == {"async"}
    done = [r for r in metrics(runs["async"]) if r.get("ckpt_write_s")]
    assert done and all(r["ckpt_bytes"] > 0 and r["ckpt_gbps"] > 0 for r in done)


@pytest.mark.deepspeed
def test_async_files_equal_sync_files_and_load_normally(runs: dict[str, Path]) -> None:
    """Same state at step 8 -> same tensors in every file DeepSpeed wrote (torch.load, the load path)."""
    a, s = runs["async"] / "checkpoints" / "step-8", runs["sync"] / "checkpoints" / "step-8"
    names = sorted(p.name for p in s.glob("*_states.pt"))
    assert names and names == sorted(p.name for p in a.glob("*_states.pt"))
    for name in names:
        x, y = torch.load(a / name, weights_only=False), torch.load(s / name, weights_only=False)
        _assert_same(x, y, name)
    assert ckpt.find_resume(runs["async"] / "checkpoints").tag == "step-8"  # manifest sizes check out


def _assert_same(x: object, y: object, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and set(x) == set(y), where
        for k in x:
            if k not in ("ds_config",):
                _assert_same(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same(u, v, f"{where}[{i}]")


@pytest.mark.deepspeed
def test_kill_during_background_write_resumes_from_previous(runs: dict[str, Path]) -> None:
    if "kill" not in runs:
        pytest.skip("w2-zero3 only (each launch costs ~10 s)")
    left = runs["kill_ckpts"]
    assert (left / "latest").read_text().strip() == "step-2"
    assert (left / "step-2" / "hpctrain.json").is_file() and not (left / "step-4").exists()
    assert (left / ".tmp-step-4").is_dir()  # the write that was cut short
    starts = [e["resumed_from"] for e in events(runs["kill"]) if e["event"] == "start"]
    assert starts == [None, "step-2"]
    ref, run = losses_by_step(runs["sync"]), losses_by_step(runs["kill"])
    assert all(run[s] == ref[s] for s in range(1, 9))
    ck = runs["kill"] / "checkpoints"
    assert not list(ck.glob(".tmp-*")) and (ck / "latest").read_text().strip() == "step-8"


@pytest.mark.deepspeed
def test_async_checkpoint_converts_to_universal(tmp_path: Path) -> None:
    """An async-written ZeRO-2 checkpoint (2 ranks) resumes on 1 rank through ds_to_universal."""
    run = make_run(tmp_path / "run", train={"steps": 4}, parallel={"zero": 2},
                   checkpoint={"every_steps": 4, "async_save": True})
    _ok(torchrun(run, 2))
    make_run(run, train={"steps": 6}, parallel={"zero": 2}, checkpoint={"every_steps": 4, "async_save": True})
    _ok(torchrun(run, 1))
    loss = losses_by_step(run)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6] and loss[5] < loss[1]
    assert (run / "checkpoints" / "universal-step-4").is_dir()
