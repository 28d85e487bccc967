#!/usr/bin/env python3
"""What the submission transaction (hpctrain.slurm.transaction) costs, beside the one record it replaced.

    transaction   intent (each attempts.jsonl line fsynced, one registry write) + settle (a line each, one
                  registry write): what every SLURM submission now does around sbatch
    baseline      the former record after sbatch only: a line each, one registry write (no fsync)

for one run and for a sweep of N run folders, in a temporary state dir, no SLURM involved.

    python bench/submit_transaction.py [-n 100] [--repeat 7]

Medians of --repeat; the machine is shared, so compare the two rows, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=100, help="run folders of the sweep")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hpctrain-bench-tx-"))
    os.environ["HPCTRAIN_STATE_DIR"] = str(tmp / "state")
    print(f"{'runs':>5}  {'transaction ms':>14}  {'baseline ms':>11}")
    for n in (1, args.n):
        tx = statistics.median(_once(tmp, n, k, True) for k in range(args.repeat))
        base = statistics.median(_once(tmp, n, k, False) for k in range(args.repeat))
        print(f"{n:>5}  {tx * 1000:>14.1f}  {base * 1000:>11.1f}")


def _once(tmp: Path, n: int, k: int, transaction: bool) -> float:
    from hpctrain.runs import folder as runs
    from hpctrain.runs.registry import Attempt, Registry
    from hpctrain.slurm.dispatch import Submitted
    from hpctrain.slurm.transaction import Transaction

    tag = f"{'t' if transaction else 'b'}{n}-{k}"
    dirs = [runs.create_run_folder_atomically(tmp / "runs", f"{tag}-{i}", {"spec.toml": "x\n"}) for i in range(n)]
    subs = [Submitted(d.name, d, f"{k}_{i}", "slurm", i) for i, d in enumerate(dirs)]
    t0 = time.perf_counter()
    if transaction:
        with Transaction(dirs, staging=dirs[0] / "submitit", name=tag, summary={}, mode="train") as tx:
            tx.begin()
            tx.settle(subs)
    else:
        for s in subs:
            runs.append_attempt(runs.RunFolder(s.run_dir).attempts_jsonl, {"attempt": 0, "job_id": s.job_id})
        Registry().add_submitted_many([({"run_id": s.run_id, "name": tag, "folder": str(s.run_dir),
                                         "executor": "slurm", "spec": {}},
                                        Attempt(run_id=s.run_id, attempt=0, job_id=s.job_id)) for s in subs])
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
