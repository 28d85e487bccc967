"""Side by side on one GPU: hpctrain's node entrypoint vs the plain DeepSpeed loop (bench/gpu/plain_ds.py).

Same model (random-init Llama preset), sequence length, micro-batch, ZeRO stage, activation
checkpointing and offload. The entrypoint runs exactly as in production: a run folder with spec.toml and
the ds_config.json that `hpctrain.render.sbatch` writes, started as one rank (`python -m hpctrain.node RUN`).
Both report the median step over the steps after a warm-up; tokens/s per GPU and model TFLOPS use the
same FLOP formula (6·N + 12·L·H·S per token).

    source bench/gpu/setup.sh      # on the H200 machine
    python bench/node_gpu.py --model llama-1b --zero 3 --mb 4 --seq 4096 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "toolkit"))
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import runlib

from hpctrain.node.dist import free_port


def run_plain(a: argparse.Namespace, log: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_port()), str(ROOT / "bench" / "gpu" / "plain_ds.py"), "--model", a.model, "--zero", str(a.zero),
           "--mb", str(a.mb), "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--offload", a.offload, "--ratio", str(a.offload_ratio), "--torch-adam"] + (["--no-ac"] if a.no_ac else [])
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False)
    log.write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"plain loop failed (rc {proc.returncode}); see {log}")
    res = dict(json.loads(lines[-1][7:]))
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def make_run_folder(a: argparse.Namespace, run: Path) -> None:
    """spec.toml + plan.json + ds_config.json, rendered by hpctrain itself (bench/gpu/runlib.py)."""
    tables = runlib.bench_tables(name="bench", model=a.model, zero=a.zero, gpus=1, mb=a.mb, seq=a.seq,
                                 steps=a.warmup + a.steps, offload=a.offload, ac=not a.no_ac, cpu=a.cpu,
                                 peak_tflops=a.peak_tflops, extra={"parallel": {"offload_ratio": a.offload_ratio}})
    # --persist: one rank holds every parameter anyway, so ZeRO-3's per-layer gather/release can be skipped.
    zero = {"stage3_param_persistence_threshold": 10**12} if a.persist else {}
    # --zero-json: a bucket variant under test, merged into the rendered zero_optimization block.
    zero.update(json.loads(a.zero_json) if a.zero_json else {})
    runlib.write_run_folder(run, tables, zero_overrides=zero or None)


def run_entry(a: argparse.Namespace, run: Path, log: Path) -> dict[str, Any]:
    make_run_folder(a, run)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_port()), "-m", "hpctrain.node", str(run)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False)
    log.write_text(proc.stdout + proc.stderr)
    recs = runlib.read_metrics(run)
    if proc.returncode or len(recs) <= a.warmup:
        raise SystemExit(f"entrypoint failed (rc {proc.returncode}); see {log}")
    (log.with_suffix(".metrics.jsonl")).write_text((run / "metrics" / "metrics.jsonl").read_text())
    steady = recs[a.warmup:]
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    # What the node logged about the ZeRO-3 offload step fix (hpctrain.node.zero_offload), if anything.
    fix = [ln.split("step fix: ", 1)[1] for ln in log.read_text(errors="replace").splitlines() if "step fix: " in ln]
    return {"impl": "hpctrain-node", "model": a.model, "tokens_per_s_per_gpu": round(tps, 1),
            "model_tflops_per_gpu": round(statistics.median(r["tflops"] for r in steady), 1),
            "mfu": round(statistics.median(r["mfu"] for r in steady), 3) if steady[0]["mfu"] is not None else None,
            "gpu_peak_gb": round(max(r["gpu_mem_gb"] for r in recs), 1),
            "host_rss_gb": round(max(r["host_mem_gb"] for r in recs), 1),
            "first_loss": round(recs[0]["loss"], 3), "last_loss": round(recs[-1]["loss"], 3),
            "step_s": round(statistics.median(r["tokens"] / r["tokens_per_s"] for r in steady), 4),
            "zero3_offload_fix": fix[-1] if fix else "", "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--offload", default="none", choices=["none", "optimizer"])
    ap.add_argument("--offload-ratio", type=float, default=1.0,
                    help="ZeRO-3 optimizer offload: fraction of the optimizer state on the CPU (1 = all)")
    ap.add_argument("--peak-tflops", type=float, default=788.0, help="measured bf16 matmul peak (H200: 788)")
    ap.add_argument("--no-ac", action="store_true", help="no activation checkpointing (both loops)")
    ap.add_argument("--persist", action="store_true", help="ZeRO-3 persistence threshold 1e12 (entrypoint only)")
    ap.add_argument("--zero-json", default="", help="JSON merged into the entrypoint's zero_optimization block")
    ap.add_argument("--tag", default="", help="suffix of this run's file names (a variant's name)")
    ap.add_argument("--only", choices=["plain", "entry", "both"], default="both")
    ap.add_argument("--cpu", action="store_true", help="a CPU rank (smoke test of this script; entry only)")
    ap.add_argument("--timeout", type=float, default=280)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-node"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.model}-z{a.zero}-{a.offload}" + (f"{a.offload_ratio:g}" if a.offload_ratio < 1 else "") + \
        f"-mb{a.mb}-s{a.seq}" + ("-noac" if a.no_ac else "") + \
        ("-persist" if a.persist else "") + (f"-{a.tag}" if a.tag else "")
    rows = []
    if a.only in ("entry", "both"):
        rows.append(run_entry(a, out / f"run-{tag}", out / f"entry-{tag}.log"))
        print("RESULT " + json.dumps(rows[-1]), flush=True)
    if a.only in ("plain", "both"):
        rows.append(run_plain(a, out / f"plain-{tag}.log"))
        print("RESULT " + json.dumps(rows[-1]), flush=True)
    if len(rows) == 2:
        ratio = rows[0]["tokens_per_s_per_gpu"] / rows[1]["tokens_per_s_per_gpu"]
        print(f"| {tag} | entry {rows[0]['tokens_per_s_per_gpu']:.0f} tok/s | plain "
              f"{rows[1]['tokens_per_s_per_gpu']:.0f} tok/s | ratio {ratio:.3f} |", flush=True)
    (out / f"bench-{tag}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
