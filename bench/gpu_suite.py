"""Issue #8 in one call on one H200: every single-GPU benchmark, a table last, and a markdown report.

Runs, one after the other until --budget-s is spent (later ones are listed as not run):

  1b-mfu     bench/node_gpu.py: 1B ZeRO-3, micro-batch 6, no activation checkpointing (entrypoint), and
             the plain DeepSpeed loop at the same settings                           (goal 4)
  8b-plan    bench/plan_check.py: 8B, everything auto (ZeRO, offload ratio, micro-batch, recompute)   (goals 1, 2)
  dynbatch   bench/node_dynamic_batching.py: padded vs dynamic vs packed, 1B, seq 4096          (goal 6)
  ckpt       bench/checkpoint_io.py: dd vs sync save vs async save, 1B ZeRO-3                   (goal 5)
  3b-offload bench/gpu/offload_parts.py: 3B optimizer-offload step parts alone, then the entrypoint and the
             plain loop (issue 18 goals 1 and 3; GPU only)
  plan-*     bench/plan_check.py: 1B/3B ZeRO-3 with and without optimizer offload: memory vs plan (goals 1, 3)

    source bench/gpu/setup.sh
    python bench/gpu_suite.py --out /tmp/suite --md $OUT/BENCHMARKS-run.md --budget-s 540
    python bench/gpu_suite.py --cpu --out /tmp/suite-cpu        # smoke test of this script (tiny models)

Issue 18's goal 3 (the 3B offload step against the sum of its parts) is the 3b-offload case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


# Cases that need longer than --case-timeout: 3b-offload is the parts (~115 s, the CPU Adam JIT build in it)
# and one entrypoint and one plain run (~90 s each).
CASE_TIMEOUT = {"3b-offload": 400.0}


def cases(cpu: bool) -> list[tuple[str, list[str]]]:
    """(name, argv after the python executable). --cpu swaps in tiny models and short sequences."""
    big, mid, huge, seq = ("llama-tiny", "llama-tiny", "llama-10m", "128") if cpu else \
        ("llama-1b", "llama-3b", "llama-8b", "4096")
    dev = ["--cpu"] if cpu else []
    pc = [str(BENCH / "plan_check.py"), "--seq", seq, *dev]
    return [
        ("1b-mfu", [str(BENCH / "node_gpu.py"), "--model", big, "--zero", "3", "--mb", "6", "--seq", seq,
                    "--no-ac", "--steps", "5", "--warmup", "2"] + (["--only", "entry", "--cpu"] if cpu else [])),
        ("8b-plan", [*pc, "--model", huge, "--offload", "optimizer", "--ratio", "auto", "--global-batch", "16",
                     "--ac", "auto", "--steps", "3", "--warmup", "1"]),
        ("dynbatch", [str(BENCH / "node_dynamic_batching.py"), "--model", big, "--seq", seq, "--mb", "4",
                      "--steps", "6", "--warmup", "2", *([] if cpu else ["--gpu"])]),
        ("ckpt", [str(BENCH / "checkpoint_io.py"), "--model", big, "--dir", "/tmp/hpctrain-ckio",
                  *([] if cpu else ["--gpu"])]),
        *([] if cpu else [("3b-offload", [str(BENCH / "gpu" / "offload_parts.py"), "--parts", "--variants",
                                          "entry3,plain3", "--rounds", "1", "--steps", "3", "--warmup", "2",
                                          "--timeout", "150", "--budget", "330", "--est", "85"])]),
        ("plan-1b", [*pc, "--model", big, "--mb", "4"]),
        ("plan-1b-offload", [*pc, "--model", big, "--mb", "4", "--offload", "optimizer"]),
        ("plan-3b", [*pc, "--model", mid, "--mb", "4"]),
        ("plan-3b-offload", [*pc, "--model", mid, "--mb", "4", "--offload", "optimizer"]),
    ]


def run_one(name: str, argv: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """Run one benchmark; keep its log; collect its `RESULT {json}` lines (the table of dynbatch too)."""
    log = out / f"{name}.log"
    t0 = time.time()
    try:
        where = ["--json", str(out / f"{name}.json")] if "checkpoint_io" in argv[0] else ["--out", str(out / name)]
        proc = subprocess.run([sys.executable, *argv, *where], capture_output=True, text=True, timeout=timeout,
                              check=False, cwd=str(BENCH.parent))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text, rc = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout:.0f} s", 124
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    log.write_text(text)
    results = [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
    table = [line for line in text.splitlines() if line.startswith("| ")]
    return {"name": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "results": results, "table": table}


def summary_rows(runs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One (case, figures) line per run, for the table printed last."""
    rows = []
    for r in runs:
        if r["rc"]:
            rows.append((r["name"], f"FAILED rc {r['rc']} (see {r['name']}.log)"))
            continue
        parts = []
        for res in r["results"]:
            if "impl" in res:  # node_gpu.py
                parts.append(f"{res['impl']}: {res['tokens_per_s_per_gpu']:.0f} tok/s, "
                             f"{res['model_tflops_per_gpu']:.0f} TFLOPS, MFU {res.get('mfu')}, GPU {res['gpu_peak_gb']} GB")
            elif "plan" in res:  # plan_check.py
                p = res["plan"]
                parts.append(f"plan z{p['zero']} {p['offload']} r{p['offload_ratio']} mb{p['micro_batch']}x"
                             f"{p['grad_accum']} ac={p['activation_checkpointing']}: {res.get('model_tflops_per_gpu')}"
                             f" TFLOPS; GPU {res.get('gpu_peak_gb')} GB (pred {res['pred_gpu_gb']}, "
                             f"{res.get('gpu_err')}), host {res.get('host_peak_gb')} GB (pred {res['pred_host_gb']}, "
                             f"{res.get('host_err')})")
            elif "sync_vs_dd" in res:  # checkpoint_io.py
                parts.append(f"dd {res['dd']['gbps']:.2f} GB/s; sync/dd {res['sync_vs_dd']:.2f}; async write/dd "
                             f"{res['async_write_vs_dd']:.2f}; async blocking/sync {res['async_blocking_vs_sync']:.3f}")
        if not parts and r["table"]:
            parts.append(" ".join(r["table"][-3:]))
        rows.append((r["name"], "; ".join(parts) or "no RESULT line"))
    return rows


