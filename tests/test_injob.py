"""In-job restarts (hpctrain.fault.injob): the host choice, the rendered job, and the driver's loop over steps
with fake steps (real processes standing in for srun; the cluster test runs the real thing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.fault import injob
from hpctrain.fault.injob import Driver, StepEnd, plan_restart
from hpctrain.runs import events as ev
from hpctrain.runs.journal import WatchdogVerdict
from hpctrain.states import FailureClass

HOSTS = ["node1", "node2", "node3", "node4"]


def test_a_lost_node_is_replaced_by_a_spare_in_its_place() -> None:
    got = plan_restart(StepEnd(FailureClass.NODE_FAIL, ("node2",)), HOSTS[:3], HOSTS, frozenset(), 0, 2)
    assert not isinstance(got, str)
    assert got.hosts == ("node1", "node4", "node3") and got.replaced == {"node2": "node4"}
    assert got.bad == {"node2"}


def test_a_host_that_failed_once_never_comes_back_as_a_spare() -> None:
    # node2 failed, node4 replaced it; now node4 fails: node2 is no spare (it failed in this job), none left.
    got = plan_restart(StepEnd(FailureClass.NODE_FAIL, ("node4",)), ["node1", "node4"], HOSTS[:2] + ["node4"],
                       frozenset({"node2"}), 1, 3)
    assert isinstance(got, str) and "no spare node left to replace node4" in got


def test_a_retryable_crash_without_a_host_restarts_in_place() -> None:
    got = plan_restart(StepEnd(FailureClass.COMM_TIMEOUT), HOSTS[:2], HOSTS[:2], frozenset(), 0, 1)
    assert not isinstance(got, str) and got.hosts == ("node1", "node2") and got.replaced == {}


@pytest.mark.parametrize(("cls", "used", "why"), [
    (FailureClass.PYTHON_EXCEPTION, 0, "not retryable"),
    (FailureClass.GPU_OOM, 0, "not retryable"),
    (FailureClass.CANCELLED, 0, "not retryable"),
    (FailureClass.NODE_FAIL, 2, "budget spent (2 of 2)"),
    (None, 0, "without a failure"),
])
def test_no_restart_for_user_errors_a_person_or_a_spent_budget(cls: str | None, used: int, why: str) -> None:
    got = plan_restart(StepEnd(cls, ("node2",)), HOSTS[:2], HOSTS, frozenset(), used, 2)
    assert isinstance(got, str) and why in got


def test_the_srun_line_is_narrowed_to_the_chosen_hosts() -> None:
    d = Driver(Path("/r"), "7", HOSTS, 2, 2, 1, ["srun", "--unbuffered", "python", "-m", "x"])
    argv = d.srun_argv(["node1", "node3"])
    assert argv[0] == "srun" and argv[-3:] == ["python", "-m", "x"]
    assert {"--nodes=2", "--nodelist=node1,node3", "--ntasks=4", "--ntasks-per-node=2", "--overlap"} <= set(argv)


# -- the rendered job ---------------------------------------------------------------------------------
def _script(tmp_path: Path, **res: Any) -> tuple[str, Any]:
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.sbatch import render_sbatch
    from hpctrain.spec.model import resolve

    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = resolve(examples / "tiny.toml", {k.replace("__", ".") if "__" in k else f"resources.{k}": v
                                            for k, v in res.items()})
    plan = make_plan(spec)
    return render_sbatch(spec, plan, tmp_path / "run", "python -u -m submitit.core._submit /f"), plan


def test_spares_are_allocated_beside_the_training_nodes_and_the_job_survives_a_node(tmp_path: Path) -> None:
    text, plan = _script(tmp_path, nodes=2, spare_nodes=1)
    assert plan.nodes == 2 and plan.spare_nodes == 1 and plan.in_job_restarts == 1
    assert plan.world_size == 2 * plan.ranks_per_node
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill\n" in text
    line = next(ln for ln in text.splitlines() if "-m hpctrain.fault.injob" in ln)
    assert "--nodes 2 " in line and "--restarts 1 " in line and " -- srun --unbuffered" in line
    assert "hpctrain.fault.supervisor watch" not in text  # the driver watches each step itself
    assert any("spare" in r for r in plan.reasons)


def test_straggler_exclusion_reaches_the_driver(tmp_path: Path) -> None:
    text, _ = _script(tmp_path, nodes=2, spare_nodes=1, fault__straggler_patience_s=120, fault__straggler_ratio=1.5)
    line = next(ln for ln in text.splitlines() if "-m hpctrain.fault.injob" in ln)
    assert "--straggler-patience 120 --straggler-ratio 1.5 -- srun" in line


def test_a_sweep_cannot_have_spares(tmp_path: Path) -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.sbatch import render_sbatch
    from hpctrain.spec.model import resolve

    spec = resolve(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml", {"resources.spare_nodes": 1})
    with pytest.raises(HpcUsageError, match="resources.spare_nodes = 1: a sweep"):
        render_sbatch(spec, make_plan(spec), tmp_path / "a", "python -m x", array="0-1",
                      run_dirs=[tmp_path / "a", tmp_path / "b"])


def test_without_spares_or_restarts_the_job_is_as_before(tmp_path: Path) -> None:
    text, plan = _script(tmp_path, nodes=2)
    assert plan.spare_nodes == 0 and plan.in_job_restarts == 0
    assert "--no-kill" not in text and "hpctrain.fault.injob" not in text and "#SBATCH --nodes=2\n" in text


# -- the driver's loop, with processes standing in for srun ---------------------------------------------
class FakeSteps:
    """start_step runs `python -c` with the next script; each step writes what a rank would (events)."""

    def __init__(self, run_dir: Path, scripts: list[str]) -> None:
        self.run_dir, self.scripts, self.argv, self.envs = run_dir, scripts, [], []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> Any:
        import subprocess

        self.argv.append(argv)
        self.envs.append(env or {})
        return subprocess.Popen([sys.executable, "-c", self.scripts[len(self.argv) - 1]], env=env)


def _failure(run_dir: Path, attempt: int, cls: str, exc: str = "RuntimeError: gloo Connection reset by peer") -> str:
    line = json.dumps({"time": 1.0, "kind": "failure", "class": cls, "rank": 0, "host": "node1", "job_id": "7",
                       "attempt": attempt, "exception": exc,
                       "message": "", "exit_code": 1})
    return f"open({str(run_dir / 'events.jsonl')!r}, 'a').write({line!r} + '\\n'); raise SystemExit(1)"


def _driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scripts: list[str],
            budget: int = 1) -> tuple[Driver, FakeSteps]:
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    fake = FakeSteps(run, scripts)
    from hpctrain import slurmcommands as commands

    monkeypatch.setattr(commands, "start_step", fake.start)
    monkeypatch.setattr(commands, "step_ids", lambda job: [f"7.{i}" for i in range(len(fake.argv))])
    monkeypatch.setattr(Driver, "_down", lambda self, hosts: [])
    env = {"PATH": "/usr/bin:/bin", "SLURM_RESTART_COUNT": "0", "HPCTRAIN_ATTEMPT": "0", "MASTER_PORT": "20100"}
    return Driver(run, "7", ["node1", "node2"], 2, 1, budget, ["srun", "x"], world=2, env=env), fake


def test_a_transient_crash_restarts_in_place_as_a_new_attempt_and_step(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    d, fake = _driver(tmp_path, monkeypatch, [_failure(run, 0, FailureClass.COMM_TIMEOUT), "pass"])
    assert d.run() == 0
    assert len(fake.argv) == 2 and [e["HPCTRAIN_ATTEMPT"] for e in fake.envs] == ["0", "1"]
    assert all(e["MASTER_ADDR"] == "node1" for e in fake.envs)
    (restart,) = ev.read_events(run, kind=injob.RESTART)
    assert restart.attempt == 0 and restart.failure_class == FailureClass.COMM_TIMEOUT
    assert restart.extra["step_id"] == "7.0" and restart.extra["next_step_id"] == "7.1"
    assert restart.extra["next_attempt"] == 1 and restart.extra["replaced"] == {}
    rec = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()][-1]
    assert rec["attempt"] == 1 and rec["job_id"] == "7" and rec["step_id"] == "7.1"
    assert (run / "hostfile").read_text().split() == ["node1", "slots=1", "node2", "slots=1"]


def test_a_user_error_ends_the_job_with_its_exit_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    d, fake = _driver(tmp_path, monkeypatch,
                      [_failure(run, 0, FailureClass.PYTHON_EXCEPTION, "ValueError: bad lr"), "pass"])
    assert d.run() == 1 and len(fake.argv) == 1
    assert not ev.read_events(run, kind=injob.RESTART)


def test_the_budget_bounds_the_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    crash = _failure(run, 0, FailureClass.COMM_TIMEOUT)
    d, fake = _driver(tmp_path, monkeypatch, [crash, _failure(run, 1, FailureClass.COMM_TIMEOUT), "pass"], budget=1)
    assert d.run() == 1 and len(fake.argv) == 2


def test_a_peer_lost_verdict_swaps_the_dead_host_for_a_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog's peer check condemns the running step (it never ends by itself): the driver stops it and
    starts the next on the survivor and the spare, rank order kept."""
    d, fake = _driver(tmp_path, monkeypatch, ["import time; time.sleep(60)", "pass"])
    d.job_hosts = ["node1", "node2", "node3"]
    verdict = WatchdogVerdict(event="peer_lost", silent_hosts=("node2",), message="rank 0 lost its peer on node2",
                              time=5.0)
    calls = iter([verdict])
    monkeypatch.setattr(injob.Watchdog, "peer_check", lambda self, **kw: next(calls, None))
    monkeypatch.setattr(injob.Driver, "_stop_step", lambda self, proc, step: proc.kill())
    assert d.run() == 0
    assert "--nodelist=node1,node3" in fake.argv[1]
    (restart,) = ev.read_events(d.run_dir, kind=injob.RESTART)
    assert restart.failure_class == FailureClass.NODE_FAIL and restart.extra["replaced"] == {"node2": "node3"}


