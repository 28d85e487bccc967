"""Planner accuracy and the planner's own choice, on one GPU: plan a run, train it, compare.

The run folder is what `hpctrain submit` writes (spec.toml, plan.json, ds_config.json); the node
entrypoint trains it as one srun-style task (bench/gpu/runlib.py). Printed as `RESULT {json}`:
the plan's choices (ZeRO stage, offload ratio, micro-batch x accumulation, activation checkpointing),
its predicted peak GPU memory (less the CUDA-context term, which torch's max_memory_allocated does not
see) and host memory, and the measured peaks, tokens/s, model TFLOPS and MFU (median after --warmup).

    source bench/gpu/setup.sh
    python bench/plan_check.py --model llama-8b --offload optimizer --ratio auto --global-batch 16 --ac auto
    python bench/plan_check.py --model llama-3b --offload optimizer --mb 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import runlib

GIB = 1024**3


def tables(a: argparse.Namespace) -> dict[str, Any]:
    ac: bool | str = {"true": True, "false": False}.get(a.ac, a.ac)
    t = runlib.bench_tables(name=a.name or a.model, model=a.model, zero=a.zero, gpus=1, mb=a.mb, seq=a.seq,
                            steps=a.warmup + a.steps, offload=a.offload, ac=ac, cpu=a.cpu)
    t["train"].update({"grad_accum": a.accum, "global_batch": a.global_batch})
    if a.offload != "none":
        t["parallel"]["offload_ratio"] = a.ratio if a.ratio == "auto" else float(a.ratio)
    t["resources"]["mem"] = a.host_mem
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--name", default="")
    ap.add_argument("--zero", default="3")
    ap.add_argument("--offload", default="none", choices=["none", "optimizer"])
    ap.add_argument("--ratio", default="1.0", help="offload ratio, or auto")
    ap.add_argument("--mb", type=int, default=0, help="micro-batch (0 = the planner picks from --global-batch)")
    ap.add_argument("--accum", type=int, default=0)
    ap.add_argument("--global-batch", type=int, default=0)
    ap.add_argument("--ac", default="true", choices=["true", "false", "auto"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--host-mem", default="125G", help="the host's RAM as SLURM --mem (the H200 machine: 125G)")
    ap.add_argument("--cpu", action="store_true", help="CPU rank (smoke test)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-plan"))
    a = ap.parse_args()
    a.zero = a.zero if a.zero == "auto" else int(a.zero)
    if a.mb == 0 and a.global_batch == 0:
        a.mb = 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = a.name or f"{a.model}-z{a.zero}-{a.offload}{a.ratio if a.offload != 'none' else ''}-ac{a.ac}"
    run = out / f"run-{tag}"
    plan = runlib.write_run_folder(run, tables(a))
    mem = plan["memory"]
    t0 = time.time()
    rc = runlib.launch_srun_style(run, 1, out / f"{tag}.log", timeout=a.timeout, cpu=a.cpu)
    recs = runlib.read_metrics(run)
    got = runlib.summarize(recs, 1, a.warmup)
    runtime_gib = float(mem["breakdown"].get("runtime", 0.0))
    pred_gpu = (float(mem["per_rank_gb"]) - runtime_gib) * GIB / 1e9
    pred_host = float(mem["per_host_gb"]) * GIB / 1e9
    row = {
        "case": tag, "rc": rc, "wall_s": round(time.time() - t0, 1),
        "plan": {"zero": plan["zero_stage"], "offload": plan["offload"],
                 "offload_ratio": plan.get("offload_ratio"), "micro_batch": plan["micro_batch"],
                 "grad_accum": plan["grad_accum"], "activation_checkpointing": plan.get("activation_checkpointing"),
                 "fits": mem.get("fits")},
        "pred_gpu_gb": round(pred_gpu, 1), "pred_host_gb": round(pred_host, 1), **got,
    }
    if got.get("gpu_peak_gb"):
        row["gpu_err"] = round(pred_gpu / got["gpu_peak_gb"] - 1, 3)
    if got.get("host_peak_gb"):
        row["host_err"] = round(pred_host / got["host_peak_gb"] - 1, 3)
    if rc:
        row["error_tail"] = runlib.tail(out / f"{tag}.log", 12)
    (out / f"{tag}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    print("RESULT " + json.dumps(row), flush=True)
    sys.exit(1 if rc else 0)


if __name__ == "__main__":
    main()