def markdown(runs: list[dict[str, Any]], skipped: list[str], argv: list[str]) -> str:
    gpu = "cpu"
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout.strip() or gpu
    except OSError:
        pass
    lines = [f"# bench/gpu_suite.py, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", "",
             f"Machine: {gpu}; {os.cpu_count()} cores; {platform.platform()}.",
             f"Command: `python bench/gpu_suite.py {' '.join(argv)}`", "", "| case | rc | s | figures |",
             "|---|---|---|---|"]
    for (name, text), r in zip(summary_rows(runs), runs, strict=True):
        lines.append(f"| {name} | {r['rc']} | {r['wall_s']} | {text} |")
    lines += [f"| {s} | - | - | not run: budget spent |" for s in skipped]
    for r in runs:
        if r["table"]:
            lines += ["", f"{r['name']}:", "", *r["table"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of case names (default: all, in order)")
    ap.add_argument("--budget-s", type=float, default=540, help="start no case after this many seconds")
    ap.add_argument("--case-timeout", type=float, default=240)
    ap.add_argument("--cpu", action="store_true", help="tiny models on the CPU: a smoke test of the suite")
    ap.add_argument("--out", default="/tmp/hpctrain-gpu-suite")
    ap.add_argument("--md", default="", help="write the report here too (e.g. $OUT/BENCHMARKS-run.md)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [c for c in a.only.split(",") if c]
    todo = [(n, argv) for n, argv in cases(a.cpu) if not wanted or n in wanted]
    t0 = time.time()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name, argv in todo:
        if time.time() - t0 > a.budget_s:
            skipped.append(name)
            continue
        runs.append(run_one(name, argv, out, max(a.case_timeout, CASE_TIMEOUT.get(name, 0.0))))
        print(f"{name}: rc {runs[-1]['rc']} in {runs[-1]['wall_s']} s", flush=True)
    report = markdown(runs, skipped, sys.argv[1:])
    (out / "suite.json").write_text(json.dumps(runs, indent=1))
    (out / "BENCHMARKS-run.md").write_text(report)
    if a.md:
        Path(a.md).write_text(report)
    print(report, flush=True)


if __name__ == "__main__":
    main()
