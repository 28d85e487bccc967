"""`hpctrain summary` on REAL jobs of the local SLURM cluster (tests/cluster/slurm.sh: node1..node4).

Each test submits the tiny CPU example (2 nodes x 1 rank) with `hpctrain submit --executor slurm`,
waits for the job's end, and checks state, failure class, and the rank/host at fault. Marked `slurm`. The
short jobs that need no node to themselves are submitted together (module fixture `side_by_side`).
A Python exception on ONE rank is injected without touching the node code: a sitecustomize.py on
PYTHONPATH (the job inherits the submitting environment through --export=ALL) wraps the node's
per-step test hook on the chosen rank only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from hpctrain.cli import collect as cli_collect
from slurmclock import TimeLimitClock
from summary_schema import summary_errors

pytestmark = pytest.mark.slurm
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}
# The endless runs (stopped by a cancel, a time limit, a node kill) sleep 1 s in every step on every rank
# (HPCTRAIN_FAULT_INJECT slow): what is tested happens between steps, and the time limit's minute would
# otherwise keep 2 ranks busy on the CI's 2 cores for nothing.
SLEEPY = {"HPCTRAIN_FAULT_INJECT": "slow:step=1,s=1"}
SIGNAL_S = 20

SITECUSTOMIZE = '''
import os, sys
if os.environ.get("SLURM_PROCID") == os.environ.get("COLLECT_TEST_RAISE_RANK"):
    class _Inject:
        """After hpctrain.node.train loads, make its per-step hook raise on this rank."""
        def find_spec(self, name, path, target=None):
            if name != "hpctrain.node.train":
                return None
            sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                def hook(step, *args, **kwargs):
                    if step == int(os.environ.get("COLLECT_TEST_RAISE_STEP", "3")):
                        raise ValueError(f"injected failure at step {step}")
                module._fail_hook = hook
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Inject())
'''


@pytest.fixture()
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    paths = {"runs": tmp_path / "runs", "state": tmp_path / "state", "site": tmp_path / "site", "jobs": []}
    paths["site"].mkdir()
    (paths["site"] / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(paths["runs"]))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(paths["state"]))
    yield paths
    if paths["jobs"]:
        subprocess.run(["scancel", *paths["jobs"]], capture_output=True, timeout=30, check=False)


def submit(lab: dict[str, Any], *flags: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "hpctrain", "submit", TINY, "--executor", "slurm", "--partition", "debug",
            "--nodes", "2", "--set", "resources.tasks_per_node=1", "--set", "checkpoint.every_steps=3", "--json",
            *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    sub = json.loads(proc.stdout)[0]
    lab["jobs"].append(sub["job_id"])
    return dict(sub)


def sacct_state(job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True,
                         timeout=30, check=False).stdout
    lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def wait_state(job: str, states: set[str], timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        seen = sacct_state(job)
        if seen in states:
            return seen
        time.sleep(2)
    raise AssertionError(f"job {job}: wanted {sorted(states)}, last state {seen or '(none)'} after {timeout}s")


def wait_file(path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return
        time.sleep(1)
    raise AssertionError(f"{path} did not appear within {timeout}s")


def summary(run_id: str) -> dict[str, Any]:
    group = click.Group()
    cli_collect.register(group)
    res = CliRunner().invoke(group, ["summary", run_id, "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert summary_errors(doc) == []
    return dict(doc["runs"][0])


def final_summary(run_id: str, job: str) -> dict[str, Any]:
    """sacct can lag the end of a job by a few seconds: summarise until the state is final."""
    wait_state(job, FINAL)
    for _ in range(30):
        run = summary(run_id)
        if run["complete"]:
            return run
        time.sleep(2)
    raise AssertionError(f"{run_id}: summary never complete: {run}")


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The module's short jobs that need no node of their own, submitted at once (2 nodes x 1 rank each: they
    fit side by side) so that they run together; each test waits only for its own. `hpctrain logs --follow`
    starts right after its job's submit, so it follows a job that is still queued or running, as before."""
    root = tmp_path_factory.mktemp("collect")
    lab: dict[str, Any] = {"runs": root / "runs", "state": root / "state", "site": root / "site", "jobs": []}
    lab["site"].mkdir()
    (lab["site"] / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"HPCTRAIN_RUNS_DIR": str(lab["runs"]), "HPCTRAIN_STATE_DIR": str(lab["state"])}
    out: dict[str, Any] = {"env": env}
    follow: subprocess.Popen[str] | None = None
    clock: TimeLimitClock | None = None
    try:
        out["completed"] = submit(lab, "--steps", "6", env=env)
        pp = f"{lab['site']}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        out["exception"] = submit(lab, "--steps", "20", env={**env, "PYTHONPATH": pp, "COLLECT_TEST_RAISE_RANK": "1",
                                                            "COLLECT_TEST_RAISE_STEP": "4"})
        out["follow"] = submit(lab, "--steps", "5", env=env)
        # The time limit's run waits for SLURM's signal beside the others, on nodes 1-2 (the node-loss test needs
        # node3 and node4 to itself), and test_time_limit reads it when its turn comes. Its limit is one it never
        # reaches: the clock moves it once the ranks train, so the signal cannot come during a slow start-up.
        out["time_limit"] = submit(lab, "--steps", "100000", "--time", "00:10:00", "--set",
                                   f"resources.signal_seconds={SIGNAL_S}", "--set", "launch.retries=0", "--set",
                                   "resources.exclude=node[3-4]", env={**env, **SLEEPY})
        clock = out["time_limit_clock"] = TimeLimitClock(Path(out["time_limit"]["run_dir"]), SIGNAL_S,
                                                         train_timeout_s=600)
        clock.start()
        entry = ("from hpctrain.cli.main import cli\n"
                 "if 'logs' not in cli.commands:\n"
                 "    from hpctrain import cli_collect; cli_collect.register(cli)\n"
                 "cli()")
        out["follow_out"], out["follow_err"] = root / "follow.out", root / "follow.err"
        with out["follow_out"].open("w") as fo, out["follow_err"].open("w") as fe:
            follow = subprocess.Popen([sys.executable, "-c", entry, "logs", out["follow"]["run_id"], "--follow"],
                                      stdout=fo, stderr=fe, text=True, env={**os.environ, **env},
                                      stdin=subprocess.DEVNULL)
        out["follow_proc"] = follow
        yield out
    finally:
        if clock is not None:
            clock.stop.set()
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait(timeout=30)
        if lab["jobs"]:
            subprocess.run(["scancel", *lab["jobs"]], capture_output=True, timeout=30, check=False)


