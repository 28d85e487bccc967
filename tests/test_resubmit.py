"""The retry policy (hpctrain.fault.policy) and the supervisor's pure helpers (hpctrain.fault.supervisor).

No cluster."""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

import pytest

from hpctrain.fault import supervisor as supervise
from hpctrain.fault.policy import MAX_RETRIES_CAP, AttemptRecord, Fit, Policy, decide
from hpctrain.node import faultinject
from hpctrain.node.monitor.heartbeat import RankBeat
from hpctrain.runs.beats import read_failures


def rec(attempt: int, state: str = "FAILED", cls: str | None = "unknown", **kw: object) -> AttemptRecord:
    return AttemptRecord(attempt=attempt, job_id=str(100 + attempt), state=state, failure_class=cls, **kw)  # type: ignore[arg-type]


FIT = Fit(nodes_needed=2, partition_nodes=4)


def test_completed_is_done() -> None:
    d = decide([rec(0, "COMPLETED", None)], Policy(), FIT)
    assert d.action == "done"


@pytest.mark.parametrize("cls", ["node_fail", "preempted", "time_limit", "hang", "comm_timeout", "unknown"])
def test_transient_failures_are_retried(cls: str) -> None:
    d = decide([rec(0, "FAILED", cls, checkpoint_step=10)], Policy(), FIT)
    assert d.action == "retry" and "checkpoint step 10" in d.reason


@pytest.mark.parametrize("cls", ["python_exception", "gpu_oom", "host_oom", "container_error"])
def test_user_errors_stop_with_the_evidence(cls: str) -> None:
    r = rec(0, "FAILED", cls, exception="ValueError: bad lr", evidence="logs/attempt-0.rank-1.log")
    d = decide([r], Policy(), FIT)
    assert d.action == "stop"
    assert "user error" in d.reason and "ValueError: bad lr" in d.reason and "attempt-0.rank-1.log" in d.reason


def test_bad_input_exit_code_is_a_user_error() -> None:
    d = decide([rec(0, "FAILED", "unknown", exit_code="2:0")], Policy(), FIT)
    assert d.action == "stop" and d.failure_class == "input_error"


def test_cancel_by_a_person_is_not_fought() -> None:
    assert decide([rec(0, "CANCELLED", "cancelled")], Policy(), FIT).action == "stop"


def test_identical_repeat_stops() -> None:
    a = rec(0, "FAILED", "comm_timeout", message="gloo timed out", last_step=7, checkpoint_step=5)
    b = rec(1, "FAILED", "comm_timeout", message="gloo timed out", last_step=7, checkpoint_step=5)
    d = decide([a, b], Policy(no_progress_attempts=0), FIT)
    assert d.action == "stop" and "same failure" in d.reason


def test_node_fail_twice_is_bad_luck_not_a_repeat() -> None:
    a = rec(0, "NODE_FAIL", "node_fail", message="SLURM lost a node", last_step=7, checkpoint_step=5)
    b = rec(1, "NODE_FAIL", "node_fail", message="SLURM lost a node", last_step=12, checkpoint_step=10)
    assert decide([a, b], Policy(), FIT).action == "retry"


def test_no_progress_stops_early() -> None:
    h = [rec(0, checkpoint_step=5), rec(1, checkpoint_step=5), rec(2, checkpoint_step=5)]
    d = decide(h, Policy(max_retries=10, no_progress_attempts=2), FIT)
    assert d.action == "stop" and "no progress" in d.reason and "step 5" in d.reason
    # progress in between resets the count
    h = [rec(0, checkpoint_step=5), rec(1, checkpoint_step=5), rec(2, checkpoint_step=10)]
    assert decide(h, Policy(max_retries=10, no_progress_attempts=2), FIT).action == "retry"


def test_budget_and_cap() -> None:
    h = [rec(i, checkpoint_step=5 * (i + 1)) for i in range(4)]
    d = decide(h, Policy(max_retries=3), FIT)
    assert d.action == "stop" and "budget" in d.reason
    assert Policy(max_retries=99).max_retries == MAX_RETRIES_CAP


