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
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}


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


def submit(jobs: list[str], *flags: str) -> tuple[str, Path]:
    argv = [sys.executable, "-m", "hpctrain", "submit", TINY, "--executor", "slurm", "--partition", "debug",
            "--set", "resources.tasks_per_node=1", "--json", *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=dict(os.environ))
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


def test_four_nodes_zero3_optimizer_offload(lab: list[str]) -> None:
    job, run = submit(lab, "--nodes", "4", "--offload", "optimizer")
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
    assert recs[-1]["step"] == 20 and recs[-1]["loss"] < recs[0]["loss"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-20"
    assert (run / "hf" / "model.safetensors").is_file()


def test_usr2_checkpoints_requeues_and_resumes(lab: list[str]) -> None:
    """SLURM's pre-timeout signal: every rank checkpoints at the step boundary, submitit requeues the job,
    attempt 1 (SLURM_RESTART_COUNT=1) resumes from that checkpoint and finishes."""
    job, run = submit(lab, "--nodes", "2", "--steps", "150", "--set", "checkpoint.every_steps=0")
    wait_until(lambda: len(steps(run)) >= 10, 300, "10 training steps")
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    wait_until(lambda: state(job) in FINAL, 600, f"job {job} to end")
    assert state(job) == "COMPLETED"
    log0 = (run / "logs" / "attempt-0.rank-0.log").read_text()
    assert "checkpointed at step" in log0
    stopped = int(log0.split("signal 12: checkpointed at step ")[1].split(",")[0])
    log1 = (run / "logs" / "attempt-1.rank-0.log").read_text()
    assert f"resumed from step-{stopped} at step {stopped}" in log1
    assert steps(run)[-1]["step"] == 150
