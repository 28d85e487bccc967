"""events.jsonl: the node writes its failure as an event, and the collector classifies from it (logs or not)."""

from __future__ import annotations

import json
import multiprocessing
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hpctrain.collect import summary as collect
from hpctrain.runs import events
from hpctrain.runs.events import Event
from hpctrain.states import ExitCode, FailureClass


def _failure(rank: int, host: str, cls: str, exception: str = "", message: str = "", attempt: int = 0,
             job_id: str = "123", t: float = 1000.0, exit_code: int = 1) -> Event:
    return Event(kind=events.FAILURE, time=t, rank=rank, host=host, job_id=job_id, attempt=attempt,
                 failure_class=cls, exception=exception, message=message or exception, exit_code=exit_code,
                 traceback=("Traceback (most recent call last):", '  File "train.py", line 1, in step', exception))


def _run_folder(tmp_path: Path, state: str = "FAILED", exit_code: str = "1:0", job_id: str = "123") -> Path:
    run = tmp_path / "run-1"
    for sub in ("logs", "metrics", "submitit", "checkpoints"):
        (run / sub).mkdir(parents=True)
    (run / "attempts.jsonl").write_text(json.dumps({"attempt": 0, "job_id": job_id, "state": state,
                                                    "nodes": "node[1-2]", "started": 900.0, "ended": 1010.0,
                                                    "exit_code": exit_code}) + "\n")
    return run


def _summarize(run: Path) -> dict[str, Any]:
    return collect.build_run(collect.from_folder(run))["attempts"][0]


# -- the file ---------------------------------------------------------------------------------------
def test_round_trip_keeps_fields_and_skips_torn_lines(tmp_path: Path) -> None:
    ev = _failure(3, "node4", FailureClass.GPU_OOM, "torch.OutOfMemoryError: CUDA out of memory")
    events.append_event(tmp_path, ev)
    with open(tmp_path / events.EVENTS, "a") as fh:
        fh.write('{"kind": "failure", "time": 12')  # a rank killed mid-write
    back = events.read_events(tmp_path)
    assert back == [ev]
    line = json.loads((tmp_path / events.EVENTS).read_text().splitlines()[0])
    assert {"time", "kind", "class", "rank", "host", "job_id", "attempt", "message", "exit_code"} <= set(line)
    assert line["class"] == "gpu_oom" and line["kind"] == "failure"


def test_long_texts_are_cut_so_a_line_stays_one_small_write(tmp_path: Path) -> None:
    events.append_event(tmp_path, _failure(0, "h", FailureClass.PYTHON_EXCEPTION, "ValueError: " + "x" * 50_000))
    assert len((tmp_path / events.EVENTS).read_bytes()) < 8000


def _writer(args: tuple[str, int]) -> None:
    root, rank = args
    for i in range(200):
        events.append_event(root, _failure(rank, f"node{rank}", FailureClass.COMM_TIMEOUT, f"E{i}: " + "y" * 1500))


def test_many_ranks_appending_at_once_leave_whole_lines(tmp_path: Path) -> None:
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), r) for r in range(4)])
    lines = (tmp_path / events.EVENTS).read_text().splitlines()
    assert len(lines) == 800 and all(json.loads(ln)["kind"] == "failure" for ln in lines)