def test_exclusion_grows_and_is_capped_by_the_partition() -> None:
    r = rec(0, "NODE_FAIL", "node_fail", implicated=("node3",), excluded=("node1",))
    d = decide([r], Policy(), Fit(nodes_needed=2, partition_nodes=4))
    assert d.exclude == ("node1", "node3") and d.added == ("node3",)
    # a 4-node run on a 4-node partition: excluding would leave it unable to start -> say so, keep the shape
    d = decide([rec(0, "NODE_FAIL", "node_fail", implicated=("node3",))], Policy(), Fit(4, 4))
    assert d.action == "retry" and d.exclude == () and d.not_excluded == ("node3",)
    assert "unable to start" in d.notes[0]
    # policy cap
    d = decide([rec(0, "FAILED", "hang", implicated=("a", "b", "c"))], Policy(max_excluded=2), Fit(1, None))
    assert d.exclude == ("a", "b")
    # off
    d = decide([r], Policy(exclude_failed_nodes=False), FIT)
    assert d.exclude == ("node1",) and d.added == ()


# -- supervise helpers -------------------------------------------------------------------------------
def test_parse_faults() -> None:
    fs = faultinject.parse_faults("hang:rank=1,step=5; ckpt-crash:step=10;raise:step=3")
    assert [(f.kind, f.step, f.rank, f.every_attempt) for f in fs] == [
        ("hang", 5, 1, False), ("ckpt-crash", 10, None, False), ("raise", 3, None, True)]
    with pytest.raises(ValueError, match="HPCTRAIN_FAULT_INJECT"):
        faultinject.parse_faults("hang:rank=1")


