"""The checkpointer's policy and its save/resume protocol, without DeepSpeed.

A fake engine writes one torch file into the folder hpctrain's save protocol hands it, a one-rank gloo
group stands in for the ranks (the step's all_reduce of the votes is then the identity), and a fake clock
drives the minutes rule. The files on disk are the real ones: markers, `latest`, pruning.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hpctrain.node.checkpointing import checkpoint as ckpt
from hpctrain.node.checkpointing import checkpointer
from hpctrain.node.checkpointing.checkpointer import (
    REQUEUE_REQUEST,
    Checkpointer,
    Progress,
    SavePolicy,
    StopFlag,
    StopRequested,
    wait_for_requeue,
)
from hpctrain.node.monitor.metrics import MetricsWriter
from hpctrain.node.runconf import NodeInputError

LAYOUT = {"world_size": 1, "dp": 1, "pp": 1, "tp": 1, "zero": 0, "precision": "fp32"}
PER_STEP = 4  # micro-batches per step: the data cursor a checkpoint records is step * PER_STEP


class FakeEngine:
    """DeepSpeed's two checkpoint calls, as the checkpointer uses them."""

    def __init__(self, fail_load: bool = False) -> None:
        self.saves: list[int] = []
        self.loads: list[str] = []
        self.optimizer = None
        self.fail_load = fail_load

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any], save_latest: bool) -> None:
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"client": client_state}, folder / "mp_rank_00_model_states.pt")
        self.saves.append(int(client_state["step"]))

    def load_checkpoint(self, load_dir: str, tag: str, **kw: Any) -> tuple[str | None, dict[str, Any] | None]:
        self.loads.append(tag)
        if self.fail_load:
            raise RuntimeError("size mismatch for model.embed_tokens.weight")
        f = Path(load_dir) / tag / "mp_rank_00_model_states.pt"
        return (str(f), torch.load(f)["client"]) if f.is_file() else (None, None)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any `import deepspeed` on these paths fails the test; the signal handlers are restored after."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    yield
    for s, h in handlers.items():
        signal.signal(s, h)


def make(tmp_path: Path, *, every_steps: int = 0, every_minutes: float = 0.0, last: int = 10, final: bool = True,
         keep: int = 100, clock: Clock | None = None, engine: FakeEngine | None = None,
         stop: StopFlag | None = None) -> Checkpointer:
    policy = SavePolicy(every_steps, every_minutes, last, final, clock=clock or Clock())
    return Checkpointer(engine or FakeEngine(), tmp_path / "checkpoints", policy, stop or StopFlag(), rank=0,
                        keep=keep, layout=LAYOUT)


def installed() -> StopFlag:
    stop = StopFlag()
    stop.install()  # SIGUSR2's default action would end the test process
    return stop


def drive(ck: Checkpointer, start: int = 0, *, clock: Clock | None = None, dt: float = 0.0,
          signal_at: int | None = None) -> list[int]:
    """What the loop does at each step boundary, from `start` to the policy's last step or the stop."""
    for step in range(start + 1, ck.policy.last_step + 1):
        if clock is not None:
            clock.t += dt  # the step's compute
        if step == signal_at:
            signal.raise_signal(signal.SIGUSR2)  # SLURM's pre-timeout signal, during the step
        ck.maybe_save(Progress(step, step * PER_STEP, 100.0 * step), ck.votes())
        if ck.should_stop:
            break
    assert isinstance(ck.engine, FakeEngine)
    return ck.engine.saves


def on_disk(ck: Checkpointer) -> list[int]:
    return ckpt.complete_steps(ck.dir)


def test_every_n_steps_and_the_last_step_once(one_rank: None, tmp_path: Path) -> None:
    ck = make(tmp_path, every_steps=3, last=10, keep=2)
    assert drive(ck) == [3, 6, 9, 10]
    assert on_disk(ck) == [9, 10]  # keep = 2: the older ones were pruned as the newer completed
    assert (ck.dir / "latest").read_text().strip() == "step-10"
    marker = json.loads((ck.dir / "step-10" / ckpt.MARKER).read_text())
    assert marker["step"] == 10 and marker["cursor"] == 10 * PER_STEP and marker["dp"] == 1
    assert not list(ck.dir.glob(".tmp-*"))
    # The last step coinciding with every_steps is one save, not two.
    ck2 = make(tmp_path / "b", every_steps=3, last=9)
    assert drive(ck2) == [3, 6, 9]


def test_every_m_minutes_restarts_after_any_save(one_rank: None, tmp_path: Path) -> None:
    clock = Clock()
    ck = make(tmp_path, every_minutes=1.0, last=10, clock=clock)
    ck.load(None, universal=False)  # the timer starts when training does
    assert drive(ck, clock=clock, dt=25.0) == [3, 6, 9, 10]  # 75 s >= 60 s after each save, and the last
    clock2 = Clock()
    ck2 = make(tmp_path / "b", every_steps=4, every_minutes=1.0, last=10, clock=clock2)
    ck2.load(None, universal=False)
    # 20 s a step: minutes at 3 (60 s), steps at 4, minutes at 7 (60 s after step 4), steps at 8, the last.
    assert drive(ck2, clock=clock2, dt=20.0) == [3, 4, 7, 8, 10]


def test_only_rank0s_clock_votes(tmp_path: Path) -> None:
    clock = Clock()
    policy = SavePolicy(0, 1.0, 10, True, clock=clock)
    ranks = [Checkpointer(FakeEngine(), tmp_path, policy, StopFlag(), rank=r, keep=1, layout=LAYOUT) for r in (0, 1)]
    clock.t += 61
    assert [ck.votes() for ck in ranks] == [[0.0, 1.0], [0.0, 0.0]]


