"""Side by side on one GPU: hpctrain's node entrypoint vs the plain DeepSpeed loop (bench/gpu/plain_ds.py).

Same model (random-init Llama preset), sequence length, micro-batch x accumulation, ZeRO stage, activation
checkpointing and offload. The entrypoint runs exactly as in production: a run folder with spec.toml and
the ds_config.json that `hpctrain.render.sbatch` writes, started as one rank (`python -m hpctrain.node RUN`).
Any of --zero, --mb/--accum (with --global-batch), --offload-ratio and --ac may be `auto`/0: the planner
chooses them (its plan.json is in the run folder), and the plain loop then runs at the planner's choice.
Both report the median step over the steps after a warm-up; tokens/s per GPU and model TFLOPS use the
same FLOP formula (6·N + 12·L·H·S per token).

    source bench/gpu/setup.sh      # on the H200 machine
    python bench/node_gpu.py --model llama-1b --zero 3 --mb 4 --seq 4096 --out $OUT
    python bench/node_gpu.py --model llama-8b --zero auto --offload auto --offload-ratio auto --ac auto \
        --global-batch 16 --out $OUT          # the planner's choice, then plain DeepSpeed at it
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

GIB = 1024**3


def run_plain(a: argparse.Namespace, chosen: dict[str, Any], log: Path) -> dict[str, Any]:
    """The plain loop at the settings the entrypoint's plan resolved (the planner's choice where auto)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_port()), str(ROOT / "bench" / "gpu" / "plain_ds.py"), "--model", a.model,
           "--zero", str(chosen["zero"]), "--mb", str(chosen["mb"]), "--accum", str(chosen["accum"]),
           "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--offload", chosen["offload"], "--ratio", str(chosen["ratio"]), "--torch-adam"]
    cmd += [] if chosen["ac"] else ["--no-ac"]
    cmd += ["--sdpa-first", a.plain_sdpa_first] if a.plain_sdpa_first else []
    env = {**os.environ, **({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if a.plain_expandable else {})}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False, env=env)
    log.write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"plain loop failed (rc {proc.returncode}); see {log}")
    res = dict(json.loads(lines[-1][7:]))
    res.update({"wall_s": round(time.time() - t0, 1), "chosen": chosen})
    return res


def _auto(value: str) -> Any:
    """'auto' stays a string; numbers become numbers; true/false become booleans."""
    low = value.lower()
    if low == "auto":
        return "auto"
    if low in ("true", "false"):
        return low == "true"
    return float(value) if "." in value else int(value)


def make_run_folder(a: argparse.Namespace, run: Path) -> dict[str, Any]:
    """spec.toml + plan.json + ds_config.json, rendered by hpctrain itself (bench/gpu/runlib.py); returns the plan."""
    ac = _auto(a.ac) if a.ac else not a.no_ac
    tables = runlib.bench_tables(name="bench", model=a.model, zero=_auto(a.zero), gpus=1, mb=a.mb, seq=a.seq,
                                 steps=a.warmup + a.steps, offload=a.offload, ac=ac, cpu=a.cpu,
                                 peak_tflops=a.peak_tflops,
                                 extra={"model": {"attention": a.attention}} if a.attention else None)
    tables["train"].update({"grad_accum": a.accum, "global_batch": a.global_batch})
    if a.offload != "none" or a.zero == "auto":
        tables["parallel"]["offload_ratio"] = _auto(a.offload_ratio)
    if not a.cpu:
        tables["resources"].update({"mem": a.host_mem, "cpus_per_task": os.cpu_count() or 1})
    # --persist: one rank holds every parameter anyway, so ZeRO-3's per-layer gather/release can be skipped.
    zero = {"stage3_param_persistence_threshold": 10**12} if a.persist else {}
    # --zero-json: a bucket variant under test, merged into the rendered zero_optimization block.
    zero.update(json.loads(a.zero_json) if a.zero_json else {})
    return runlib.write_run_folder(run, tables, zero_overrides=zero or None)


def chosen_of(plan: dict[str, Any]) -> dict[str, Any]:
    """The settings a plan resolved, as the plain loop takes them."""
    offload = str(plan["offload"])
    return {"zero": int(plan["zero_stage"]), "offload": "optimizer" if offload in ("optimizer", "all") else "none",
            "ratio": float(plan.get("offload_ratio") or 1.0), "mb": int(plan["micro_batch"]),
            "accum": int(plan["grad_accum"]), "ac": bool(plan.get("activation_checkpointing"))}


