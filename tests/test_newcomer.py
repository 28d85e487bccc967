"""What a newcomer's first runs and a real node loss showed (issue 16, items 5 and 6), on recorded run-folder
files: a preempted-then-resumed attempt, a pending retry, a lost node told once, a user's cancel, the late
supervisor. No cluster, no DeepSpeed."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from hpctrain.runs import events
from hpctrain.runs.events import Event
from hpctrain.states import FailureClass, stop_class
from test_collect_cli import T0, env, invoke, make_run, metrics, rank_log  # noqa: F401 - env is a fixture

FC = FailureClass


# -- time limit, preemption, cancel: one rule (hpctrain.states.stop_class) -----------------------------------
@pytest.mark.parametrize("signum, left, cancelled, want", [
    (signal.SIGUSR2, 80.0, False, FC.TIME_LIMIT),  # SLURM's --signal=USR2@90, on time
    (signal.SIGUSR2, 150.0, False, FC.TIME_LIMIT),  # up to 60 s early (man sbatch), still the time limit
    (signal.SIGUSR2, 3000.0, False, FC.PREEMPTED),  # long before the limit: a preemption (send_user_signal)
    (signal.SIGUSR1, 3000.0, False, FC.PREEMPTED),
    (signal.SIGUSR2, None, False, FC.TIME_LIMIT),  # time left unknown: the documented meaning
    (signal.SIGTERM, 3000.0, False, FC.PREEMPTED),
    (signal.SIGTERM, 3000.0, True, FC.CANCELLED),  # `hpctrain cancel` asked for it
    (0, 3000.0, True, None),  # a rank that only heard of the stop from its peers
])
def test_stop_class(signum: int, left: float | None, cancelled: bool, want: str | None) -> None:
    assert stop_class(signum, left, 90.0, cancelled=cancelled) == want


def test_start_up_slack_when_the_job_start_is_a_guess() -> None:
    """Counted from the rank's own start, 4 min "left" of a 2 h limit may be the start-up: still the time limit."""
    assert stop_class(signal.SIGUSR2, 240.0, 90.0) == FC.PREEMPTED
    assert stop_class(signal.SIGUSR2, 240.0, 90.0, limit_s=7200.0) == FC.TIME_LIMIT
    assert stop_class(signal.SIGUSR2, 3000.0, 90.0, limit_s=7200.0) == FC.PREEMPTED


def test_stop_flag_knows_the_time_left_and_whose_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from hpctrain.node.checkpointing.checkpointer import StopFlag
    from hpctrain.runs.folder import RunFolder, json_text

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 3600))
    _fake_squeue(tmp_path, monkeypatch, "")  # slurmctld holds the same end (squeue prints nothing: no answer)
    flag = StopFlag(signum=signal.SIGUSR2, run_dir=tmp_path, limit_s=7200.0, window_s=90.0)
    assert flag.why() == FC.PREEMPTED
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 60))
    assert flag.why() == FC.TIME_LIMIT
    monkeypatch.delenv("SLURM_JOB_END_TIME")
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(time.time() - 7150))  # 50 s left of 2 h
    assert flag.why() == FC.TIME_LIMIT
    # An old cancel of another job of this run does not turn this job's SIGTERM into a cancel.
    RunFolder(tmp_path).cancel_requested.write_text(json_text({"jobs": ["40"]}))
    flag.signum = signal.SIGTERM
    assert not flag.cancelled() and flag.why() == FC.PREEMPTED
    RunFolder(tmp_path).cancel_requested.write_text(json_text({"jobs": ["40", "41"]}))
    assert flag.cancelled() and flag.why() == FC.CANCELLED


def _fake_squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, rc: int = 0) -> Path:
    """A stand-in `squeue` for hpctrain.slurmcommands.job_end_time's parsing (the real cluster's moved limit:
    tests/test_fault_slurm.py); it logs its arguments."""
    import shlex

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "squeue"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(bin_dir / "calls"))}\n'
                    f"printf '%s' {shlex.quote(out)}\nexit {rc}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir / "calls"


