#!/usr/bin/env python3
"""`hpctrain summary --all` over N finished jobs against ONE raw `sacct` call over the same jobs.

The jobs are real: one job array of N `true` tasks on the local SLURM cluster (tests/cluster/slurm.sh
up), or an existing finished array given with --array. Each task becomes one registry run (a
synthetic row pointing at the real job id "A_i", a run folder with spec.toml and attempts.jsonl),
recorded as PENDING so that hpctrain's first summary has to ask sacct about all N of them.

Measured (median of --repeat runs, each a fresh process):
  raw sacct    `sacct -X -D --parsable2 --noheader -o JobID,State,ExitCode,NodeList,Start,End -j A_0,...`
  cold         first `hpctrain summary --all --json`: one sacct call, N summaries built and written
  warm         the same again: final states cached in the registry, summary.json files reused
  warm table   `hpctrain summary --all` printing the table instead of JSON

    python bench/summary_all.py [-n 1000] [--array JOBID] [--repeat 3]

Goal (issue 6): warm <= 1.5 x raw sacct + 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "toolkit"))


# The real CLI; registers the collector's commands itself until cli.py does (then this is a no-op).
_ENTRY = ("from hpctrain.cli.main import cli\n"
          "if 'summary' not in cli.commands:\n"
          "    from hpctrain import cli_collect; cli_collect.register(cli)\n"
          "cli()")


def submit_array(n: int, tmp: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", "--partition=debug", f"--array=0-{n - 1}", "--time=00:01:00",
                          "--ntasks=1", "--cpus-per-task=1", "--mem=10M", f"--output={tmp}/true-%A_%a.out",
                          "--job-name=bench-true", "--wrap", "true"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.strip().split(";")[0]


def wait_finished(array: str, n: int, deadline_s: float) -> list[str]:
    """Task ids of the array once squeue no longer lists it (bounded)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        q = subprocess.run(["squeue", "-h", "-r", "-j", array], capture_output=True, text=True, check=False)
        left = len([ln for ln in q.stdout.splitlines() if ln.strip()])
        # slurmctld forgets finished jobs after MinJobAge: squeue then says "Invalid job id".
        if (q.returncode == 0 and left == 0) or "Invalid job id" in q.stderr:
            break
        print(f"  waiting: {left} task(s) of {array} not finished", file=sys.stderr, flush=True)
        time.sleep(10)
    else:
        raise TimeoutError(f"array {array} not finished after {deadline_s:.0f}s")
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID", "-j", array], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    ids = sorted({ln.strip() for ln in out.splitlines() if re.fullmatch(r"\d+_\d+", ln.strip())},
                 key=lambda j: int(j.split("_")[1]))
    return ids[:n]


def make_runs(ids: list[str], tmp: Path) -> None:
    from hpctrain.runs.registry import Attempt, Registry

    runs = tmp / "runs"
    items = []
    now = time.time()
    for i, jid in enumerate(ids):
        folder = runs / f"bench-{i:05d}"
        for sub in ("logs", "metrics", "checkpoints", "submitit"):
            (folder / sub).mkdir(parents=True)
        (folder / "spec.toml").write_text('name = "bench"\n[resources]\nnodes = 1\ngpus_per_node = 0\n'
                                          'tasks_per_node = 1\ncpus_per_task = 1\n')
        (folder / "attempts.jsonl").write_text(json.dumps({"attempt": 0, "job_id": jid, "state": "PENDING",
                                                           "executor": "slurm"}) + "\n")
        items.append(({"run_id": folder.name, "name": "bench", "folder": str(folder), "executor": "slurm",
                       "created": now + i * 1e-3, "spec": {"nodes": 1, "gpus_per_node": 0}},
                      Attempt(run_id=folder.name, attempt=0, job_id=jid, state="PENDING", submitted=now)))
    Registry(tmp / "state" / "registry.sqlite3").add_submitted_many(items)


CPU: dict[str, list[float]] = {}


def timed(argv: list[str], env: dict[str, str], label: str = "") -> float:
    """Wall seconds; the child's CPU seconds (user+sys) go to CPU[label] -- wall time on a shared,
    loaded machine mostly measures the queue for a core."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.setdefault(label, []).append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1000, help="number of finished jobs (default 1000)")
    ap.add_argument("--array", default=None, help="reuse this finished job array instead of submitting one")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the temporary runs/state folder")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hpctrain-bench-summary-"))
    try:
        array = args.array or submit_array(args.n, tmp)
        ids = wait_finished(array, args.n, deadline_s=1800)
        if len(ids) < args.n:
            print(f"note: array {array} has {len(ids)} finished tasks; using them all", file=sys.stderr)
        make_runs(ids, tmp)
        env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(tmp / "runs"), "HPCTRAIN_STATE_DIR": str(tmp / "state"),
               "PYTHONPATH": str(ROOT / "toolkit") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        # As installed: bytecode cached. With PYTHONDONTWRITEBYTECODE every run recompiles ~40 modules.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        raw_argv = ["sacct", "-X", "-D", "--parsable2", "--noheader", "-o", "JobID,State,ExitCode,NodeList,Start,End",
                    "-j", ",".join(ids)]
        hpc = [sys.executable, "-c", _ENTRY]
        raw = [timed(raw_argv, env, "raw") for _ in range(args.repeat)]
        timed([*hpc, "--help"], env)  # writes __pycache__ once, as `pip install` would have
        cold = timed([*hpc, "summary", "--all", "--json"], env, "cold")
        warm = [timed([*hpc, "summary", "--all", "--json"], env, "warm") for _ in range(args.repeat)]
        table = [timed([*hpc, "summary", "--all"], env, "table") for _ in range(args.repeat)]
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    r, w, t = statistics.median(raw), statistics.median(warm), statistics.median(table)
    goal = 1.5 * r + 0.3
    print(f"hpctrain summary --all over {len(ids)} finished jobs (array {array}) vs one raw sacct")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; medians of {args.repeat}")
    print(f"{'':<34}{'wall s':>9}{'x raw':>8}{'cpu s':>9}")
    for name, v, key in (("raw sacct -j <all ids>", r, "raw"), ("hpctrain summary --json (cold)", cold, "cold"),
                         ("hpctrain summary --json (warm)", w, "warm"), ("hpctrain summary table (warm)", t, "table")):
        print(f"{name:<34}{v:>9.3f}{v / r:>8.2f}{statistics.median(CPU[key]):>9.3f}")
    print(f"goal: warm <= 1.5 x raw + 0.3 s = {goal:.3f} s -> {'met' if w <= goal else 'NOT met'}"
          f" (cold {'met' if cold <= goal else 'not met'})")


if __name__ == "__main__":
    main()
