#!/usr/bin/env python3
"""A 100-run sweep through `hpctrain submit --sweep` against a raw `sbatch --array` of 100 tasks.

Both go to the local SLURM cluster (tests/cluster/slurm.sh up) as ONE job array of 1-node tasks.
Measured per side:
  submit  wall time of the submitting command (hpctrain: python start, spec/plan for 100 points,
          100 run folders, render, one sbatch, 100 registry records; raw: one sbatch)
  done    submit + until `squeue` no longer lists the array (hpctrain tasks run the pre-flight
          through submitit -- a Python start and unpickle each; raw tasks run `srun python3 -c pass`)

    python bench/submit_sweep.py [-n 100] [--repeat 3] [--no-wait]

Submission is timed --repeat times per side (each array cancelled at once; the median is shown),
then one more array per side runs to the end. Everything goes to a temporary runs/state dir; the
arrays are scancel'ed on exit. The machine is shared: compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wait_gone(job: str, deadline_s: float) -> float:
    """Seconds until squeue stops listing `job` (never `squeue | grep -q`: SIGPIPE, see the recipe)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < deadline_s:
        out = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, check=False).stdout
        if not out.strip():
            return time.perf_counter() - t0
        time.sleep(0.5)
    raise TimeoutError(f"job {job} still queued after {deadline_s:.0f}s")


def run_hpctrain(n: int, tmp: Path, wait: bool) -> tuple[float, float | None, str]:
    tag = f"{time.monotonic_ns()}"
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(tmp / tag / "runs"), "HPCTRAIN_STATE_DIR": str(tmp / tag / "state")}
    lrs = ",".join(f"{1e-4 * (i + 1):.6g}" for i in range(n))
    argv = [sys.executable, "-m", "hpctrain", "submit", str(ROOT / "examples" / "tiny.toml"), "--preflight",
            "--executor", "slurm", "--partition", "debug", "--nodes", "1", "--set", "resources.tasks_per_node=1",
            "--time", "00:05:00", "--sweep", f"train.lr={lrs}", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    submit_s = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"hpctrain submit failed:\n{proc.stderr}")
    subs = json.loads(proc.stdout)
    assert len(subs) == n, len(subs)
    job = subs[0]["job_id"].split("_")[0]
    assert all(s["job_id"].split("_")[0] == job for s in subs), "sweep was not one array"
    done = submit_s + _wait_gone(job, 900) if wait else None
    return submit_s, done, job


def run_raw(n: int, tmp: Path, wait: bool) -> tuple[float, float | None, str]:
    script = tmp / "raw.sh"
    script.write_text("#!/bin/bash\n#SBATCH --partition=debug\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n"
                      f"#SBATCH --time=00:05:00\n#SBATCH --array=0-{n - 1}\n"
                      f"#SBATCH --output={tmp}/raw-%A_%a.out\nsrun python3 -c pass\n")
    t0 = time.perf_counter()
    out = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, check=True, timeout=60).stdout
    submit_s = time.perf_counter() - t0
    job = re.search(r"job (\d+)", out).group(1)  # type: ignore[union-attr]
    done = submit_s + _wait_gone(job, 900) if wait else None
    return submit_s, done, job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=100, help="sweep size (default 100)")
    ap.add_argument("--repeat", type=int, default=3, help="submission-only repetitions per side (default 3)")
    ap.add_argument("--no-wait", dest="wait", action="store_false", help="measure submission only")
    args = ap.parse_args()
    jobs: list[str] = []
    subs: dict[str, list[float]] = {"raw": [], "hpc": []}
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as d:
        tmp = Path(d)
        try:
            for _ in range(args.repeat):  # interleaved, so both sides see the same machine load
                for side, fn in (("raw", run_raw), ("hpc", run_hpctrain)):
                    sub_s, _, job = fn(args.n, tmp, False)
                    subprocess.run(["scancel", job], capture_output=True, check=False)
                    _wait_gone(job, 120)  # let slurmctld clear it before the next measurement
                    subs[side].append(sub_s)
            raw = run_raw(args.n, tmp, args.wait) if args.wait else None
            if raw:
                jobs.append(raw[2])
            hpc = run_hpctrain(args.n, tmp, args.wait) if args.wait else None
            if hpc:
                jobs.append(hpc[2])
        finally:
            if jobs:
                subprocess.run(["scancel", *jobs], capture_output=True, check=False)
    med = {k: statistics.median(v) for k, v in subs.items()}
    print(f"{args.n}-task sweep on the local cluster (one job array each); submit = median of {args.repeat}")
    print(f"{'':<28}{'submit s':>10}{'done s':>10}")
    for name, key, full in (("raw sbatch --array", "raw", raw), ("hpctrain submit --sweep", "hpc", hpc)):
        done = full[1] if full else None
        print(f"{name:<28}{med[key]:>10.3f}{(f'{done:.1f}' if done is not None else '-'):>10}")
    ratio_done = f"{hpc[1] / raw[1]:.2f}" if hpc and raw and hpc[1] and raw[1] else "-"
    print(f"{'ratio hpctrain/raw':<28}{med['hpc'] / med['raw']:>10.1f}{ratio_done:>10}")
    print(f"hpctrain per run: {1e3 * (med['hpc'] - med['raw']) / args.n:.1f} ms (python start, spec/plan, "
          "run folder, registry)")
    print(f"submitit's own ex.submit x{args.n} sleeps 0.2 s each (throttle): >= {0.2 * args.n:.0f} s to submit")


if __name__ == "__main__":
    main()