@pytest.fixture()
def batch(side_by_side: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """side_by_side's jobs, with this process pointed at their registry (the in-process `summary`)."""
    for key, value in side_by_side["env"].items():
        monkeypatch.setenv(key, value)
    return side_by_side


def test_completed(batch: dict[str, Any]) -> None:
    sub = batch["completed"]
    run = final_summary(sub["run_id"], sub["job_id"])
    a = run["attempts"][0]
    assert (a["state"], a["failure_class"], a["last_step"], a["lost_steps"]) == ("COMPLETED", None, 6, 0)
    assert a["nodes"] == 2 and a["cpu_hours"] > 0 and a["gpu_hours"] == 0 and a["tokens_per_s"] > 0
    assert Path(run["folder"], "summary.json").is_file()


def test_python_exception_on_one_rank(batch: dict[str, Any]) -> None:
    sub = batch["exception"]
    run = final_summary(sub["run_id"], sub["job_id"])
    a = run["attempts"][0]
    assert a["state"] == "FAILED" and a["failure_class"] == "python_exception", a
    f = a["failure"]
    assert f["rank"] == 1 and f["host"] == a["hosts"][1]
    assert f["exception"] == "ValueError: injected failure at step 4"
    assert a["last_step"] == 4 and a["last_checkpoint_step"] == 3 and a["lost_steps"] == 1


def test_logs_follow_until_job_end(batch: dict[str, Any]) -> None:
    """`hpctrain logs --follow` on a job that is still queued/running returns by itself once it ends."""
    sub, proc = batch["follow"], batch["follow_proc"]
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`hpctrain logs --follow` still running after 600 s; job state {sacct_state(sub['job_id'])}")
    stdout, stderr = batch["follow_out"].read_text(), batch["follow_err"].read_text()
    assert proc.returncode == 0, stderr
    lines = stdout.splitlines()
    assert any(ln.startswith("a0 r0 ") and "finished at step 5" in ln for ln in lines), \
        f"state {sacct_state(sub['job_id'])}\n{stdout[-2000:]}\n{stderr[-1000:]}"
    assert any(ln.startswith("a0 r1 ") for ln in lines)
    assert sacct_state(sub["job_id"]) in FINAL


def test_cancelled(lab: dict[str, Any]) -> None:
    """`hpctrain cancel`: SLURM's SIGTERM reaches the ranks, which stop as cancelled by the user (never "for
    requeue"), and the summary says whose cancel it was."""
    sub = submit(lab, "--steps", "100000", env=SLEEPY)
    wait_file(Path(sub["run_dir"]) / "metrics" / "metrics.jsonl")
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "cancel", sub["run_id"]], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    run = final_summary(sub["run_id"], sub["job_id"])
    a = run["attempts"][0]
    assert (a["state"], a["failure_class"]) == ("CANCELLED", "cancelled")
    assert a["last_step"] >= 1 and a["failure"]["message"].startswith("cancelled by the user (hpctrain cancel)")
    logs = "".join(p.read_text(errors="replace") for p in (Path(sub["run_dir"]) / "logs").glob("attempt-0.rank-*.log"))
    assert "for requeue" not in logs