# -- the node writes it -----------------------------------------------------------------------------
def test_node_failure_on_bad_input_writes_the_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that refuses its input exits 2 and says so in events.jsonl (class, rank, host, attempt, code)."""
    from hpctrain.node.launch import main

    for k in [k for k in __import__("os").environ if k.startswith(("SLURM", "SUBMITIT_", "RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.setenv("HPCTRAIN_ATTEMPT", "2")
    run = tmp_path / "run"
    run.mkdir()  # no spec.toml: bad input
    with pytest.raises(SystemExit) as ex:
        main.run(str(run))
    assert ex.value.code == ExitCode.INPUT
    evs = events.read_events(run)
    assert [e.kind for e in evs] == [events.START, events.FAILURE]
    fail = evs[-1]
    assert (fail.failure_class, fail.rank, fail.host, fail.attempt, fail.exit_code) == ("input_error", 0, "node7", 2, 2)
    assert "spec.toml" in fail.message


def test_exceptions_are_classified_by_class_not_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.node.dist import OtherRankFailed
    from hpctrain.node.launch.main import PreflightFailed, failure_of
    from hpctrain.node.runconf import NodeInputError

    class OutOfMemoryError(RuntimeError):
        pass

    class DistError(RuntimeError):
        pass

    # torch is looked up in sys.modules, never imported: stand-ins with torch's class names and places.
    fake_torch, fake_dist = types.ModuleType("torch"), types.ModuleType("torch.distributed")
    fake_torch.OutOfMemoryError = OutOfMemoryError  # type: ignore[attr-defined]
    fake_dist.DistError = DistError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake_dist)

    class StopRequested(Exception):  # a user's class that happens to share hpctrain's name: a user bug
        pass

    assert failure_of(NodeInputError("x")) == (FailureClass.INPUT_ERROR, ExitCode.INPUT)
    assert failure_of(PreflightFailed("x")) == (FailureClass.PREFLIGHT, ExitCode.PREFLIGHT)
    assert failure_of(OtherRankFailed()) == (None, ExitCode.ERROR)
    assert failure_of(MemoryError()) == (FailureClass.HOST_OOM, ExitCode.ERROR)
    assert failure_of(OutOfMemoryError("CUDA out of memory")) == (FailureClass.GPU_OOM, ExitCode.ERROR)
    assert failure_of(DistError("gloo timed out")) == (FailureClass.COMM_TIMEOUT, ExitCode.ERROR)
    assert failure_of(StopRequested()) == (FailureClass.PYTHON_EXCEPTION, ExitCode.ERROR)
    assert failure_of(ValueError("boom")) == (FailureClass.PYTHON_EXCEPTION, ExitCode.ERROR)


# -- the collector reads it -------------------------------------------------------------------------
def test_summary_names_class_rank_host_from_the_event_without_any_log(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    events.append_event(run, _failure(1, "node2", FailureClass.PYTHON_EXCEPTION, "ValueError: boom at step 7"))
    row = _summarize(run)
    assert row["failure_class"] == "python_exception"
    f = row["failure"]
    assert (f["rank"], f["host"], f["source"], f["exception"]) == (1, "node2", "events.jsonl",
                                                                   "ValueError: boom at step 7")
    assert f["last_lines"][-1] == "ValueError: boom at step 7"


def test_event_outranks_the_same_evidence_in_the_logs(tmp_path: Path) -> None:
    """rank 0's log shows an exception a second earlier, but the ranks' events say rank 1 failed first."""
    run = _run_folder(tmp_path)
    (run / "logs" / "attempt-0.rank-0.log").write_text(
        "1970-01-01T00:16:30 rank0 ERROR training failed:\nTraceback (most recent call last):\n"
        '  File "x.py", line 1, in f\nValueError: seen in a log\n')
    events.append_event(run, _failure(1, "node2", FailureClass.PYTHON_EXCEPTION, "KeyError: 'tokens'"))
    f = _summarize(run)["failure"]
    assert (f["rank"], f["exception"], f["source"]) == (1, "KeyError: 'tokens'", "events.jsonl")


def test_third_party_text_in_a_plain_exception_is_still_read(tmp_path: Path) -> None:
    """gloo raises RuntimeError: the node calls it python_exception, the collector's patterns see a lost peer."""
    run = _run_folder(tmp_path)
    events.append_event(run, _failure(0, "node1", FailureClass.PYTHON_EXCEPTION,
                                      "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                      "[10.0.0.2]:21000"))
    assert _summarize(run)["failure_class"] == "comm_timeout"


def test_input_error_and_consequences(tmp_path: Path) -> None:
    """Bad input is a user error the summary names; a rank that only stopped because another failed is
    never the cause."""
    run = _run_folder(tmp_path, exit_code="2:0")
    events.append_event(run, Event(kind=events.FAILURE, time=999.0, rank=1, host="node2", attempt=0, job_id="123",
                                   message="another rank failed", exit_code=1))
    events.append_event(run, _failure(0, "node1", FailureClass.INPUT_ERROR,
                                      message="[data] source = 'x.jsonl': no such file. Fix: ...", exit_code=2))
    f = _summarize(run)["failure"]
    assert (f["failure_class"], f["rank"], f["host"]) == ("input_error", 0, "node1")
    assert f["message"].startswith("[data] source")


def test_old_folders_without_events_still_classify_by_exit_code(tmp_path: Path) -> None:
    assert _summarize(_run_folder(tmp_path, exit_code="2:0"))["failure_class"] == "input_error"


def test_other_attempts_events_are_not_this_attempts(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, state="COMPLETED", exit_code="0:0")
    events.append_event(run, _failure(1, "node2", FailureClass.PYTHON_EXCEPTION, "ValueError: old", attempt=5))
    events.append_event(run, _failure(1, "node2", FailureClass.PYTHON_EXCEPTION, "ValueError: other job",
                                      job_id="999"))
    assert _summarize(run)["failure_class"] is None


def test_stop_event_is_a_resumable_time_limit(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, exit_code="3:0")
    for rank, sig in ((0, 0), (1, 12)):
        events.append_event(run, Event(kind=events.STOP, time=1000.0, rank=rank, host=f"node{rank + 1}", attempt=0,
                                       job_id="123", failure_class="time_limit" if sig else None, signal=sig,
                                       exit_code=3, message=f"signal {sig}: stopped on signal at step 5",
                                       extra={"checkpointed": True}))
    f = _summarize(run)["failure"]
    assert (f["failure_class"], f["rank"]) == ("time_limit", 1)
    assert "resumable" in f["message"]


@pytest.mark.parametrize("signum, cls", [(12, "time_limit"), (15, "preempted"), (0, None)])
def test_stop_on_signal_is_a_stop_event(tmp_path: Path, signum: int, cls: str | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """StopRequested, and submitit declining to requeue (its UncompletedJobError, known by class), are stops
    on the signal: a `stop` event with the signal's class, never a python_exception."""
    from hpctrain.node.checkpointing.checkpointer import StopRequested
    from hpctrain.node.launch import main
    from hpctrain.runs.folder import RunFolder

    class UncompletedJobError(Exception):
        pass

    fake = types.ModuleType("submitit.core.utils")
    fake.UncompletedJobError = UncompletedJobError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "submitit.core.utils", fake)
    where = main._Where(1, 0, "55")
    paths = RunFolder(tmp_path)
    from hpctrain.runs.checkpoints import MARKER

    (paths.checkpoints_dir / "step-5").mkdir(parents=True)  # the checkpoint the signal's stop wrote
    (paths.checkpoints_dir / "step-5" / MARKER).write_text("{}\n")
    from hpctrain.node.checkpointing.checkpointer import StopFlag

    stop = StopFlag(signum=signum, run_dir=tmp_path)  # no time limit known: USR2 keeps its meaning (time limit)
    assert main._fail(StopRequested("stopped on signal at step 5"), paths, where, stop) == ExitCode.STOPPED
    refused = UncompletedJobError("Job not requeued because: checkpoint function returned None.")
    assert main._fail(refused, paths, where, stop) == ExitCode.ERROR
    evs = events.read_events(tmp_path)
    # submitit's handler runs on USR2 only: without a signal of its own the rank got it before StopFlag was
    # installed, straight from SLURM (nothing saved yet).
    refused_as = (cls, signum, True) if signum else ("time_limit", 12, False)
    assert [(e.kind, e.failure_class, e.signal, e.exit_code, e.extra["checkpointed"]) for e in evs] == [
        (events.STOP, cls, signum, 3, True), (events.STOP, *refused_as[:2], 1, refused_as[2])]
    # The refusal's stop names the step of the checkpoint it stopped after (the collector's message says it).
    assert ("at step 5" in evs[1].message) is bool(signum) and "submitit did not requeue" in evs[1].message


def test_signal_before_training_is_a_time_limit_without_checkpoint(tmp_path: Path) -> None:
    """SLURM's USR2 can come while the ranks still start (seen on the local cluster, 27 s into a 60 s job
    with --signal=USR2@20): submitit's handler refuses the requeue; time_limit, and nothing is resumable."""
    run = _run_folder(tmp_path, exit_code="9:0")
    events.append_event(run, Event(kind=events.STOP, time=1000.0, rank=0, host="node1", attempt=0, job_id="123",
                                   failure_class="time_limit", signal=12, exit_code=1, extra={"checkpointed": False},
                                   message="Job not requeued because: checkpoint function returned None."))
    f = _summarize(run)["failure"]
    assert (f["failure_class"], f["rank"], f["host"]) == ("time_limit", 0, "node1")
    assert "resumable" not in f["message"]