@pytest.mark.parametrize("moved_to_s, rc, want", [
    (60.0, 0, FC.TIME_LIMIT),  # `scontrol update TimeLimit=` cut (or set) the limit: the signal is its pre-timeout
    (5400.0, 0, FC.PREEMPTED),  # the limit was extended, and then the job was preempted
    (None, 1, FC.PREEMPTED),  # squeue refused (the job left the queue): the environment's end stands
])
def test_a_moved_time_limit_is_asked_of_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              moved_to_s: float | None, rc: int, want: str) -> None:
    """SLURM_JOB_END_TIME is the end the job started with: far from it, USR2 is checked against the end
    slurmctld holds now, once per process; near it (a plain time limit), SLURM is not asked."""
    import datetime
    import time

    from hpctrain.node.checkpointing.checkpointer import StopFlag

    end = "" if moved_to_s is None else datetime.datetime.fromtimestamp(time.time() + moved_to_s).strftime(
        "%Y-%m-%dT%H:%M:%S")
    calls = _fake_squeue(tmp_path, monkeypatch, end + "\n", rc)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 3600))
    flag = StopFlag(signum=signal.SIGUSR2, run_dir=tmp_path, limit_s=3600.0, window_s=90.0)
    assert flag.why() == want and flag.why() == want
    assert calls.read_text().splitlines() == ["-h -j 41 -o %e"]  # asked once
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 60))
    calls.unlink()
    assert StopFlag(signum=signal.SIGUSR2, run_dir=tmp_path, window_s=90.0).why() == FC.TIME_LIMIT
    assert not calls.exists()  # near the end the job started with: no RPC
    monkeypatch.setenv("SLURM_JOB_ID", "41; touch /tmp/x")  # never reaches squeue
    assert StopFlag(signum=signal.SIGUSR2, run_dir=tmp_path, window_s=90.0).live_end() is None
    assert not calls.exists()


class _Metrics:
    def heartbeat(self, *a: Any) -> None:
        pass

    def event(self, *a: Any) -> None:
        pass


def test_a_cancelled_rank_does_not_stop_for_requeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    from hpctrain.node.checkpointing.checkpointer import Checkpointer, SavePolicy, StopFlag
    from hpctrain.runs.folder import RunFolder, json_text

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "777")
    RunFolder(tmp_path).cancel_requested.write_text(json_text({"jobs": ["777"]}))
    chained: list[int] = []
    flag = StopFlag(signum=signal.SIGTERM, run_dir=tmp_path, limit_s=3600.0, window_s=90.0)
    flag.previous[signal.SIGTERM] = lambda s, f: chained.append(s)
    ck = Checkpointer(None, tmp_path / "checkpoints", SavePolicy(0, 0, 10, False), flag, rank=0, keep=1, layout={})
    logger = logging.getLogger("hpctrain.node")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="hpctrain.node"):
            exc = ck.requeue(7, _Metrics())  # type: ignore[arg-type]
    finally:
        logger.removeHandler(caplog.handler)
    assert "cancelled by the user" in str(exc) and not chained
    assert "cancelled by the user (hpctrain cancel)" in caplog.text and "for requeue" not in caplog.text


def test_cancel_records_the_request_before_signalling(tmp_path: Path) -> None:
    from hpctrain.api.runs import request_cancel
    from hpctrain.runs.folder import RunFolder

    request_cancel(str(tmp_path), ["5"])
    request_cancel(str(tmp_path), ["6"])
    assert RunFolder(tmp_path).cancel_request()["jobs"] == ["5", "6"]  # type: ignore[index]
    request_cancel(str(tmp_path / "gone"), ["7"])  # a folder that cannot take it: the cancel still goes on