def test_signal_saves_at_the_step_boundary_then_hands_off(one_rank: None, tmp_path: Path) -> None:
    handed: list[int] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: handed.append(signum))  # submitit's handler, say
    ck = make(tmp_path, last=100, final=False, stop=installed())
    assert drive(ck, signal_at=4) == [4]
    assert ck.should_stop and on_disk(ck) == [4]  # complete when maybe_save returned
    metrics = MetricsWriter(tmp_path / "metrics", 0)
    exc = ck.requeue(4, metrics)
    assert isinstance(exc, StopRequested) and handed == [signal.SIGUSR2]
    assert json.loads((tmp_path / "metrics" / "heartbeat").read_text())["state"] == "stopped-on-signal"
    event = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert (event["event"], event["step"], event["signal"]) == ("stopped-on-signal", 4, signal.SIGUSR2)


def test_other_ranks_wait_for_the_requeue_until_rank_0_asked_for_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank other than 0 leaves as soon as this attempt's requeue request is in the run folder (a container's
    scontrol shim writes it; the batch script requeues once the step ends); an older attempt's request, or none,
    keeps it waiting out HPCTRAIN_REQUEUE_GRACE_S, so its exit cannot end the step before rank 0 asked."""
    naps: list[float] = []
    monkeypatch.setattr(checkpointer.time, "sleep", naps.append)
    monkeypatch.setenv("HPCTRAIN_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    wait_for_requeue()
    assert naps == []  # not under SLURM: nothing to wait for
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("HPCTRAIN_REQUEUE_GRACE_S", "0.3")
    request = tmp_path / REQUEUE_REQUEST
    request.write_text("7\n")
    os.utime(request, (1000.0, 1000.0))  # left by an earlier attempt
    clock = iter(range(100))
    monkeypatch.setattr(checkpointer.time, "monotonic", lambda: next(clock) * 0.1)
    wait_for_requeue()
    assert len(naps) == 2  # waited the whole grace (0.3 s on the fake clock)
    naps.clear()
    request.write_text("7\n")  # this attempt's rank 0 asked
    wait_for_requeue()
    assert naps == []


def test_another_ranks_signal_vote_stops_this_one(one_rank: None, tmp_path: Path) -> None:
    ck = make(tmp_path, last=100, final=False)
    assert ck.votes() == [0.0, 0.0]
    assert ck.maybe_save(Progress(7, 7 * PER_STEP, 700.0), [1.0, 0.0]) is not None  # summed over ranks
    assert ck.should_stop and on_disk(ck) == [7]


def test_no_save_without_a_reason_and_none_twice_at_a_step(one_rank: None, tmp_path: Path) -> None:
    ck = make(tmp_path, last=10, final=False)  # every_steps = every_minutes = 0, no export: none at all
    assert drive(ck) == []
    assert not ck.dir.exists()
    ck2 = make(tmp_path / "b", every_steps=5, last=10, stop=installed())
    assert drive(ck2, signal_at=5) == [5]  # due by steps and by the signal: one save
    assert ck2.save(Progress(5, 5 * PER_STEP, 500.0), wait=True) is None
    assert isinstance(ck2.engine, FakeEngine) and ck2.engine.saves == [5]


def test_resume_from_the_latest_complete_then_continue(one_rank: None, tmp_path: Path) -> None:
    first = make(tmp_path, every_steps=3, last=7)
    assert drive(first) == [3, 6, 7]
    (first.dir / ".tmp-step-9").mkdir()  # a crash mid-save: ignored, then cleaned up by the next save
    clock = Clock()
    engine = FakeEngine()
    ck = make(tmp_path, every_steps=3, last=12, clock=clock, engine=engine)
    clock.t += 3600
    point = ckpt.find_resume(ck.dir)
    assert point is not None and point.tag == "step-7"
    assert ck.load(point, universal=False) == Progress(7, 7 * PER_STEP, 700.0)
    assert engine.loads == ["step-7"] and ck.policy.since == clock.t and ck.step0 == 7
    assert drive(ck, start=7) == [9, 12]
    assert on_disk(ck) == [3, 6, 7, 9, 12] and not list(ck.dir.glob(".tmp-*"))


def test_a_failed_load_names_the_folder(one_rank: None, tmp_path: Path) -> None:
    assert drive(make(tmp_path, every_steps=2, last=2)) == [2]
    ck = make(tmp_path, engine=FakeEngine(fail_load=True))
    point = ckpt.find_resume(ck.dir)
    with pytest.raises(NodeInputError, match=r"step-2: cannot load checkpoint \(RuntimeError: size mismatch"):
        ck.load(point, universal=False)


def test_only_the_signal_and_last_saves_wait_for_completion(one_rank: None, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An async writer returns before the files are down unless asked to wait: the save on the signal
    and the last step's must wait, the periodic ones must not (that is their point)."""
    calls: list[tuple[int, bool]] = []
    real = ckpt.save

    def save(engine: Any, ckpt_dir: Path, step: int, *args: Any, wait: bool = True, **kw: Any) -> Any:
        calls.append((step, wait))
        return real(engine, ckpt_dir, step, *args, wait=wait, **kw)

    monkeypatch.setattr(ckpt, "save", save)
    drive(make(tmp_path, every_steps=2, last=5))
    assert calls == [(2, False), (4, False), (5, True)]
    calls.clear()
    drive(make(tmp_path / "b", every_steps=2, last=100, stop=installed()), signal_at=3)
    assert calls == [(2, False), (3, True)]