def test_pending_reason_is_squeues() -> None:
    """squeue's %r for a job that waits (here: for its begin time), as `list`/`status` show it."""
    from hpctrain.slurmcommands import pending_reasons

    out = subprocess.run(["sbatch", "--parsable", "--partition", "debug", "--begin", "now+3600", "--wrap", "true"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    job = out.strip().split(";")[0]
    try:
        assert pending_reasons([job]) == {job: "BeginTime"}
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)


def test_time_limit(batch: dict[str, Any]) -> None:
    """SLURM's pre-timeout USR2, once the ranks train: every rank checkpoints and the job is requeued (same id,
    logs attempt-1.*) or ends. The first run's row says time_limit with nothing lost."""
    sub, clock = batch["time_limit"], batch["time_limit_clock"]
    run_dir, job = Path(sub["run_dir"]), sub["job_id"]
    clock.join(timeout=clock.train_timeout_s + 180)  # its own waits are bounded: job id, then training steps
    assert clock.error is None and not clock.is_alive(), (clock.error, clock.events)
    _wait(lambda: (run_dir / "logs" / "attempt-1.rank-0.log").exists() or sacct_state(job) in FINAL,
          "first run's end", 400)
    subprocess.run(["scancel", job], check=False, timeout=30)
    run = final_summary(sub["run_id"], job)
    a = run["attempts"][0]
    assert a["state"] in ("REQUEUED", "TIMEOUT", "FAILED") and a["failure_class"] == "time_limit", a
    # From the ranks' stop event ("stopped on signal at step N (checkpointed: resumable)"), else their log
    # line ("signal 12: checkpointed at step N, stopping for requeue").
    msg = a["failure"]["message"]
    assert a["lost_steps"] == 0 and "checkpointed" in msg and re.search(r"at step \d+", msg), a


def _sacct_history(job: str) -> list[str]:
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State"], capture_output=True,
                         text=True, timeout=30, check=False).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def _wait(cond: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(2)
    raise AssertionError(f"{what}: not within {timeout}s")


def test_node_lost(lab: dict[str, Any]) -> None:
    """Kill node4 (slurmd and every process on it) mid-training. The surviving rank's gloo collective fails
    on the closed connection; the batch script's watchdog (on node3) records a peer_lost verdict and cancels
    the job within seconds, long before slurmctld would declare NODE_FAIL (SlurmdTimeout=30). The summary
    says node_fail, names node4 and the last step, although SLURM's state is CANCELLED. `--retries 0`:
    no supervisor, so the verdict reaches the summary from metrics/watchdog.jsonl alone."""
    busy = subprocess.run(["squeue", "-h", "-w", "node3,node4"], capture_output=True, text=True, timeout=30,
                          check=False).stdout.strip()
    if busy:
        pytest.skip(f"node3/node4 run other jobs; killing node4 would take them down:\n{busy}")
    script = Path(__file__).resolve().parent / "cluster" / "slurm.sh"
    # Both CPUs of node3 and node4: no other job shares the nodes this test takes down.
    sub = submit(lab, "--steps", "100000", "--set", "resources.exclude=node[1-2]", "--cpus-per-task", "2",
                 "--retries", "0", env=SLEEPY)
    run_dir, job = Path(sub["run_dir"]), sub["job_id"]
    wait_file(run_dir / "metrics" / "metrics.jsonl")
    try:
        subprocess.run(["bash", str(script), "kill-node", "4"], check=True, timeout=60, capture_output=True)
        t_kill = time.monotonic()  # once node4 is down: how long slurm.sh takes on a busy machine is not the job's
        _wait(lambda: "NODE_FAIL" in _sacct_history(job) or sacct_state(job) in FINAL, "job noticed the loss", 180)
        ended_s = time.monotonic() - t_kill
    finally:
        subprocess.run(["bash", str(script), "restart-node", "4"], check=False, timeout=120, capture_output=True)
    assert _sacct_history(job)[0] == "CANCELLED" and ended_s < 20, (_sacct_history(job), ended_s)
    run = final_summary(sub["run_id"], job)
    (first,) = run["attempts"]
    assert first["failure_class"] == "node_fail" and first["failure"]["host"] == "node4", first
    assert first["failure"]["rank"] == 1 and "lost its peer on node4" in first["failure"]["message"], first
    assert first["state"] == "CANCELLED" and first["last_step"] >= 1, first