def test_main_reads_its_options_before_the_srun_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(Driver, "run", lambda self: seen.update(vars(self)) or 0)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-3]")
    argv = [str(tmp_path), "--nodes", "2", "--tasks-per-node", "1", "--restarts", "1", "--world", "2",
            "--hang-timeout", "300", "--", "srun", "--unbuffered", "--nodes", "9", "python"]
    assert injob.main(argv) == 0
    assert seen["nodes"] == 2 and seen["job_hosts"] == ["node1", "node2", "node3"]
    assert seen["launch"] == ["srun", "--unbuffered", "--nodes", "9", "python"] and seen["hang_timeout_s"] == 300


def test_a_straggler_must_persist_before_it_counts() -> None:
    p = injob._Persistence(60)
    assert p.update(["node2"], now=100.0) is None and p.update(["node2"], now=150.0) is None
    assert p.update(["node2", "node3"], now=170.0) is None  # another set: the clock starts again
    assert p.update(["node2", "node3"], now=229.0) is None
    rec = p.update(["node2", "node3"], now=231.0)
    assert rec is not None and rec.event == "straggler" and rec.silent_hosts == ("node2", "node3")
    assert p.update([], now=300.0) is None


def test_a_persistent_straggler_is_replaced_by_a_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d, fake = _driver(tmp_path, monkeypatch, ["import time; time.sleep(60)", "pass"])
    d.job_hosts, d.straggler_patience_s = ["node1", "node2", "node3"], 0.4
    d.find_stragglers = lambda beats, ratio: ["node2"]
    monkeypatch.setattr(injob.Driver, "_stop_step", lambda self, proc, step: proc.kill())
    assert d.run() == 0
    assert "--nodelist=node1,node3" in fake.argv[1]
    (restart,) = ev.read_events(d.run_dir, kind=injob.RESTART)
    assert restart.extra["replaced"] == {"node2": "node3"} and restart.message.startswith("straggler: node2")
    assert restart.failure_class == FailureClass.STRAGGLER  # slow is not failed: never node_fail