def test_inject_raise_fires_every_attempt_others_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPCTRAIN_FAULT_INJECT", "raise:step=3;crash:step=4,rank=1")
    monkeypatch.delenv("HPCTRAIN_RUN_DIR", raising=False)
    with pytest.raises(ValueError, match="injected"):
        faultinject.inject("step", 3, 5, 0)  # resumed past step 3: a user bug still fails
    faultinject.inject("step", 4, 0, 0)  # crash is for rank 1 only
    faultinject.inject("step", 4, 4, 1)  # attempt started at step 4: the crash already happened once
    faultinject.inject("checkpoint", 3, 0, 0)  # raise is not a checkpoint fault
    # with a run folder: once per run and rank, whatever the resume step
    monkeypatch.setenv("HPCTRAIN_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("HPCTRAIN_FAULT_INJECT", "hang:step=4,rank=1")
    (tmp_path / "metrics" / "faults").mkdir(parents=True)
    (tmp_path / "metrics" / "faults" / "hang-step4-rank1").write_text("fired\n")
    faultinject.inject("step", 4, 0, 1)  # already fired: returns instead of hanging


def test_slow_first_only_sleeps_in_the_attempt_that_started_at_step_0(monkeypatch: pytest.MonkeyPatch) -> None:
    naps: list[float] = []
    monkeypatch.setattr(faultinject.time, "sleep", naps.append)
    monkeypatch.setenv("HPCTRAIN_FAULT_INJECT", "slow:step=2,s=1.5,first=1;slow:step=1,rank=1,s=0.25")
    assert [f.first_only for f in faultinject.parse_faults(os.environ["HPCTRAIN_FAULT_INJECT"])] == [True, False]
    faultinject.inject("step", 1, 0, 0)  # before step 2: no sleep
    faultinject.inject("step", 2, 0, 0)  # the first attempt, from step 2 on
    faultinject.inject("step", 9, 8, 0)  # resumed at step 8: first=1 no longer sleeps
    faultinject.inject("step", 9, 8, 1)  # ... the other fault does, every attempt
    assert naps == [1.5, 0.25]


def _beat(d: Path, rank: int, step: int, phase: str, t: float, job: str = "7") -> None:
    (d / "metrics" / "ranks").mkdir(parents=True, exist_ok=True)
    (d / "metrics" / "ranks" / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": f"node{rank + 1}", "step": step, "phase": phase, "time": t, "job": job}))


def test_watchdog_names_the_rank_behind(tmp_path: Path) -> None:
    now = time.time()
    w = supervise.Watchdog(tmp_path, "7", timeout_s=20, world=3, started=now, last_change=now)
    for r in range(3):
        _beat(tmp_path, r, 4, "reduce", now)
    assert w.check(now) is None
    _beat(tmp_path, 0, 5, "reduce", now + 5)
    _beat(tmp_path, 1, 5, "compute", now + 5)  # stuck computing step 5
    _beat(tmp_path, 2, 5, "reduce", now + 5)
    assert w.check(now + 5) is None  # progress: step 5
    for r, ph in ((0, "reduce"), (1, "compute"), (2, "reduce")):
        _beat(tmp_path, r, 5, ph, now + 30)  # beats keep coming, the step does not move
    hang = w.check(now + 30)
    assert hang is not None and hang.silent_ranks == (1,) and hang.silent_hosts == ("node2",)
    assert hang.last_step == 4 and "rank 1 on node2" in hang.message


def test_watchdog_stale_and_missing_ranks_and_grace(tmp_path: Path) -> None:
    now = time.time()
    w = supervise.Watchdog(tmp_path, "7", timeout_s=20, world=3, grace_s=100, started=now, last_change=now)
    _beat(tmp_path, 0, 3, "start", now)
    assert w.check(now + 50) is None  # still starting: the grace period applies
    _beat(tmp_path, 0, 4, "reduce", now + 60)
    _beat(tmp_path, 1, 4, "reduce", now + 20, job="6")  # an old attempt's file: ignored
    assert w.check(now + 60) is None
    _beat(tmp_path, 0, 4, "reduce", now + 85)  # rank 0 alive, waiting for the others
    hang = w.check(now + 90)
    assert hang is not None and hang.silent_ranks == (1, 2)
    _beat(tmp_path, 0, 4, "done", now + 95)
    assert w.check(now + 200) is None  # finished: nothing to watch


def test_log_attempt_and_next_attempt(tmp_path: Path) -> None:
    assert supervise.log_attempt({"HPCTRAIN_ATTEMPT": "2", "SLURM_RESTART_COUNT": "1"}) == 3
    assert supervise.log_attempt({}) == 0
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "attempt-3.rank-0.log").write_text("")
    (tmp_path / "attempts.jsonl").write_text(json.dumps({"attempt": 1, "job_id": "5"}) + "\n")
    assert supervise.next_attempt_number(tmp_path, [0]) == 4


def test_supervisor_script(tmp_path: Path) -> None:
    from hpctrain.spec.model import resolve

    spec = resolve(None, {"model.config": "llama-tiny", "resources.partition": "debug"}, check=False)
    text = supervise.supervisor_script(tmp_path / "r 1", "42", spec, python="/py")
    assert "#SBATCH --dependency=afterany:42" in text and "#SBATCH --kill-on-invalid-dep=yes" in text
    assert "#SBATCH --partition=debug" in text and "--ntasks=1" in text
    assert text.rstrip().endswith(f"exec /py -m hpctrain supervise '{tmp_path}/r 1' --job 42")
    # SLURM expands '%' in --output (%x = the job name): a runs dir holding one keeps its literal name.
    text = supervise.supervisor_script(tmp_path / "50% x" / "r1", "42", spec, python="/py")
    assert f"#SBATCH --output='{tmp_path}/50%% x/r1/logs/supervisor.log'\n" in text


def test_history_survives_a_broken_collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor imports the live collector; if that raises, SLURM's state + the watchdog still decide."""
    from hpctrain.collect import summary as collect

    (tmp_path / "attempts.jsonl").write_text(
        json.dumps({"attempt": 0, "job_id": "7", "state": "PENDING"}) + "\n"
        + json.dumps({"attempt": 0, "job_id": "7", "state": "CANCELLED"}) + "\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "watchdog.jsonl").write_text(json.dumps(
        {"event": "hang", "job_id": "7", "last_step": 9, "silent_ranks": [1], "silent_hosts": ["node2"],
         "message": "no step completed after step 9"}) + "\n")
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))

    def broken(*_a: object, **_k: object) -> None:
        raise NameError("clean_text")

    monkeypatch.setattr(collect, "build_run", broken)
    hist, _ = supervise.history(tmp_path, "7")
    assert [(h.state, h.failure_class, h.implicated) for h in hist] == [("CANCELLED", "hang", ("node2",))]
    assert decide(hist, Policy(), FIT).action == "retry"


GLOO_RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [node2]:36531: "
              "Connection reset by peer. This is typically caused by a remote worker hanging")