def test_local_requeue_is_an_attempt_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """submitit's local executor restarts the tasks with the same environment: NodeJob counts the restarts."""
    from hpctrain.node.launch.entry import NodeJob
    from hpctrain.node.monitor.metrics import attempt_number

    (tmp_path / "spec.toml").write_text("[launch]\nretries = 1\n")
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "9")
    again = NodeJob(str(tmp_path)).checkpoint()
    assert again.function.restarts == 1  # type: ignore[attr-defined]
    assert attempt_number({"HPCTRAIN_ATTEMPT": "2", "HPCTRAIN_LOCAL_RESTARTS": "1"}) == 3
    monkeypatch.delenv("SUBMITIT_LOCAL_JOB_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "")  # on SLURM, SLURM_RESTART_COUNT counts: no second count
    assert NodeJob(str(tmp_path)).checkpoint().function.restarts == 0  # type: ignore[attr-defined]


# -- the summary of a preempted-then-resumed run -------------------------------------------------------------
def _stop_event(folder: Path, attempt: int, cls: str, t: float, rank: int = 0, job: str = "28959") -> None:
    events.append_event(folder, Event(kind=events.STOP, time=T0 + t, rank=rank, host="vm", attempt=attempt,
                                      job_id=job, failure_class=cls, signal=12, exit_code=3,
                                      message="stopped on signal at step 9", extra={"checkpointed": True}))


@pytest.mark.parametrize("cls", [FC.PREEMPTED, FC.TIME_LIMIT])
def test_preempted_then_resumed_counts_two_attempts(env: dict[str, Any], cls: str) -> None:  # noqa: F811
    stop = f"signal 12: checkpointed at step 9, stopping for requeue ({cls})"
    logs = {"logs/attempt-0.rank-0.log": rank_log(0, [(1, "hpctrain node: rank 0/2"), (10, stop)]),
            "logs/attempt-1.rank-0.log": rank_log(0, [(15, "resumed from step-9 at step 9"), (40, "done")])}
    folder = make_run(env, "demo", [{"attempt": 0, "job_id": "28959", "state": "COMPLETED", "nodes": "",
                                     "ended": T0 + 40}], logs=logs,
                      metrics=metrics(range(1, 10), 0) + metrics(range(10, 41), 0))
    _stop_event(folder, 0, cls, 10)
    doc = json.loads(invoke("summary", "demo", "--json").stdout)
    run = doc["runs"][0]
    rows = [(r["attempt"], r["state"], r["failure_class"], r["last_step"]) for r in run["attempts"]]
    assert rows == [(0, "REQUEUED", cls, 9), (1, "COMPLETED", None, 40)]
    assert run["totals"]["attempts"] == 2 and run["failure_class"] is None


def test_old_log_lines_without_a_class_keep_the_signals_meaning() -> None:
    from hpctrain.collect import classify as cc

    src = cc.LogSource("logs/attempt-0.rank-0.log",
                       "2026-11-29T10:00:02 rank0 INFO signal 15: checkpointed at step 4, stopping for requeue\n", 0)
    assert cc.classify("REQUEUED", [src]).failure_class == FC.PREEMPTED
    src.text = src.text.replace("signal 15", "signal 12")
    assert cc.classify("REQUEUED", [src]).failure_class == FC.TIME_LIMIT
    src.text = src.text.replace("for requeue", "for requeue (preempted)")
    assert cc.classify("REQUEUED", [src]).failure_class == FC.PREEMPTED


# -- a node loss, told once -----------------------------------------------------------------------------------
def _node_loss_run(env: dict[str, Any], retry: dict[str, Any] | None, state: str = "CANCELLED") -> Path:  # noqa: F811
    """Recorded files of a 4-node, 1-rank-per-node run whose node2 (rank 1) died at step 12: the survivors'
    events blame the peer they happened to talk to (rank 0 blames node3, rank 3 blames node1); the watchdog's
    verdict names the silent rank 1 on node2. `state` RUNNING: the moment the watchdog takes over, before
    its cancel has ended the job."""
    atts = [{"attempt": 0, "job_id": "60", "state": state, "nodes": "node[1-4]", "started": T0,
             "ended": T0 + 30 if state != "RUNNING" else None}]
    if retry:
        atts.append(retry)
    folder = make_run(env, "lost", atts, metrics=metrics(range(1, 13), 0, ckpt_every=10))
    for rank, host, peer in ((0, "node1", "node3"), (2, "node3", "node4"), (3, "node4", "node1")):
        events.append_event(folder, Event(
            kind=events.FAILURE, time=T0 + 14 + rank, rank=rank, host=host, attempt=0, job_id="60",
            failure_class=FC.PYTHON_EXCEPTION, exit_code=1,
            exception=f"RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [{peer}]:29500"))
    (folder / "metrics" / "watchdog.jsonl").write_text(json.dumps(
        {"event": "peer_lost", "job_id": "60", "last_step": 12, "silent_ranks": [1], "silent_hosts": ["node2"],
         "message": "rank 1 on node2 went silent; its peers lost it: node or network lost"}) + "\n")
    return folder


@pytest.mark.parametrize("state", ["CANCELLED", "RUNNING"])
def test_node_loss_names_the_dead_host_once(env: dict[str, Any], state: str) -> None:  # noqa: F811
    from hpctrain.fault import supervisor as sup
    from hpctrain.fault.policy import Fit, Policy, decide
    from hpctrain.slurmcommands import SacctRecord

    folder = _node_loss_run(env, None, state)
    doc = json.loads(invoke("summary", "lost", "--json").stdout)
    f = doc["runs"][0]["attempts"][0]["failure"]
    assert (f["failure_class"], f["rank"], f["host"]) == ("node_fail", 1, "node2")
    hist, _ = sup.history(folder, "60", SacctRecord("60", "CANCELLED"))
    d = decide(hist, Policy(), Fit(nodes_needed=3, partition_nodes=4))
    assert d.action == "retry" and d.added == ("node2",)
    assert "rank 1 on node2" in d.reason and "node3" not in d.reason and "node4" not in d.reason
    assert "watchdog.jsonl" in d.reason


def test_a_pending_retry_shows_nothing_of_the_attempt_before(env: dict[str, Any]) -> None:  # noqa: F811
    _node_loss_run(env, {"attempt": 1, "job_id": "61", "state": "PENDING", "nodes": ""})
    doc = json.loads(invoke("summary", "lost", "--json").stdout)
    a0, a1 = doc["runs"][0]["attempts"]
    assert (a0["last_step"], a0["last_loss"] is not None, a0["lost_steps"]) == (12, True, 2)
    assert (a1["state"], a1["start"], a1["last_step"], a1["last_loss"], a1["lost_steps"], a1["steps_done"]) == \
        ("PENDING", None, None, None, None, 0)
    assert doc["runs"][0]["totals"]["last_step"] == 12


def test_late_supervisor_reports_the_decision_it_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpctrain.fault import supervisor as sup

    (tmp_path / "spec.toml").write_text('name = "t"\n')
    (tmp_path / "attempts.jsonl").write_text(json.dumps(
        {"job_id": "60", "time": T0, "decision": {"action": "retry", "reason": "node2 lost; retry 1 of 3"},
         "next": {"attempt": 1, "job_id": "61"}}) + "\n")
    assert sup.supervise(tmp_path, "60")["action"] == "retry"
    out = capsys.readouterr().out
    assert "job 60 was already decided" in out and "node2 lost; retry 1 of 3" in out and "job 61" in out


def test_a_user_cancel_is_told_as_such(env: dict[str, Any]) -> None:  # noqa: F811
    from hpctrain.fault.policy import AttemptRecord, Fit, Policy, decide
    from hpctrain.runs.folder import RunFolder, json_text

    folder = make_run(env, "cancelled", [{"attempt": 0, "job_id": "70", "state": "CANCELLED", "nodes": "node1",
                                          "started": T0, "ended": T0 + 9}], metrics=metrics(range(1, 6), 0))
    RunFolder(folder).cancel_requested.write_text(json_text({"jobs": ["70"]}))
    f = json.loads(invoke("summary", "cancelled", "--json").stdout)["runs"][0]["attempts"][0]["failure"]
    assert f["failure_class"] == "cancelled" and f["message"].startswith("cancelled by the user (hpctrain cancel)")
    d = decide([AttemptRecord(attempt=0, job_id="70", state="CANCELLED", failure_class="cancelled")], Policy(),
               Fit(nodes_needed=1, partition_nodes=4))
    assert d.action == "stop" and "a user's cancel" in d.reason and "from outside" not in d.reason


# -- the summary table fits the terminal ----------------------------------------------------------------------
@pytest.mark.parametrize("columns", [60, 80, 120, 200])
def test_summary_table_fits_the_terminal(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                         columns: int) -> None:
    make_run(env, "tiny-20261201-181443-f695", [{"attempt": 0, "job_id": "28959", "state": "COMPLETED",
                                                 "nodes": "node1", "started": T0, "ended": T0 + 40}],
             metrics=metrics(range(1, 41), 0))
    monkeypatch.setenv("COLUMNS", str(columns))
    out = invoke("summary", "tiny-20261201-181443-f695").stdout
    table = [ln for ln in out.splitlines() if ln.startswith(("┃", "│", "┏", "└"))]
    assert table and max(len(ln) for ln in table) <= columns
    head = next(ln for ln in table if ln.startswith("┃"))
    for col in ("RUN", "STATE", "FAILURE"):  # the most important columns stay
        assert col in head
    # A CPU run: CPU-hours, and no TFLOPS/MFU columns (0.00 against no peak says nothing).
    assert "GPU-H" not in out and "TFLOPS" not in out and "MFU" not in out
    assert ("CPU-H" in head) is (columns >= 120)
    if columns < 200:
        assert "not shown at this width:" in out


def test_gpu_runs_keep_tflops_when_there_is_room(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    make_run(env, "g", [{"attempt": 0, "job_id": "1", "state": "COMPLETED", "nodes": "node1", "started": T0,
                         "ended": T0 + 40}], gpus=8, metrics=metrics(range(1, 41), 0))
    monkeypatch.setenv("COLUMNS", "250")
    out = invoke("summary", "g").stdout
    assert "GPU-H" in out and "TFLOPS" in out and "MFU%" in out and "not shown" not in out


# -- list / status: why a job waits, and a failure told without `summary` first -------------------------------
def _runs_cli(*args: str) -> Any:
    import click
    from click.testing import CliRunner

    from hpctrain.cli import runs as cli_runs

    group = click.Group()
    cli_runs.register(group)
    return CliRunner().invoke(group, list(args), catch_exceptions=False)


def test_pending_reason_in_list_and_status(env: dict[str, Any]) -> None:  # noqa: F811
    sq = env["tmp"] / "bin" / "squeue"
    sq.write_text('#!/bin/sh\necho "$@" >> ' + str(env["tmp"] / "squeue.calls") +
                  '\necho "61|ReqNodeNotAvail, UnavailableNodes:node2"\necho "90_[0-2]|Priority"\n')
    sq.chmod(0o755)
    _node_loss_run(env, {"attempt": 1, "job_id": "61", "state": "PENDING", "nodes": ""})
    out = _runs_cli("status", "lost").stdout
    assert "PENDING (ReqNodeNotAvail, UnavailableNodes:node2)" in out
    doc = json.loads(_runs_cli("status", "lost", "--json").stdout)
    assert doc["attempts"][1]["pending_reason"] == "ReqNodeNotAvail, UnavailableNodes:node2"
    assert "PENDING (ReqNodeNotAvail" in _runs_cli("list").stdout
    from hpctrain.slurmcommands import pending_reasons

    assert pending_reasons(["90_1", "61", "62"]) == {"90_1": "Priority",
                                                     "61": "ReqNodeNotAvail, UnavailableNodes:node2"}


def test_status_tells_a_lost_node_without_summary_first(env: dict[str, Any]) -> None:  # noqa: F811
    """--retries 0: no supervisor stored a class; `status` asks the collector and stores it."""
    from hpctrain.runs.registry import Registry

    _node_loss_run(env, None)
    out = _runs_cli("status", "lost").stdout
    assert "node_fail" in out and "attempt 0: node_fail rank 1 on node2" in out
    assert Registry().get_run("lost").attempts[0].failure_class == "node_fail"


# -- resubmit: what it will do, or why not --------------------------------------------------------------------
def _fault_cli(*args: str) -> Any:
    import click
    from click.testing import CliRunner

    from hpctrain.cli import fault as cli_fault

    group = click.Group()
    cli_fault.register(group)
    return CliRunner().invoke(group, list(args))


def _finished_run(env: dict[str, Any], state: str, exit_code: str) -> Path:  # noqa: F811
    import shutil

    folder = make_run(env, f"r-{state.lower()}", [{"attempt": 0, "job_id": "80", "state": state, "nodes": "node1",
                                                   "started": T0, "ended": T0 + 20, "exit_code": exit_code}],
                      metrics=metrics(range(1, 11), 0, ckpt_every=5), ckpts=(5, 10))
    shutil.copy(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml", folder / "spec.toml")
    return folder


def test_resubmit_of_a_completed_run_is_refused(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from hpctrain.fault import supervisor as sup

    _finished_run(env, "COMPLETED", "0:0")
    monkeypatch.setattr(sup, "resubmit_run", lambda *a, **k: pytest.fail("a completed run was resubmitted"))
    res = _fault_cli("resubmit", "r-completed", "--exclude-failed-nodes")
    assert res.exit_code == 2 and "COMPLETED at step 10" in res.output and "train nothing" in res.output


def test_exclude_failed_nodes_without_a_failed_node_says_so(env: dict[str, Any],  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.fault import policy as pol
    from hpctrain.fault import supervisor as sup

    _finished_run(env, "FAILED", "1:0")
    got: dict[str, Any] = {}

    def fake(run_dir: Path, **kw: Any) -> dict[str, Any]:
        got.update(kw)
        return {"run_id": run_dir.name, "attempt": 1, "job_id": "81", "supervisor": None, "excluded": []}

    monkeypatch.setattr(sup, "resubmit_run", fake)
    monkeypatch.setattr(sup, "fit_of", lambda spec: pol.Fit(nodes_needed=1, partition_nodes=4))
    res = _fault_cli("resubmit", "r-failed", "--exclude-failed-nodes")
    assert res.exit_code == 0, res.output
    assert "implicates no host; nothing more is excluded" in res.output and got["exclude"] == ()


# -- a sweep's dry run ---------------------------------------------------------------------------------------
def test_sweep_dry_run_gives_each_point_its_own_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    tiny = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
    res = CliRunner().invoke(cli, ["submit", tiny, "--dry-run", "--json", "--sweep", "train.seed=1,2,3",
                                   "--out", str(tmp_path / "sw")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    array = json.loads(res.output)["sbatch"]
    # The array's task i writes into point i's folder (through the sweep's %a links), never into point 0's.
    out_line = next(ln for ln in array.splitlines() if ln.startswith("#SBATCH --output="))
    assert "/.sweeps/" in out_line and "/%a/submitit/%A_%a_0_log.out" in out_line and "point-0" in out_line
    for i in range(3):
        own = (tmp_path / "sw" / f"point-{i}" / "sbatch.sh").read_text()
        assert "--array" not in own and f"seed = {i + 1}" in (tmp_path / "sw" / f"point-{i}" / "spec.toml").read_text()
        others = {f"point-{j}" for j in range(3)} - {f"point-{i}"}
        assert f"point-{i}/submitit" in own and not any(o in own for o in others)


# -- the example's header command works on a fresh clone ------------------------------------------------------
def test_llama_example_header_command_works_on_a_fresh_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import re
    import shlex

    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "empty-config"))  # no site copied anywhere
    monkeypatch.chdir(repo)
    header = (repo / "examples" / "llama-8b-h200.toml").read_text()
    commands = re.findall(r"^#\s+(hpctrain .+)$", header, re.MULTILINE)
    assert commands
    for command in commands:
        res = CliRunner().invoke(cli, shlex.split(command)[1:] + ["--json"], catch_exceptions=False)
        assert res.exit_code == 0, (command, res.output)
    # the path of a site file works from anywhere
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["plan", str(repo / "examples" / "llama-8b-h200.toml"), "--site",
                                   os.path.relpath(repo / "examples" / "sites" / "h200-single.toml"), "--json"])
    assert res.exit_code == 0, res.output
    (tmp_path / "run.toml").write_text((repo / "examples" / "tiny.toml").read_text())
    res = CliRunner().invoke(cli, ["plan", "run.toml", "--site", "h200-single"])  # no sites/ beside it
    assert res.exit_code != 0 and "unknown site profile" in res.output and "path of a site file" in res.output


# -- the plot marks where each attempt took over --------------------------------------------------------------
def test_plot_marks_the_resume(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from hpctrain.collect.plot import boundaries

    logs = {"logs/attempt-0.rank-0.log": rank_log(0, [(1, "hpctrain node: rank 0/2"), (12, "x")]),
            "logs/attempt-1.rank-0.log": rank_log(0, [(30, "resumed from step-10 at step 10"), (70, "done")])}
    make_run(env, "plotted", [{"attempt": 0, "job_id": "5", "state": "COMPLETED", "nodes": "", "ended": T0 + 70}],
             logs=logs, metrics=metrics(range(1, 13), 0) + metrics(range(11, 31), 30))
    _stop_event(env["runs"] / "plotted", 0, FC.PREEMPTED, 12, job="5")
    run = json.loads(invoke("summary", "plotted", "--json").stdout)["runs"][0]
    assert boundaries(run) == [(10.5, "a1: resumed at step 10 after preempted, 2 steps redone")]
    lines: list[float] = []
    real = Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda self, x=0, *a, **k: (lines.append(x), real(self, x, *a, **k))[1])
    res = invoke("summary", "plotted", "--plot", str(env["tmp"] / "p.png"))
    assert res.exit_code == 0 and lines == [10.5, 10.5]  # both panels


# -- docs a clone can follow ----------------------------------------------------------------------------------
def test_docs_link_only_what_a_clone_has() -> None:
    """README, docs/, examples/ and containers/ never point outside the repository (a clone has no shared
    folder beside it), and every relative markdown link resolves inside the clone."""
    import re

    repo = Path(__file__).resolve().parents[1]
    outside = ".." + "/shared"  # spelled apart so that this file does not match itself
    texts = [repo / "README.md", *(repo / d for d in ("docs", "examples", "containers"))]
    files = [p for t in texts for p in ([t] if t.is_file() else sorted(t.rglob("*"))) if p.is_file()]
    assert len(files) > 5
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        assert outside not in text and "/work/shared" not in text, path
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if not re.match(r"[a-z]+:", target):
                assert (path.parent / target).resolve().is_relative_to(repo), (path, target)
                assert (path.parent / target).exists(), (path, target)