def test_without_a_spare_a_straggler_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d, fake = _driver(tmp_path, monkeypatch, ["import time; time.sleep(1.5)"])
    d.straggler_patience_s = 0.2
    d.find_stragglers = lambda beats, ratio: ["node2"]
    assert d.run() == 0 and len(fake.argv) == 1


def test_summary_shows_each_step_as_an_attempt_with_the_node_its_spare_replaced(tmp_path: Path) -> None:
    from hpctrain.collect import summary

    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    att = [{"attempt": 0, "job_id": "7", "state": "COMPLETED", "submitted": 90.0, "started": 100.0, "ended": 300.0,
            "nodes": "node[1-3]", "executor": "slurm"},
           {"attempt": 1, "job_id": "7", "step_id": "7.1", "in_job_restart_of": 1, "executor": "slurm",
            "after": {"attempt": 0, "step_id": "7.0"}}]
    (run / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in att))
    # steps 1-9 before the kill (the last at 149 s), redone from 9 after the restart launched at 158.5 s
    recs = [{"step": s, "loss": 1.0, "time": 140.0 + s} for s in range(1, 10)]
    recs += [{"step": s, "loss": 1.0, "time": 160.0 + s} for s in range(9, 21)]
    (run / "metrics" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ev.append_event(run, ev.Event(kind=ev.RESTART, time=158.5, host="node2", job_id="7", attempt=0,
                                  failure_class=FailureClass.NODE_FAIL, message="rank 0 lost its peer on node2",
                                  extra={"step_id": "7.0", "step_hosts": ["node1", "node2"], "next_step_id": "7.1",
                                         "next_attempt": 1, "replaced": {"node2": "node3"},
                                         "hosts": ["node1", "node3"], "detected": 153.0, "stopped": 155.0,
                                         "launched": 158.5}))
    rows = summary.build_run(summary.from_folder(run), now=400.0)["attempts"]
    assert [r["step_id"] for r in rows] == ["7.0", "7.1"] and [r["job_id"] for r in rows] == ["7", "7"]
    assert rows[0]["state"] == "REQUEUED" and rows[0]["failure_class"] == FailureClass.NODE_FAIL
    assert rows[0]["failure"]["host"] == "node2" and rows[0]["in_job_restart"]["replaced"] == {"node2": "node3"}
    assert rows[0]["hosts"] == ["node1", "node2"] and rows[1]["hosts"] == ["node1", "node3"]
    assert (rows[0]["last_step"], rows[1]["first_step"], rows[1]["last_step"]) == (9, 9, 20)
    assert rows[1]["state"] == "COMPLETED" and rows[1]["failure_class"] is None


# -- restart overhead: fresh ports, the ended step's ranks, a dead node seen without the confirmation wait ------
def test_each_restart_has_its_own_rendezvous_ports_and_restart_number(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A dying rank 0 of the ended step may still hold MASTER_PORT: the next step rendezvouses 2 ports up (the
    pre-flight takes +1), and its ranks know which restart they are (they wait for the ended step's ranks)."""
    run = tmp_path / "run"
    d, fake = _driver(tmp_path, monkeypatch, [_failure(run, 0, FailureClass.COMM_TIMEOUT),
                                              _failure(run, 1, FailureClass.COMM_TIMEOUT), "pass"], budget=2)
    assert d.run() == 0
    assert [e["MASTER_PORT"] for e in fake.envs] == ["20100", "20102", "20104"]
    assert [e["HPCTRAIN_INJOB_RESTART"] for e in fake.envs] == ["0", "1", "2"]


def _lost_peer_files(run: Path, attempt: int) -> None:
    from hpctrain.runs import beats

    ranks = beats.ranks_dir(run / "metrics")
    ranks.mkdir(parents=True, exist_ok=True)
    now = __import__("time").time()
    failed = {"rank": 0, "host": "node1", "step": 5, "phase": "failed", "time": now, "job": "7", "restart": "0",
              "attempt": attempt, "error": "RuntimeError: Connection reset by peer"}
    beats.write_record(ranks, beats.failed_name("7", "0", 0), failed)
    beats.write_record(ranks, beats.beat_name(0), failed)
    beats.write_record(ranks, beats.beat_name(1), {"rank": 1, "host": "node2", "step": 5, "phase": "compute",
                                                   "time": now - 30, "job": "7", "restart": "0",
                                                   "attempt": attempt})


@pytest.mark.parametrize("slurmd_up, expect", [(False, True), (True, False)])
def test_a_dead_node_is_condemned_at_once_a_live_one_after_the_confirmation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurmd_up: bool, expect: bool) -> None:
    """The peer-lost verdict waits 3 s for a step that may end by itself (a rank died on a live node); when the
    blamed host's slurmd takes no connection, the node is gone and the wait buys nothing."""
    d, _ = _driver(tmp_path, monkeypatch, [])
    _lost_peer_files(d.run_dir, 0)
    probes: list[str] = []
    monkeypatch.setattr(injob, "_slurmd_answers", lambda host, port: probes.append(host) or slurmd_up)
    d.slurmd_port = 6818
    dog = injob.Watchdog(d.run_dir, "7", 1e9, world=2, restart="0", only_attempt=0)
    assert dog.peer_check() is None  # inside the confirmation period
    probed: dict[str, bool] = {}
    rec = d._early_peer_lost(dog, probed)
    assert (rec is not None) is expect and probes == ["node2"]
    if rec:
        assert rec.silent_hosts == ("node2",) and "not answering" in rec.message
    d._early_peer_lost(dog, probed)
    assert probes == ["node2"]  # once per host and step


def test_a_late_record_of_the_ended_step_is_not_the_new_steps(tmp_path: Path) -> None:
    """A rank of attempt 0 that writes its failure after attempt 1 started (same job, same restart count) is not
    evidence against attempt 1."""
    from hpctrain.runs import beats

    _lost_peer_files(tmp_path, 0)
    assert beats.read_failures(tmp_path, "7", "0", attempt=1) == []
    assert len(beats.read_failures(tmp_path, "7", "0", attempt=0)) == 1
    assert len(beats.read_beats(tmp_path, "7", "0", attempt=1)) == 0
    assert len(beats.read_failures(tmp_path, "7", "0")) == 1  # without an attempt: as before


def test_the_new_ranks_find_the_ended_steps_processes_on_their_node(tmp_path: Path) -> None:
    from hpctrain.node.launch import predecessors

    def proc(pid: int, cmd: str, **env: str) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode())

    run = {"HPCTRAIN_RUN_DIR": "/runs/a", "HPCTRAIN_ATTEMPT": "0"}
    proc(11, "python -m hpctrain.node /runs/a", **run, HPCTRAIN_INJOB_RESTART="0")  # the ended step's rank
    proc(12, "python -m hpctrain.node /runs/a", **run, HPCTRAIN_INJOB_RESTART="1")  # a peer of the new step
    proc(13, "python -m hpctrain.fault.injob /runs/a", **run)  # the driver: no restart number of its own
    proc(14, "srun python -m hpctrain.node /runs/b", **{**run, "HPCTRAIN_RUN_DIR": "/runs/b"},
         HPCTRAIN_INJOB_RESTART="0")  # another run
    proc(15, "bash job.sh", **run, HPCTRAIN_INJOB_RESTART="0")  # not a node entry
    assert predecessors.find("/runs/a", 1, proc=tmp_path) == [11]
    assert predecessors.find("/runs/a", 0, proc=tmp_path) == []


def test_a_rank_of_the_ended_step_that_lingers_is_killed_before_the_new_one_starts(tmp_path: Path) -> None:
    import subprocess
    import time

    from hpctrain.node.launch import predecessors

    env = {"PATH": "/usr/bin:/bin", "HPCTRAIN_RUN_DIR": str(tmp_path), "HPCTRAIN_ATTEMPT": "0",
           "HPCTRAIN_INJOB_RESTART": "0"}
    # Ignores SIGTERM, as a rank stuck in a collective may: only SIGKILL ends it.
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    old = subprocess.Popen([sys.executable, "-c", code, "hpctrain.node"], env=env)
    try:
        deadline = time.monotonic() + 30
        while not predecessors.find(str(tmp_path), 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        said: list[str] = []
        assert predecessors.wait_gone(str(tmp_path), 1, said.append, grace_s=0.3) == 1
        assert old.wait(timeout=30) == -9 and any("killing" in s for s in said)
        assert predecessors.wait_gone(str(tmp_path), 1, said.append) == 0
    finally:
        old.kill()