def _failed(d: Path, rank: int, step: int, t: float, error: str = GLOO_RESET, job: str = "7") -> None:
    """What RankBeat.fail leaves: the beat (phase failed) and failed-JOB-RESTART-R.json."""
    rec = {"rank": rank, "host": f"node{rank + 1}", "step": step, "phase": "failed", "was": "compute", "time": t,
           "job": job, "restart": "0", "error": error}
    (d / "metrics" / "ranks").mkdir(parents=True, exist_ok=True)
    for name in (f"rank-{rank}.json", f"failed-{job}-0-{rank}.json"):
        (d / "metrics" / "ranks" / name).write_text(json.dumps(rec))


def test_rank_beat_fail_leaves_the_error_for_the_watchdog(tmp_path: Path) -> None:
    beat = RankBeat(tmp_path / "metrics", 1, interval_s=60)
    beat.job, beat.restart = "7", "0"
    beat.start()
    beat.set(12, "reduce")
    beat.fail(RuntimeError("Read error [10.77.0.1]:4242: Connection reset by peer"))
    assert read_failures(tmp_path, "6") == []  # another job's failures are not this one's
    (got,) = read_failures(tmp_path, "7", "0")
    assert got["phase"] == "failed" and got["was"] == "reduce" and got["step"] == 12
    assert got["error"].startswith("RuntimeError: Read error")
    assert json.loads((tmp_path / "metrics" / "ranks" / "rank-1.json").read_text())["phase"] == "failed"


def test_watchdog_peer_lost_names_the_dead_host_after_the_confirm_window(tmp_path: Path) -> None:
    now = time.time()
    w = supervise.Watchdog(tmp_path, "7", timeout_s=300, world=3, started=now, last_change=now, restart="0")
    for r in range(3):
        _beat(tmp_path, r, 20, "compute", now - 4)
    assert w.peer_check(now) is None  # nothing failed: one directory listing, no verdict
    _failed(tmp_path, 0, 21, now)
    _failed(tmp_path, 2, 21, now + 0.2, error=GLOO_RESET.replace("node2", "node1"))  # names a rank that failed too
    assert w.peer_check(now + 1) is None  # a live node's srun ends the step within the confirm window
    rec = w.peer_check(now + 4)
    assert rec is not None and rec.event == "peer_lost" and rec.job_id == "7"
    assert rec.silent_hosts == ("node2",) and rec.silent_ranks == (1,) and rec.last_step == 20
    assert "rank 0 on node1 lost its peer on node2" in rec.message
    assert "still waiting for them 4 s later" in rec.message
    at_once = w.peer_check(now + 0.2, confirm_s=0.0)  # the in-job driver's early check: no "0 s later"
    assert at_once is not None and "s later" not in at_once.message, at_once.message


