"""The node trainer on the local SLURM cluster (tests/cluster/slurm.sh: node1..node4, CPU ranks).

Submitted with `hpctrain submit --executor slurm`, so the whole path runs: sbatch script, srun, submitit,
NodeJob, SLURM environment -> torch.distributed, DeepSpeed, checkpoints, requeue.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}
OFFLOAD_STEPS = 10
USR2_STEPS = 18


@pytest.fixture()
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    if not shutil.which("sbatch"):
        pytest.skip("no SLURM client on PATH (bash tests/cluster/slurm.sh up)")
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    jobs: list[str] = []
    yield jobs
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30, check=False)


def submit(jobs: list[str], *flags: str, env: dict[str, str] | None = None) -> tuple[str, Path]:
    argv = [sys.executable, "-m", "hpctrain", "submit", TINY, "--executor", "slurm", "--partition", "debug",
            "--set", "resources.tasks_per_node=1", "--json", *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ) if env is None else env)
    assert proc.returncode == 0, proc.stderr
    sub = json.loads(proc.stdout)[0]
    jobs.append(sub["job_id"])
    return str(sub["job_id"]), Path(sub["run_dir"])


def state(job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True,
                         timeout=30, check=False).stdout
    lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def steps(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


class Usr2After:
    """USR2 to the job once its metrics show `after` steps (scancel --signal, as the time limit would): watched
    from the submit on, so the job cannot run to its end while another test of the module waits."""

    def __init__(self, job: str, run: Path, after: int) -> None:
        self.job, self.run, self.after = job, run, after
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._send, name=f"usr2-{job}", daemon=True)
        self.thread.start()

    def _send(self) -> None:
        try:
            # The cluster is shared: wait for the job to start (bounded), then for its steps.
            wait_until(lambda: state(self.job) not in ("", "PENDING"), 900, f"job {self.job} to start")
            wait_until(lambda: len(steps(self.run)) >= self.after, 300, f"{self.after} training steps")
            subprocess.run(["scancel", "--signal=USR2", self.job], check=True, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def join(self, timeout: float) -> None:
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), f"job {self.job}: no USR2 sent within {timeout}s"
        assert self.error is None, self.error


@pytest.fixture(scope="module")
def node_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both jobs of the module, submitted at once (4 + 2 nodes, one rank each: they fit side by side), so
    they run together and each test waits only for its own."""
    if not shutil.which("sbatch"):
        pytest.skip("no SLURM client on PATH (bash tests/cluster/slurm.sh up)")
    base = tmp_path_factory.mktemp("node-slurm")
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(base / "runs"), "HPCTRAIN_STATE_DIR": str(base / "state")}
    jobs: list[str] = []
    out: dict[str, Any] = {}
    try:
        # 10 steps, checkpoints at 5 and 10: what 20 proved (4 ranks train, checkpoint, export), half the CPU
        out["offload"] = submit(jobs, "--nodes", "4", "--offload", "optimizer", "--steps", str(OFFLOAD_STEPS),
                                env=env)
        # Slowed by a sleep on every rank (HPCTRAIN_FAULT_INJECT slow: no CPU): still training when the USR2
        # sent after step 6 arrives (within a poll or two; 12 steps, 12 s or more, are left), with 18 steps
        # instead of 150 bare ones (~0.4 s each); attempt 1 trains the last ~11 steps.
        slow = {**env, "HPCTRAIN_FAULT_INJECT": "slow:step=1,s=1"}
        out["usr2"] = submit(jobs, "--nodes", "2", "--steps", str(USR2_STEPS), "--set", "checkpoint.every_steps=0",
                             env=slow)
        out["usr2_signal"] = Usr2After(*out["usr2"], after=6)
        yield out
    finally:
        if jobs:
            subprocess.run(["scancel", *jobs], capture_output=True, timeout=30, check=False)


def test_four_nodes_zero3_optimizer_offload(node_jobs: dict[str, Any]) -> None:
    job, run = node_jobs["offload"]
    wait_until(lambda: state(job) in FINAL, 600, f"job {job} to end")
    assert state(job) == "COMPLETED", (run / "logs" / "attempt-0.rank-0.log").read_text()[-3000:]
    cfg = json.loads((run / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["stage"] == 3 and "offload_optimizer" in cfg["zero_optimization"]
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 4
    ranks = sorted(p.name for p in (run / "logs").glob("attempt-*.rank-*.log"))
    assert ranks == [f"attempt-0.rank-{r}.log" for r in range(4)]
    assert "via slurm" in (run / "logs" / "attempt-0.rank-3.log").read_text()
    recs = steps(run)
    assert recs[-1]["step"] == OFFLOAD_STEPS and recs[-1]["loss"] < recs[0]["loss"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{OFFLOAD_STEPS}"
    assert (run / "hf" / "model.safetensors").is_file()


def test_usr2_checkpoints_requeues_and_resumes(node_jobs: dict[str, Any]) -> None:
    """SLURM's pre-timeout signal: every rank checkpoints at the step boundary, submitit requeues the job,
    attempt 1 (SLURM_RESTART_COUNT=1) resumes from that checkpoint and finishes."""
    job, run = node_jobs["usr2"]
    node_jobs["usr2_signal"].join(timeout=1300)  # its own waits are bounded: 900 s queued, 300 s to 10 steps
    wait_until(lambda: state(job) in FINAL, 600, f"job {job} to end")
    assert state(job) == "COMPLETED"
    log0 = (run / "logs" / "attempt-0.rank-0.log").read_text()
    assert "checkpointed at step" in log0
    stopped = int(log0.split("signal 12: checkpointed at step ")[1].split(",")[0])
    log1 = (run / "logs" / "attempt-1.rank-0.log").read_text()
    assert f"resumed from step-{stopped} at step {stopped}" in log1
    assert steps(run)[-1]["step"] == USR2_STEPS
