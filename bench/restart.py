#!/usr/bin/env python
"""In-job restart time, part by part, warm ranks (a zygote per node) against cold ones, on the local SLURM cluster.

    .venv/bin/python bench/restart.py [--nodes 3] [--tasks-per-node 2] [--modes warm,cold] [--kill-at 8]
                                      [--after 4] [--out FILE.json]

Each mode is one run of the tiny Llama (CPU ranks, ZeRO-3, checkpoint every 4 steps) with `--spare-nodes 1`:
nodes x tasks-per-node ranks and one spare, the whole 4-node cluster at the defaults. Once it has trained
--kill-at steps, its last training node is killed (`slurm.sh kill-node`: every process of the node); the in-job
driver (hpctrain.fault.injob) restarts it on the survivors and the spare; once --after steps trained after the
restart the job is cancelled and the node restored. `cold` submits with HPCTRAIN_WARM_RANKS=0 (every rank imports
torch and DeepSpeed again: the path before zygotes); `warm` is the default. Printed: hpctrain.fault.injob.timeline
of each run (seconds from the driver's detection; rank 0's start-up phases), side by side, plus the load average
over the restart (the cluster's 4 nodes share this machine's cores: anything else running stretches every part).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from goodput import sh  # bench/ is on sys.path when run as `python bench/restart.py`

REPO = Path(__file__).resolve().parents[1]
SLURM_SH = REPO / "tests" / "cluster" / "slurm.sh"
PARTS = (("first_error", "the survivors' first rank failure (before the detection)"),
         ("stopped", "the ended step stopped"), ("launched", "the next step launched (srun listed)"),
         ("ranks_up", "rank 0's start event (its process up)"),
         ("resumed", "rank 0's training start (engine built, checkpoint loaded)"),
         ("first_step", "the first training step after the restart"))
PHASES = ("entry_s", "preflight_s", "prepare_s", "process_group_s", "engine_s", "load_s")


def jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def wait(cond: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.5)
    raise TimeoutError(f"no {what} in {timeout_s:g} s")


def one_run(mode: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Submit, kill the last training node at --kill-at steps, wait for --after steps of the restart: its record."""
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(root / mode / "runs"), "HPCTRAIN_STATE_DIR": str(root / mode / "st"),
           "HPCTRAIN_WARM_RANKS": "1" if mode == "warm" else "0"}
    env.pop("HPCTRAIN_FAULT_INJECT", None)
    argv = [sys.executable, "-m", "hpctrain", "submit", str(REPO / "examples" / "tiny.toml"), "--executor", "slurm",
            "--partition", "debug", "--nodes", str(a.nodes), "--spare-nodes", "1", "--retries", "0",
            "--steps", "400", "--job-name", f"restart-{mode}", "--json",
            "--set", f"resources.tasks_per_node={a.tasks_per_node}", "--set", "data.seq_len=32",
            "--set", "checkpoint.every_steps=4", "--set", "checkpoint.export_hf=false", "--set", "checkpoint.keep=3"]
    sub = json.loads(subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=True).stdout)[0]
    job, run = str(sub["job_id"]), Path(sub["run_dir"])

    def steps() -> list[dict[str, Any]]:
        return [r for r in jsonl(run / "metrics" / "metrics.jsonl") if "step" in r]

    def restarts() -> list[dict[str, Any]]:
        return [e for e in jsonl(run / "events.jsonl") if e.get("kind") == "restart"]

    host, t_sub = "", time.time()
    try:
        wait(lambda: len(steps()) >= a.kill_at, 900, f"step {a.kill_at}")
        first_step = min(float(r["time"]) for r in steps())
        host = [ln.split()[0] for ln in (run / "hostfile").read_text().splitlines() if ln.strip()][-1]
        load0 = os.getloadavg()[0]
        sh("bash", str(SLURM_SH), "kill-node", host.removeprefix("node"), timeout=60)
        ev = wait(restarts, 120, "in-job restart")[0]
        wait(lambda: len([r for r in steps() if float(r["time"]) > ev["launched"]]) >= a.after, 300,
             f"{a.after} steps after the restart")
        load1 = os.getloadavg()[0]
    finally:
        sh("scancel", job, check=False)
        if host:
            sh("bash", str(SLURM_SH), "restart-node", host.removeprefix("node"), timeout=120, check=False)
    from hpctrain.fault.injob import timeline

    tl = timeline(run)[0]
    start = next((e for e in jsonl(run / "events.jsonl") if e.get("kind") == "train" and e.get("event") == "start"),
                 {})
    return {"mode": mode, "run": str(run), "job": job, "killed": host, "load": [round(load0, 1), round(load1, 1)],
            "job_to_first_step_s": round(first_step - t_sub, 1), "first_startup": start.get("startup"), **tl}


def table(rows: list[dict[str, Any]]) -> str:
    head = "| part | " + " | ".join(r["mode"] for r in rows) + " | what |"
    out = [head, "|" + " --- |" * (len(rows) + 2)]
    for key, what in PARTS:
        out.append(f"| {key} | " + " | ".join(str(r.get(key)) for r in rows) + f" | {what} |")
    for ph in PHASES:
        out.append(f"| rank 0: {ph} | " + " | ".join(str((r.get("startup") or {}).get(ph)) for r in rows)
                   + " | rank 0's start-up phase (hpctrain.node.phases) |")
    out.append("| rank 0 forked by a zygote | " + " | ".join(
        "yes" if (r.get("startup") or {}).get("zygote") else "no" for r in rows) + " | the warm path |")
    out.append("| submit -> first step of the job | " + " | ".join(str(r["job_to_first_step_s"]) for r in rows)
               + " | the first start (zygotes import once per node) |")
    out.append("| load average (kill, after) | " + " | ".join(str(r["load"]) for r in rows) + " | |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--tasks-per-node", type=int, default=2)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--kill-at", type=int, default=8)
    ap.add_argument("--after", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpctrain-restart-"))
    rows = []
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        rows.append(one_run(mode, a, root))
        print(json.dumps(rows[-1], default=str), flush=True)
    print(f"\n{a.nodes} nodes x {a.tasks_per_node} ranks + 1 spare; seconds from the driver's detection\n")
    print(table(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
