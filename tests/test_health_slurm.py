"""The health check on the local 4-node SLURM cluster (no mocks).

1. A slow link, made for real (tc on node2's veth pair: 40 Mbit/s both ways): a 2-node run with one spare,
   pinned to node1-node3, checks all three nodes in an srun step of its own; node2's ring pairs are slow while
   its neighbours each keep one fast pair, so node2 alone fails, node3 takes its place before any training step,
   and the run trains to its end on node1 and node3 in the same job. node1 is made borderline in the first round
   (injected: a real borderline depends on each node's noise), so the driver measures it again in a second srun
   step of its own, where it passes and keeps its place (sacct: the health step, the re-measurement, training).
2. No spare: a check that fails on one node (injected once per run) ends the job before training; the
   supervisor resubmits with that node excluded, and the second job passes its check and trains to the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import SLURM_SH, run_cmd, wait_until
from runkit import jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
STEPS = 24
FLAGS = ["--executor", "slurm", "--partition", "debug", "--set", "resources.tasks_per_node=1",
         "--set", "data.seq_len=32", "--set", "checkpoint.export_hf=false", "--set", "checkpoint.every_steps=8",
         "--steps", str(STEPS), "--health-check", "--json"]


def health_events(run: Path) -> list[dict[str, Any]]:
    return [e for e in jsonl(run / "events.jsonl") if e.get("kind") == "health"]


def last_step(run: Path) -> int:
    return max((int(r["step"]) for r in jsonl(run / "metrics" / "metrics.jsonl") if "step" in r), default=0)


def submit(tmp_path: Path, *flags: str, env_extra: dict[str, str] | None = None) -> tuple[Path, str, dict[str, str]]:
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(tmp_path / "runs"), "HPCTRAIN_STATE_DIR": str(tmp_path / "state"),
           **(env_extra or {})}
    env.pop("HPCTRAIN_FAULT_INJECT", None)
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "submit", TINY, *FLAGS, *flags], capture_output=True,
                          text=True, timeout=120, check=False, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)[0]
    return Path(out["run_dir"]), str(out["job_id"]), env


def summary_text(run: Path, env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-m", "hpctrain", "summary", str(run)], capture_output=True, text=True,
                          timeout=120, check=True, env=env, stdin=subprocess.DEVNULL).stdout


def test_a_node_with_a_slow_link_is_swapped_for_the_spare_before_training(slurm_cluster: Any, tmp_path: Path) -> None:
    run_cmd(["bash", str(SLURM_SH), "slow-net", "2", "40mbit"], timeout=60)
    try:
        run, job, env = submit(tmp_path, "--nodes", "2", "--spare-nodes", "1", "--set", "resources.exclude=node4",
                               "--job-name", "health-net",
                               env_extra={"HPCTRAIN_HEALTH_INJECT": "borderline:host=node1"})
        (check,) = wait_until(lambda: health_events(run), 600, "the health check's verdict", poll=1)
    finally:
        run_cmd(["bash", str(SLURM_SH), "slow-net", "2", "off"], timeout=60)
    assert list(check["failed"]) == ["node2"], check
    assert "best ring link" in check["failed"]["node2"] and check["replaced"] == {"node2": "node3"}
    assert check["train_hosts"] == ["node1", "node3"]
    assert check["remeasured"] == ["node1"], check
    assert any(n.startswith("node1: borderline at first (injected") and "passed" in n for n in check["notes"]), check
    figures = check["figures"]
    assert figures["node2"]["best_link_gbps"] < 0.5 * figures["node1"]["best_link_gbps"]
    wait_until(lambda: last_step(run) >= STEPS, 900, "the run's last step", poll=1)
    assert [ln.split()[0] for ln in (run / "hostfile").read_text().splitlines()] == ["node1", "node3"]

    rows = run_cmd(["sacct", "-n", "-P", "-j", job, "-o", "JobID,NodeList"], timeout=30).stdout.splitlines()
    steps = {r.split("|")[0]: r.split("|")[1] for r in rows}
    assert steps.get(f"{job}.0") == "node[1-3]" and steps.get(f"{job}.1") == "node1", rows
    # .2 and .3 the warm ranks' zygotes, one step on each node that passed (hpctrain.fault.warm), .4 the training
    assert {steps.get(f"{job}.2"), steps.get(f"{job}.3")} == {"node1", "node3"}, rows
    assert steps.get(f"{job}.4") == "node[1,3]", rows
    text = summary_text(run, env)
    assert "health check" in text and "node2 failed: network" in text and "replaced by node3" in text, text


def test_without_a_spare_a_failing_node_is_excluded_on_the_resubmission(slurm_cluster: Any, tmp_path: Path) -> None:
    run, _, env = submit(tmp_path, "--nodes", "2", "--retries", "1", "--job-name", "health-resubmit",
                           env_extra={"HPCTRAIN_HEALTH_INJECT": "fail:rank=1"})
    (first,) = wait_until(lambda: health_events(run)[:1] or None, 600, "the first health check", poll=1)
    (bad,) = list(first["failed"])
    assert "injected" in first["failed"][bad] and first["train_hosts"] == [first["hosts"][0]]
    wait_until(lambda: last_step(run) >= STEPS, 900, "the resubmitted job's last step", poll=1)
    checks = health_events(run)
    assert len(checks) == 2 and checks[1]["failed"] == {} and bad not in checks[1]["hosts"], checks
    decided = [n for n in jsonl(run / "attempts.jsonl") if "decision" in n]
    assert decided and bad in decided[0]["decision"]["exclude"], decided
    assert not [s for s in jsonl(run / "metrics" / "metrics.jsonl") if "step" in s and s.get("time", 0) < first["time"]]
    text = summary_text(run, env)
    assert f"{bad} failed: the health check failed" in text, text