def test_watchdog_hands_a_lost_peer_to_on_peer_lost_before_the_cancel(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog does not import the supervisor: `python -m hpctrain.fault.supervisor watch` passes
    take_over in, and the watchdog calls it with (run_dir, job) before it cancels the job."""
    from hpctrain import slurmcommands as _slurm
    from hpctrain.fault import watchdog

    order: list[object] = []
    monkeypatch.setattr(_slurm, "queue_state", lambda job: "RUNNING")
    monkeypatch.setattr(_slurm, "scancel", lambda jobs: order.append(("scancel", tuple(jobs))))
    now = time.time()
    for r in range(3):
        _beat(tmp_path, r, 20, "compute", now - 10)
    _failed(tmp_path, 0, 21, now - 5)
    w = watchdog.Watchdog(tmp_path, "7", timeout_s=300, world=3, restart="0",
                          on_peer_lost=lambda run_dir, job: order.append(("decide", run_dir, job)) or None)
    rec = w.run()
    assert rec is not None and rec.event == "peer_lost"
    assert order == [("decide", tmp_path, "7"), ("scancel", ("7",))]

    seen: dict[str, object] = {}
    monkeypatch.setattr(watchdog, "main", lambda argv=None, on_peer_lost=None: seen.update(hook=on_peer_lost) or 0)
    monkeypatch.delitem(sys.modules, "hpctrain.fault.supervisor")  # runpy runs a fresh copy as __main__
    with pytest.raises(SystemExit):
        runpy.run_module("hpctrain.fault.supervisor", run_name="__main__")
    assert getattr(seen["hook"], "__name__", None) == "take_over"


def test_watchdog_peer_lost_ignores_user_errors_and_blames_quiet_hosts_without_a_name(tmp_path: Path) -> None:
    now = time.time()
    w = supervise.Watchdog(tmp_path, "7", timeout_s=300, world=3, started=now, last_change=now, restart="0")
    _beat(tmp_path, 1, 20, "compute", now - 4)
    _beat(tmp_path, 2, 20, "compute", now + 2)  # alive: beat after the failure
    _failed(tmp_path, 0, 21, now, error="ValueError: user code failed at step 21")
    assert w.peer_check(now + 10) is None  # a Python exception: srun and the collector handle it
    nccl = "DistBackendError: NCCL error: remote process exited or there was a network error"
    _failed(tmp_path, 0, 21, now, error=nccl)
    rec = w.peer_check(now + 10)
    assert rec is not None and rec.silent_hosts == ("node2",) and rec.silent_ranks == (1,)
    _beat(tmp_path, 2, 20, "compute", now - 4)  # two of three hosts quiet, nobody named: too unsure to act
    assert w.peer_check(now + 10) is None
    # An address that resolves to no host of the job names nobody (it would end up in sbatch --exclude).
    _failed(tmp_path, 0, 21, now, error=GLOO_RESET.replace("[node2]", "[192.0.2.77]"))
    assert w.peer_check(now + 10) is None


def test_peer_lost_verdict_is_a_node_failure_for_supervisor_and_summary(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.collect import summary as collect

    (tmp_path / "attempts.jsonl").write_text(
        json.dumps({"attempt": 0, "job_id": "7", "state": "PENDING", "nodes": "node[1-2]"}) + "\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "watchdog.jsonl").write_text(json.dumps(
        {"event": "peer_lost", "job_id": "7", "last_step": 20, "silent_ranks": [1], "silent_hosts": ["node2"],
         "message": "rank 0 on node1 lost its peer on node2 (...): node or network lost"}) + "\n")
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    from hpctrain.slurmcommands import SacctRecord

    hist, _ = supervise.history(tmp_path, "7", SacctRecord("7", "CANCELLED"))
    assert [(h.state, h.failure_class, h.implicated) for h in hist] == [("CANCELLED", "node_fail", ("node2",))]
    d = decide(hist, Policy(), FIT)
    assert d.action == "retry" and d.added == ("node2",)
    # The collector (no supervisor note, e.g. retries 0) reads the watchdog's file: node_fail, not "cancelled".
    rows = collect._with_fault_notes(tmp_path, [{"attempt": 0, "job_id": "7", "state": "CANCELLED"}])
    assert rows[0]["peer_lost"]["silent_hosts"] == ["node2"]
    from hpctrain.runs.journal import from_note

    lost = from_note("peer_lost", rows[0]["peer_lost"])
    assert lost is not None
    f = collect._peer_lost_failure(lost, None)
    assert (f.failure_class, f.host, f.rank) == ("node_fail", "node2", 1)


def test_a_straggler_verdict_is_a_straggler_for_the_supervisor_and_its_host_is_excluded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-job driver's verdict when a persistent straggler had no spare left: retried without that node,
    # and never called node_fail (the node is slow, not dead).
    (tmp_path / "attempts.jsonl").write_text(
        json.dumps({"attempt": 0, "job_id": "8", "state": "PENDING", "nodes": "node[1-2]"}) + "\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "watchdog.jsonl").write_text(json.dumps(
        {"event": "straggler", "job_id": "8", "last_step": 20, "silent_ranks": [1], "silent_hosts": ["node2"],
         "message": "node2 was the slowest rank in 5 windows in a row"}) + "\n")
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    from hpctrain.slurmcommands import SacctRecord

    hist, _ = supervise.history(tmp_path, "8", SacctRecord("8", "CANCELLED"))
    assert [(h.failure_class, h.implicated) for h in hist] == [("straggler", ("node2",))]
    d = decide(hist, Policy(), FIT)
    assert d.action == "retry" and d.added == ("node2",)


def test_take_over_only_for_a_supervised_job(tmp_path: Path) -> None:
    (tmp_path / "attempts.jsonl").write_text(json.dumps({"attempt": 0, "job_id": "7", "state": "PENDING"}) + "\n")
    assert supervise.take_over(tmp_path, "7") is None  # retries 0 / sweep / local: no supervisor, only the cancel