def predicted(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan's predictions, in the units measured: GPU GB less the CUDA context, host GB, step s."""
    mem = plan["memory"]
    runtime_gib = float(mem["breakdown"].get("runtime", 0.0))
    return {"pred_gpu_gb": round((float(mem["per_rank_gb"]) - runtime_gib) * GIB / 1e9, 1),
            "pred_host_gb": round(float(mem["per_host_gb"]) * GIB / 1e9, 1),
            "pred_step_s": plan.get("predicted_step_s")}


def run_entry(a: argparse.Namespace, run: Path, plan: dict[str, Any], log: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_port()), "-m", "hpctrain.node", str(run)]
    env = {**os.environ, **({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} if a.cpu else {})}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False, env=env)
    log.write_text(proc.stdout + proc.stderr)
    recs = runlib.read_metrics(run)
    if proc.returncode or len(recs) <= a.warmup:
        raise SystemExit(f"entrypoint failed (rc {proc.returncode}); see {log}")
    (log.with_suffix(".metrics.jsonl")).write_text((run / "metrics" / "metrics.jsonl").read_text())
    steady = recs[a.warmup:]
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    text = log.read_text(errors="replace")
    # What the node logged about the ZeRO-3 offload step fix (hpctrain.node.model.zero_offload) and attention.
    fix = [ln.split("step fix: ", 1)[1] for ln in text.splitlines() if "step fix: " in ln]
    attn = [ln.split("attention: ", 1)[1] for ln in text.splitlines() if "attention: " in ln]
    got = {"impl": "hpctrain-node", "model": a.model, "tokens_per_s_per_gpu": round(tps, 1),
           "model_tflops_per_gpu": round(statistics.median(r["tflops"] for r in steady), 1),
           "mfu": round(statistics.median(r["mfu"] for r in steady), 3) if steady[0]["mfu"] is not None else None,
           "gpu_peak_gb": round(max(r["gpu_mem_gb"] for r in recs), 1),
           "host_rss_gb": round(max(r["host_mem_gb"] for r in recs), 1),
           "host_peak_gb": round(max(float(r.get("host_peak_gb") or 0.0) for r in recs), 1),
           "first_loss": round(recs[0]["loss"], 3), "last_loss": round(recs[-1]["loss"], 3),
           "step_s": round(statistics.median(r["tokens"] / r["tokens_per_s"] for r in steady), 4),
           "zero3_offload_fix": fix[-1] if fix else "", "attention": attn[-1] if attn else "",
           "chosen": chosen_of(plan), **predicted(plan), "wall_s": round(time.time() - t0, 1)}
    got["host_err"] = round(got["pred_host_gb"] / got["host_peak_gb"] - 1, 3) if got["host_peak_gb"] else None
    got["gpu_err"] = round(got["pred_gpu_gb"] / got["gpu_peak_gb"] - 1, 3) if got["gpu_peak_gb"] else None
    if got["pred_step_s"]:
        got["step_err"] = round(float(got["pred_step_s"]) / got["step_s"] - 1, 3)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--zero", default="3", help="0-3 or auto")
    ap.add_argument("--mb", type=int, default=None,
                    help="micro-batch (default 4; with --global-batch alone: the planner's)")
    ap.add_argument("--accum", type=int, default=None,
                    help="gradient accumulation (default 1; with --global-batch alone: the planner's)")
    ap.add_argument("--global-batch", type=int, default=0)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--offload", default="none", choices=["none", "optimizer"])
    ap.add_argument("--offload-ratio", default="1.0",
                    help="ZeRO-3 optimizer offload: fraction of the optimizer state on the CPU (1 = all), or auto")
    ap.add_argument("--ac", default="", choices=["", "true", "false", "auto"],
                    help="activation checkpointing (default: on unless --no-ac)")
    ap.add_argument("--attention", default="", help="[model] attention of the entrypoint (default: the spec's)")
    ap.add_argument("--plain-sdpa-first", default="", help="the plain loop's SDPA backend first (an A/B)")
    ap.add_argument("--plain-expandable", action="store_true",
                    help="the plain loop with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the node's default)")
    ap.add_argument("--host-mem", default="125G", help="the host's RAM as SLURM --mem (the H200 machine: 125G)")
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
    # --global-batch alone: the planner splits it (0 = its choice); otherwise micro-batch 4 without accumulation.
    a.mb = a.mb if a.mb is not None else (0 if a.global_batch else 4)
    a.accum = a.accum if a.accum is not None else (0 if a.global_batch else 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ratio = a.offload_ratio if a.offload_ratio == "auto" else (f"{float(a.offload_ratio):g}"
                                                               if float(a.offload_ratio) < 1 else "")
    tag = (f"{a.model}-z{a.zero}-{a.offload}{ratio}-mb{a.mb or 'auto'}x{a.accum or 'auto'}-s{a.seq}"
           + ("-noac" if a.no_ac else f"-ac{a.ac}" if a.ac else "") + ("-persist" if a.persist else "")
           + (f"-{a.attention}" if a.attention else "") + (f"-{a.tag}" if a.tag else ""))
    run = out / f"run-{tag}"
    plan = make_run_folder(a, run)  # also for --only plain: the planner's choice is what the plain loop runs
    rows = []
    if a.only in ("entry", "both"):
        rows.append(run_entry(a, run, plan, out / f"entry-{tag}.log"))
        print("RESULT " + json.dumps(rows[-1]), flush=True)
    if a.only in ("plain", "both"):
        rows.append(run_plain(a, chosen_of(plan), out / f"plain-{tag}.log"))
        print("RESULT " + json.dumps(rows[-1]), flush=True)
    if len(rows) == 2:
        ratio_x = rows[0]["tokens_per_s_per_gpu"] / rows[1]["tokens_per_s_per_gpu"]
        print(f"| {tag} | entry {rows[0]['tokens_per_s_per_gpu']:.0f} tok/s | plain "
              f"{rows[1]['tokens_per_s_per_gpu']:.0f} tok/s | ratio {ratio_x:.3f} |", flush=True)
    (out / f"bench-{tag}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
