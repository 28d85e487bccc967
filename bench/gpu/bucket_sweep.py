"""ZeRO-3 bucket variants of the entrypoint beside the plain DeepSpeed loop, alternating, in one device call.

Each run is one `bench/node_gpu.py --only entry|plain` process (a fresh rank each time, as in production).
The schedule rotates the order of the variants from round to round so that drift of the machine falls on
every variant alike; the table at the end gives medians over the rounds. Rows go to OUT/rows.jsonl as
they come; a failed run's log tail goes to OUT/fail.log. Stops starting runs past --budget seconds.

    source bench/gpu/setup.sh      # on the H200 machine
    python bench/gpu/bucket_sweep.py --case mb4 --variants h2,dsdef,big,plain --rounds 3 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# zero_optimization overrides of the entrypoint; "h2" is the builder's own output, "plain" the plain loop.
VARIANTS: dict[str, dict[str, int] | None] = {
    "h2": {},
    "dsdef": {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
              "stage3_param_persistence_threshold": 100_000},
    "big": {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 500_000_000,
            "stage3_param_persistence_threshold": 1_000_000},
    "plain": None,
}
CASES = {"mb4": ["--mb", "4"], "mb6": ["--mb", "6", "--no-ac"]}


def one_run(a: argparse.Namespace, case: str, variant: str, rnd: int, work: Path, out: Path) -> dict[str, Any] | None:
    zero = VARIANTS[variant]
    cmd = [sys.executable, str(ROOT / "bench" / "node_gpu.py"), "--model", a.model, "--zero", "3", "--seq", "4096",
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--out", str(work / f"{case}-{variant}-{rnd}"),
           "--timeout", str(a.timeout), *CASES[case]]
    if zero is None:
        cmd += ["--only", "plain"]
    else:
        cmd += ["--only", "entry", "--tag", variant, "--zero-json", json.dumps(zero)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 30, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        logs = "".join(p.read_text(errors="replace")[-3000:] for p in (work / f"{case}-{variant}-{rnd}").glob("*.log"))
        with (out / "fail.log").open("a") as fh:
            fh.write(f"== {case} {variant} round {rnd} rc {proc.returncode}\n{proc.stdout[-2000:]}\n"
                     f"{proc.stderr[-3000:]}\n{logs}\n")
        return None
    row = dict(json.loads(lines[-1][7:]))
    row.update({"case": case, "variant": variant, "round": rnd, "zero_overrides": zero,
                "run_wall_s": round(time.time() - t0, 1), "utc": time.strftime("%H:%M:%S", time.gmtime())})
    return row


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| case | variant | n | median tok/s | runs | median MFU | ratio to plain |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for case in sorted({r["case"] for r in rows}):
        med: dict[str, float] = {}
        for v in VARIANTS:
            got = [r for r in rows if r["case"] == case and r["variant"] == v]
            if got:
                med[v] = statistics.median(r["tokens_per_s_per_gpu"] for r in got)
        for v, m in med.items():
            got = [r for r in rows if r["case"] == case and r["variant"] == v]
            mfu = [r["mfu"] for r in got if r.get("mfu")]
            ratio = f"{m / med['plain']:.3f}" if "plain" in med else "-"
            runs = ", ".join(f"{r['tokens_per_s_per_gpu']:.0f}" for r in got)
            out.append(f"| {case} | {v} | {len(got)} | {m:.0f} | {runs} | {statistics.median(mfu) if mfu else '-'} "
                       f"| {ratio} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="repeatable; default mb4")
    ap.add_argument("--variants", default="h2,dsdef,big,plain")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--budget", type=float, default=520, help="start no run past this many seconds")
    ap.add_argument("--est", type=float, default=45, help="expected seconds of one run (for the budget)")
    ap.add_argument("--work", default="/tmp/bucket-sweep")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    names = a.variants.split(",")
    t_start = time.time()
    rows: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        for case in a.case or ["mb4"]:
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for v in order:
                if time.time() - t_start + a.est > a.budget:
                    print(f"budget: skipped {case} {v} round {rnd}", flush=True)
                    continue
                row = one_run(a, case, v, rnd, work, out)
                print(("ROW " + json.dumps(row)) if row else f"FAILED {case} {v} round {rnd}", flush=True)
                if row:
                    rows.append(row)
                    with (out / "rows.jsonl").open("a") as fh:
                        fh.write(json.dumps(row) + "\n")
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
