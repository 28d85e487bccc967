"""Asynchronous checkpoints: the snapshot, the writer's markers, and real DeepSpeed runs on CPU (gloo).

The loss trajectory does not depend on when checkpoints are taken (resume is bit-identical), so one
synchronous uninterrupted run per (world, ZeRO) is the reference for that case's async crash-and-resume run.
Each launch costs ~10 s of CPU (imports and init): every test below reads the same 3 launches per case, and
the universal conversion continues one of them.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
KILL_CASE = "w2-zero3"  # its async run is killed while a checkpoint is being written


def _launch(case: str, base: Path) -> dict[str, Any]:
    """A case's runs: a sync reference, and an async run that crashes, then resumes (3 launches).

    Most cases crash after step 6 once step-4 is on disk (on a busy machine the writer may lag two tiny steps
    behind) and resume from step-4. KILL_CASE's async run saves every 2 steps, each background file write taking
    2 s: step-4's write is still going when every rank dies at step 5, so step-2 (complete) is the resume point;
    its checkpoints folder as the crash left it is kept aside."""
    world, zero = CASES[case]
    common: dict[str, Any] = {"train": {"steps": 8}, "parallel": {"zero": zero}}
    ref = make_run(base / "sync", checkpoint={"every_steps": 4, "async_save": False}, **common)
    _ok(torchrun(ref, world))
    out: dict[str, Any] = {"sync": ref}
    if case == KILL_CASE:
        run = make_run(base / "async", checkpoint={"every_steps": 2, "async_save": True}, **common)
        crash_env = {"HPCTRAIN_FAIL_AT_STEP": "5", "HPCTRAIN_CKPT_WRITE_DELAY_S": "2"}
        out["resumed_from"] = "step-2"
    else:
        run = make_run(base / "async", checkpoint={"every_steps": 4, "async_save": True}, **common)
        crash_env = {"HPCTRAIN_FAIL_AT_STEP": "6", "HPCTRAIN_FAIL_AFTER_WRITES": "1"}
        out["resumed_from"] = "step-4"
    assert torchrun(run, world, env=crash_env).returncode != 0
    if case == KILL_CASE:
        out["crash_ckpts"] = base / "async-after-crash"
        shutil.copytree(run / "checkpoints", out["crash_ckpts"])
    _ok(torchrun(run, world))
    out["async"] = run
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """case -> its runs, launched on first use and shared by every test of the module that reads the case."""
    built: dict[str, dict[str, Any]] = {}

    def get(case: str) -> dict[str, Any]:
        if case not in built:
            built[case] = _launch(case, tmp_path_factory.mktemp(case))
        return built[case]

    return get


@pytest.fixture(params=list(CASES))
def runs(request: pytest.FixtureRequest, launched: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    return launched(request.param)


@pytest.mark.deepspeed
def test_async_resume_matches_sync_trajectory(runs: dict[str, Any]) -> None:
    ref, run = losses_by_step(runs["sync"]), losses_by_step(runs["async"])
    assert sorted(run) == list(range(1, 9))
    for step in range(1, 9):
        assert run[step] == ref[step], (step, run[step], ref[step])
    starts = [e["resumed_from"] for e in events(runs["async"]) if e["event"] == "start"]
    assert starts == [None, runs["resumed_from"]]
    log = (runs["async"] / "logs" / "attempt-0.rank-0.log").read_text()
    assert "checkpoints: asynchronous ([checkpoint] async_save = true)" in log
    saved = [r for r in metrics(runs["async"]) if r.get("ckpt_blocking_s")]
    assert {r["ckpt_mode"] for r in saved} == {"async"}
    done = [r for r in metrics(runs["async"]) if r.get("ckpt_write_s")]
    assert done and all(r["ckpt_bytes"] > 0 and r["ckpt_gbps"] > 0 for r in done)


@pytest.mark.deepspeed
def test_async_files_equal_sync_files_and_load_normally(runs: dict[str, Any]) -> None:
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
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _assert_same(u, v, f"{where}[{i}]")


@pytest.mark.deepspeed
def test_kill_during_background_write_resumes_from_previous(launched: Callable[[str], dict[str, Any]]) -> None:
    runs = launched(KILL_CASE)
    left = runs["crash_ckpts"]
    assert (left / "latest").read_text().strip() == "step-2"
    assert (left / "step-2" / "hpctrain.json").is_file() and not (left / "step-4").exists()
    assert (left / ".tmp-step-4").is_dir()  # the write that was cut short
    ck = runs["async"] / "checkpoints"  # the resumed attempt (its trajectory: the test above)
    assert not list(ck.glob(".tmp-*")) and (ck / "latest").read_text().strip() == "step-8"


@pytest.mark.deepspeed
def test_async_checkpoint_converts_to_universal(launched: Callable[[str], dict[str, Any]], tmp_path: Path) -> None:
    """An async-written ZeRO-2 checkpoint (2 ranks) resumes on 1 rank through ds_to_universal, which must inject
    the universal_checkpoint_info ZeRO-1/2 checkpoints lack. The async files equal the sync ones (above), so
    this is also the sync ZeRO-2 claim: the w2-zero2 case's async run, continued for 2 more steps on 1 rank."""
    run = tmp_path / "run"
    shutil.copytree(launched("w2-zero2")["async"], run)
    make_run(run, train={"steps": 10}, parallel={"zero": 2}, checkpoint={"every_steps": 4, "async_save": True})
    _ok(torchrun(run, 1, timeout=300))  # ds_to_universal runs inside: one more python with torch and deepspeed
    loss = losses_by_step(run)
    assert sorted(loss) == list(range(1, 11)) and loss[9] < loss[1]
    start = [e for e in events(run) if e["event"] == "start"][-1]
    assert (start["world_size"], start["resumed_from"]) == (1, "step-8")
    assert (run / "checkpoints" / "universal-step-8").is_dir()
