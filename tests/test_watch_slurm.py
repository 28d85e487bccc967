"""Forensics and the live view on the local SLURM cluster, one 2-node job for every assertion (no mocks).

Rank 1 is slowed by 0.5 s a step from step 1 (a straggler) and hangs at step 12 (HPCTRAIN_FAULT_INJECT).
While it hangs, `hpctrain stacks` returns both ranks' stacks through `scancel -s URG`: rank 1 in the fault
injection's frame, rank 0 in the step's all_reduce, on two nodes. Then the watchdog (hang_timeout_s 30)
dumps the stacks again and cancels the job; `status --watch`, started at submit with stdout a pipe, prints
plain lines and ends by itself with the job, exit code 1; `summary` names rank 1 as the straggler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
HANG_STEP = 12




def hpctrain(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("watch")
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(root / "runs"), "HPCTRAIN_STATE_DIR": str(root / "state"),
           "HPCTRAIN_FAULT_INJECT": f"slow:rank=1,step=1,s=0.5;hang:rank=1,step={HANG_STEP}"}
    proc = hpctrain(env, "submit", TINY, "--executor", "slurm", "--partition", "debug", "--nodes", "2",
                    "--set", "resources.tasks_per_node=1", "--set", "resources.exclude=node3", "--steps", "40",
                    "--retries", "0", "--set", "launch.hang_timeout_s=30", "--set", "data.seq_len=32",
                    "--set", "checkpoint.every_steps=4", "--set", "checkpoint.export_hf=false", "--json")
    assert proc.returncode == 0, proc.stderr
    sub = json.loads(proc.stdout)[0]
    env.pop("HPCTRAIN_FAULT_INJECT")
    watch = subprocess.Popen([sys.executable, "-m", "hpctrain", "status", sub["run_id"], "--watch", "--interval", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             stdin=subprocess.DEVNULL)
    try:
        yield {"env": env, "run_id": sub["run_id"], "run": Path(sub["run_dir"]), "job": str(sub["job_id"]),
               "watch": watch}
    finally:
        watch.kill()
        watch.wait(timeout=30)
        subprocess.run(["scancel", str(sub["job_id"])], capture_output=True, timeout=30, check=False)


def _frames(group: dict[str, Any]) -> str:
    return "\n".join(f for t in group["threads"] for f in t["frames"])


def test_stacks_of_a_hung_two_node_job_then_the_watchdog_then_the_watch_ends(hung: dict[str, Any]) -> None:
    run, env = hung["run"], hung["env"]
    marker = run / "metrics" / "faults" / f"hang-step{HANG_STEP}-rank1"
    wait_until(marker.exists, 480, "rank 1 to hang")
    out = hpctrain(env, "stacks", hung["run_id"], "--json", "--timeout", "30")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["dumped"] == [0, 1] and rep["missing"] == [], rep
    by_rank = {g["ranks"][0]: g for g in rep["groups"]}
    assert sorted(by_rank) == [0, 1] and by_rank[0]["hosts"] != by_rank[1]["hosts"]  # two nodes, two stacks
    assert "faultinject.py" in _frames(by_rank[1]) and "in inject" in _frames(by_rank[1])  # the hanging frame
    assert "in all_reduce" in _frames(by_rank[0]) and "in _step" in _frames(by_rank[0])  # waiting for rank 1
    text = hpctrain(env, "stacks", hung["run_id"], "--timeout", "30")
    assert text.returncode == 0 and "rank 1 (" in text.stdout and "main thread" in text.stdout, text.stdout

    # The watchdog: stack files before its cancel, then the job ends and the watch with it.
    dog = run / "stacks" / f"watchdog-{hung['job']}.json"
    rec = json.loads(wait_until(lambda: dog.exists() and dog.read_text(), 240, "the watchdog's stack dumps"))
    assert rec["event"] == "hang" and rec["dumped"] == [0, 1], rec
    watch: subprocess.Popen[str] = hung["watch"]
    stdout, stderr = watch.communicate(timeout=300)
    lines = stdout.splitlines()
    assert watch.returncode == 1, (stdout, stderr)
    assert any("state RUNNING" in ln and f"step {HANG_STEP - 1}/40" in ln for ln in lines), stdout
    assert lines[-1].startswith(f"run {hung['run_id']} ended: job {hung['job']} CANCELLED"), stdout
    assert len(lines) == len(set(lines))  # one line per change

    summ = hpctrain(env, "summary", hung["run_id"], "--json")
    assert summ.returncode == 0, summ.stderr
    strag = json.loads(summ.stdout)["runs"][0]["stragglers"]
    assert [s["rank"] for s in strag["slow_ranks"]] == [1] and strag["slow_ranks"][0]["ratio"] >= 1.2, strag
    table = hpctrain(env, "summary", hung["run_id"])
    assert "stragglers: rank 1 on node" in table.stdout, table.stdout
