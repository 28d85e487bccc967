"""The health check before training: the node's measurements (pure parts, a real CPU run, a fake NVML), the
judgement over the job's nodes, and the in-job driver's use of it (nodes swapped for spares, or the job ended
with the failed nodes excluded). The real-cluster test is tests/test_health_slurm.py."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.fault import health as judge_mod
from hpctrain.fault import injob
from hpctrain.node import health
from hpctrain.runs import events as ev
from hpctrain.states import FailureClass


# -- the ring schedule ----------------------------------------------------------------------------------
@given(st.integers(min_value=2, max_value=300))
def test_every_ring_edge_is_measured_once_in_rounds_of_disjoint_pairs(n: int) -> None:
    rounds = health.ring_rounds(n)
    edges = [e for r in rounds for e in r]
    assert sorted(edges) == sorted({(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)})
    assert len(rounds) <= 3  # O(1) rounds, whatever the node count
    for r in rounds:
        ranks = [x for e in r for x in e]
        assert len(ranks) == len(set(ranks))


def test_one_node_has_no_pairs_and_the_bus_bandwidth_is_nccl_tests_definition() -> None:
    assert health.ring_rounds(1) == [] and health.ring_rounds(2) == [[(0, 1)]]
    assert health.busbw_gbps(1_000_000_000, 1.0, 4) == pytest.approx(1.5)
    assert health.busbw_gbps(10, 1.0, 1) == 0.0


# -- judging -------------------------------------------------------------------------------------------
def _cpu(rank: int, gflops: float, pairs: dict[int, float], busbw: float = 1.0) -> dict[str, Any]:
    return {"rank": rank, "done": True, "device": "cpu", "cpu": {"gflops": gflops, "threads": 1},
            "net": {"world": 4, "allreduce_busbw_gbps": busbw, "pairs": {str(k): v for k, v in pairs.items()}}}


def _ring(n: int, slow: set[int], fast: float = 1.0, slow_bw: float = 0.01) -> dict[str, dict[str, Any]]:
    def bw(a: int, b: int) -> float:
        return slow_bw if a in slow or b in slow else fast

    return {f"node{i + 1}": _cpu(i, 10.0, {(i - 1) % n: bw(i, (i - 1) % n), (i + 1) % n: bw(i, (i + 1) % n)})
            for i in range(n)}


def test_a_node_with_a_slow_link_is_the_one_blamed_not_its_neighbours() -> None:
    v = judge_mod.judge(_ring(4, {1}))
    assert list(v.failed) == ["node2"] and "best ring link" in v.failed["node2"]
    assert v.healthy(["node1", "node2", "node3", "node4"]) == ["node1", "node3", "node4"]
    assert v.figures["node1"]["pairs_gbps"] == {"node4": 1.0, "node2": 0.01}


@given(st.integers(min_value=3, max_value=40), st.data())
def test_a_single_slow_node_is_found_in_any_ring(n: int, data: st.DataObject) -> None:
    bad = data.draw(st.integers(min_value=0, max_value=n - 1))
    assert list(judge_mod.judge(_ring(n, {bad})).failed) == [f"node{bad + 1}"]


def test_two_nodes_cannot_say_which_is_slow_so_nobody_is_blamed() -> None:
    reports = {"node1": _cpu(0, 10, {1: 0.01}, busbw=0.01), "node2": _cpu(1, 10, {0: 0.01}, busbw=0.01)}
    v = judge_mod.judge(reports, min_busbw_gbps=1.0)
    assert v.failed == {} and any("cannot" in n for n in v.notes)


def test_a_slow_cpu_a_missing_report_and_a_broken_check_fail() -> None:
    reports: dict[str, dict[str, Any] | None] = _ring(4, set())  # type: ignore[assignment]
    reports["node3"]["cpu"]["gflops"] = 3.0  # type: ignore[index]
    reports["node4"] = {"rank": 3, "device": "cpu"}  # the network test never finished
    reports["node5"] = None
    reports["node6"] = {"rank": 5, "done": True, "error": "RuntimeError: boom"}
    v = judge_mod.judge(reports)
    assert "CPU matmul 3.0 GFLOPS < 0.8" in v.failed["node3"]
    assert v.failed["node4"].startswith("no health report") and "network test" in v.failed["node4"]
    assert v.failed["node5"].startswith("no health report")
    assert "RuntimeError: boom" in v.failed["node6"] and "node1" not in v.failed


def _gpu(rank: int, tflops: float | None, nvml: dict[str, Any] | None = None, name: str = "NVIDIA H200") -> dict[str, Any]:
    return {"rank": rank, "done": True, "device": "gpu",
            "gpus": [{"index": 0, "name": name, "tflops": tflops, "nvml": nvml or {}}]}


def test_a_gpu_below_its_kinds_measured_rate_or_with_nvml_errors_fails() -> None:
    reports: dict[str, dict[str, Any] | None] = {
        "a": _gpu(0, 760.0), "b": _gpu(1, 500.0), "c": _gpu(2, 770.0, {"ecc_uncorrected": 2}),
        "d": _gpu(3, 775.0, {"clock_events_during": 0x40 | 0x4}), "e": _gpu(4, 780.0, {"remap_pending": True}),
        "f": _gpu(5, 770.0, {"clock_events_mask": 0x1 | 0x4})}  # idle + the software power cap: fine
    v = judge_mod.judge(reports)
    assert sorted(v.failed) == ["b", "c", "d", "e"]
    assert "500 TFLOPS < 0.8 x its kind's measured rate 788" in v.failed["b"]
    assert "2 uncorrected ECC" in v.failed["c"] and "hw_thermal_slowdown" in v.failed["d"]
    assert "pending remap" in v.failed["e"]


def test_an_unknown_gpu_kind_is_judged_against_the_jobs_median() -> None:
    reports: dict[str, dict[str, Any] | None] = {
        h: _gpu(i, r, name="Some GPU") for i, (h, r) in enumerate([("a", 100.0), ("b", 98.0), ("c", 40.0)])}
    assert list(judge_mod.judge(reports).failed) == ["c"]
    two = {h: _gpu(i, r, name="Some GPU") for i, (h, r) in enumerate([("a", 100.0), ("c", 40.0)])}
    assert judge_mod.judge(two).failed == {}  # two GPUs of an unknown kind: no basis to tell


# -- the node's measurements ------------------------------------------------------------------------------
def test_nvml_is_read_per_gpu_and_what_it_cannot_answer_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    class NotSupported(Exception):
        pass

    def unsupported(*a: Any) -> Any:
        raise NotSupported

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200", nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetTotalEccErrors=lambda h, t, c: 3 if h == 1 else 0,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, h == 2, 0), nvmlDeviceGetRetiredPagesPendingStatus=unsupported,
        nvmlDeviceGetTemperature=lambda h, s: 40, nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    got = health.nvml_report([0, 1, 2])
    assert got[0] == {"name": "NVIDIA H200", "uuid": "GPU-0", "ecc_uncorrected": 0, "temp_c": 40,
                      "clock_events_mask": 1, "remap_pending": False, "remap_failure": False}
    assert judge_mod.nvml_problems(got[0]) == []
    assert judge_mod.nvml_problems(got[1]) == ["3 uncorrected ECC error(s) since the driver loaded"]
    assert "pending remap" in judge_mod.nvml_problems(got[2])[0]


def test_without_nvidia_ml_py_nvml_reports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert health.nvml_report([0]) == {}


def test_the_injected_slow_matmul_is_measured_as_slow() -> None:
    assert health.slow_factor("node3", "matmul:host=node3,f=0.25;matmul:host=node1,f=0.5;fail:rank=1") == 0.25
    assert health.slow_factor("node2", "matmul:host=node3,f=0.25") == 1.0
    with pytest.raises(ValueError, match="matmul:node3=0.25"):
        health.injected("matmul:node3=0.25")
    # Alternating windows, best of each: a busy machine (a CPU hog, other tests' ranks) slows any one
    # window, and the injected factor scales whatever rate its own window had.
    fast, slow = [], []
    for _ in range(5):
        fast.append(health.cpu_matmul_gflops(0.15, n=128))
        slow.append(health.cpu_matmul_gflops(0.15, factor=0.25, n=128))
    assert max(slow) < 0.5 * max(fast), (fast, slow)


def test_one_node_runs_its_whole_check_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """python -m hpctrain.node RUN with HPCTRAIN_NODE_MODE=health, one process: the CPU's rate, no network."""
    import subprocess

    from runkit import make_run, node_env

    run = make_run(tmp_path / "run")
    out = tmp_path / "health"
    env = node_env({"HPCTRAIN_NODE_MODE": "health", "HPCTRAIN_HEALTH_DIR": str(out), "RANK": "0", "WORLD_SIZE": "1",
                    "SLURMD_NODENAME": "nodeX"})
    proc = subprocess.run([sys.executable, "-m", "hpctrain.node", str(run)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((out / "nodeX.json").read_text())
    assert rec["done"] and rec["device"] == "cpu" and rec["cpu"]["gflops"] > 0 and "net" not in rec


# -- the driver ------------------------------------------------------------------------------------------
class Steps:
    """start_step: the health step writes each host's report; training steps run `python -c` scripts."""

    def __init__(self, reports: dict[str, dict[str, Any] | None], scripts: list[str]) -> None:
        self.reports, self.scripts, self.argv, self.envs = reports, scripts, [], []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> Any:
        import subprocess

        env = env or {}
        self.argv.append(argv)
        self.envs.append(env)
        if env.get("HPCTRAIN_NODE_MODE") == "health":
            out = Path(env["HPCTRAIN_HEALTH_DIR"])
            for h, rec in self.reports.items():
                if rec is not None:
                    (out / f"{h}.json").write_text(json.dumps(rec))
            return subprocess.Popen([sys.executable, "-c", "pass"])
        return subprocess.Popen([sys.executable, "-c", self.scripts.pop(0)])


def _driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reports: dict[str, dict[str, Any] | None],
            hosts: list[str], nodes: int, spares_budget: int = 1) -> tuple[injob.Driver, Steps]:
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    steps = Steps(reports, ["pass", "pass"])
    from hpctrain.slurm import commands

    monkeypatch.setattr(commands, "start_step", steps.start)
    monkeypatch.setattr(commands, "step_ids", lambda job: [f"7.{i}" for i in range(len(steps.argv))])
    monkeypatch.setattr(commands, "scancel", lambda ids: None)
    monkeypatch.setattr(injob.Driver, "_down", lambda self, hs: [])
    env = {"PATH": "/usr/bin:/bin", "SLURM_RESTART_COUNT": "0", "HPCTRAIN_ATTEMPT": "0", "MASTER_PORT": "20100"}
    d = injob.Driver(run, "7", hosts, nodes, 1, spares_budget,
                     ["srun", "--kill-on-bad-exit=1", "python", "-m", "hpctrain.node", str(run)],
                     world=nodes, env=env, health=True, health_timeout_s=60)
    return d, steps


def test_a_training_node_that_fails_the_check_is_swapped_for_a_spare_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = ["node1", "node2", "node3", "node4"]
    d, steps = _driver(tmp_path, monkeypatch, _ring(4, {1}), hosts, nodes=2, spares_budget=2)  # type: ignore[arg-type]
    assert d.run() == 0
    health_argv, train_argv = steps.argv[0], steps.argv[1]
    assert "--nodelist=node1,node2,node3,node4" in health_argv and "--ntasks-per-node=1" in health_argv
    assert [a for a in health_argv if a.startswith("--kill-on-bad-exit")] == ["--kill-on-bad-exit=0"]
    assert steps.envs[0]["HPCTRAIN_NODE_MODE"] == "health" and steps.envs[0]["MASTER_PORT"] == "20106"
    assert "--nodelist=node1,node3" in train_argv and "HPCTRAIN_NODE_MODE" not in steps.envs[1]
    (e,) = ev.read_events(d.run_dir, kind=ev.HEALTH)
    assert e.extra["replaced"] == {"node2": "node3"} and list(e.extra["failed"]) == ["node2"]
    assert e.extra["train_hosts"] == ["node1", "node3"] and e.extra["step_id"] == "7.0"


def test_too_few_healthy_nodes_end_the_job_with_the_failed_ones_named_for_the_resubmission(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = ["node1", "node2", "node3", "node4"]
    reports: dict[str, dict[str, Any] | None] = _ring(4, {1})  # type: ignore[assignment]
    reports["node4"] = None  # never reported
    d, steps = _driver(tmp_path, monkeypatch, reports, hosts, nodes=3)
    decided: list[str] = []
    from hpctrain.fault import supervisor

    monkeypatch.setattr(supervisor, "take_over", lambda run, job: decided.append(job))
    assert d.run() == 1 and len(steps.argv) == 1  # no training step
    (rec,) = [json.loads(x) for x in (d.run_dir / "metrics" / "watchdog.jsonl").read_text().splitlines()]
    assert rec["event"] == "unhealthy" and rec["silent_hosts"] == ["node2", "node4"] and decided == ["7"]
    assert "2 of 4 node(s) passed, 3 needed" in rec["message"]


def test_a_spare_that_fails_the_check_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = ["node1", "node2", "node3"]
    reports: dict[str, dict[str, Any] | None] = _ring(3, {2})  # type: ignore[assignment]
    d, steps = _driver(tmp_path, monkeypatch, reports, hosts, nodes=2)
    # the first training step crashes with a retryable class: no healthy spare is left, so no in-job restart
    steps.scripts = ["raise SystemExit(1)"]
    monkeypatch.setattr(injob, "classify_exit", lambda *a: injob.Verdict(FailureClass.NODE_FAIL, ("node2",), "x"))
    assert d.run() == 1 and len(steps.argv) == 2
    assert "--nodelist=node1,node2" in steps.argv[1]


def test_the_summary_says_which_node_failed_the_check_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.collect import summary

    run = tmp_path / "run"
    run.mkdir()
    ev.append_event(run, ev.Event(kind=ev.HEALTH, time=1.0, job_id="7", attempt=0, extra={
        "step_id": "7.0", "hosts": ["node1", "node2", "node3"], "failed": {"node2": "network: slow"},
        "replaced": {"node2": "node3"}, "train_hosts": ["node1", "node3"], "notes": [], "figures": {}, "elapsed_s": 9.5}))
    atts = summary._with_health_checks([{"attempt": 0, "job_id": "7"}, {"attempt": 1, "job_id": "8"}],
                                       ev.read_events(run))
    assert atts[0]["health"]["failed"] == {"node2": "network: slow"} and "health" not in atts[1]


def _script(tmp_path: Path, flags: dict[str, Any]) -> tuple[str, Any]:
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.sbatch import render_sbatch
    from hpctrain.spec.model import resolve

    spec = resolve(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml", flags)
    plan = make_plan(spec)
    return render_sbatch(spec, plan, tmp_path / "run", "python -u -m submitit.core._submit /f"), plan


def test_the_batch_script_runs_the_check_through_the_driver(tmp_path: Path) -> None:
    text, plan = _script(tmp_path, {"resources.nodes": 2, "resources.spare_nodes": 1, "fault.health_check": True})
    line = next(ln for ln in text.splitlines() if "-m hpctrain.fault.injob" in ln)
    assert " --health --health-timeout 300 --health-matmul-ratio 0.8 --health-net-ratio 0.5" in line
    assert "First a health check on every node" in text
    assert any("health check before training on all 3 node(s)" in r for r in plan.reasons)
    plain, _ = _script(tmp_path, {"resources.nodes": 2, "fault.health_check": True})
    line = next(ln for ln in plain.splitlines() if "-m hpctrain.fault.injob" in ln)
    assert "--restarts 0 " in line and "--health " in line  # no spares: the driver still runs the check


def test_a_sweep_cannot_have_a_health_check(tmp_path: Path) -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.sbatch import render_sbatch
    from hpctrain.spec.model import resolve

    spec = resolve(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml", {"fault.health_check": True})
    with pytest.raises(HpcUsageError, match="fault.health_check = True: a sweep"):
        render_sbatch(spec, make_plan(spec), tmp_path / "a", "python -m x", array="0-1",
                      run_dirs=[tmp_path / "a", tmp_path / "b"])


@pytest.mark.parametrize("key, value", [("fault.health_matmul_ratio", 0.0), ("fault.health_net_ratio", 1.5),
                                        ("fault.health_min_busbw_gbps", -1.0), ("fault.health_timeout_s", 0)])
def test_health_thresholds_out_of_range_are_refused_by_name(key: str, value: Any) -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import resolve

    with pytest.raises(HpcUsageError, match=key.replace(".", r"\.")):
        resolve(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml", {key: value})


def test_submitits_callable_runs_the_check_in_the_health_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training's launch line is submitit's `_submit` of NodeJob: the health step's env turns it into the
    check (the deepspeed launcher's `python -m hpctrain.node` path reads the same variable)."""
    from hpctrain.node import __main__ as node_main
    from hpctrain.node.entry import NodeJob

    ran: list[str] = []
    monkeypatch.setattr(health, "run", lambda run_dir: ran.append(run_dir) or 0)
    monkeypatch.setenv("HPCTRAIN_NODE_MODE", "health")
    assert NodeJob("/runs/a")() == 0 and ran == ["/runs/a"]
    assert node_main.main(["/runs/b", "--launcher", "deepspeed"]) == 0 and ran[-1] == "/runs/b"


@pytest.mark.parametrize("flags, key", [({"resources.spare_nodes": 1}, "resources.spare_nodes = 1"),
                                        ({"fault.health_check": True}, "fault.health_check = true")])
def test_the_local_executor_refuses_spares_and_the_health_check(tmp_path: Path, flags: dict[str, Any], key: str) -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.plan.planner import make_plan
    from hpctrain.slurm import dispatch
    from hpctrain.spec.model import resolve

    spec = resolve(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml", flags)
    with pytest.raises(HpcUsageError, match=key.replace(".", r"\.")):
        dispatch._submit_local([tmp_path / "run"], spec, make_plan(spec), "train")
