"""Multi-GPU scaling of the node entrypoint on one host: tokens/s per GPU at 1, 2, 4 (, 8) GPUs.

Every case is a run folder rendered by hpctrain (spec.toml, plan.json, ds_config.json) started the way a
one-node SLURM allocation starts it (bench/gpu/runlib.py): `srun` = one process per GPU with srun's task
environment; `ds` = one task running DeepSpeed's runner on a `localhost slots=N` hostfile. Random-init
Llama presets, bf16, synthetic tokens, seq 4096. Scaling efficiency = tokens/s per GPU at N / at the
smallest N measured for that model and stage. The last case saves a checkpoint on N GPUs and resumes it
on N/2 (DeepSpeed universal checkpoint, converted by the node).

    source bench/gpu/setup.sh     # on the multi-GPU machine
    python bench/multi_gpu.py --out $OUT --budget-s 520
    python bench/multi_gpu.py --cpu --cases tiny:3:1:srun,tiny:3:2:srun,tiny:3:2:ds --resume tiny:3:2 --seq 64

Cases run one at a time, in the order given, until --budget-s is spent (the rest are reported as not run).
Prints a markdown table last; writes multi_gpu.json and the per-case logs/metrics to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import runlib

PRESET = {"1b": "llama-1b", "3b": "llama-3b", "8b": "llama-8b", "tiny": "llama-tiny", "10m": "llama-10m"}
DEFAULT_CASES = (
    "1b:3:1:srun:4,1b:2:1:srun:4,1b:2:2:srun:4,1b:3:2:srun:4,1b:2:2:ds:4,"
    "8b:3:2:srun:2,8b:3:4:srun:2,resume=1b:3:4,1b:2:4:srun:4"
)  # resume=M:Z:N: a run on N GPUs that saves a checkpoint, then its resume on N/2


def parse_case(text: str) -> dict[str, Any]:
    """model:zero:gpus:launcher[:micro_batch]"""
    parts = text.split(":")
    if len(parts) not in (4, 5) or parts[0] not in PRESET or parts[3] not in ("srun", "ds"):
        raise SystemExit(f"--cases: {text!r} is not model:zero:gpus:srun|ds[:mb] (models: {', '.join(PRESET)})")
    return {"model": parts[0], "zero": int(parts[1]), "gpus": int(parts[2]), "launcher": parts[3],
            "mb": int(parts[4]) if len(parts) == 5 else 0}


def run_case(a: argparse.Namespace, case: dict[str, Any], out: Path, *, ckpt: bool = False,
             run: Path | None = None, steps: int | None = None) -> dict[str, Any]:
    tag = f"{case['model']}-z{case['zero']}-g{case['gpus']}-{case['launcher']}" + \
        ("-resume" if run else "-save" if ckpt else "")
    run = run or out / f"run-{tag}"
    if run.exists() and steps is None:
        shutil.rmtree(run)
    mb = case["mb"] or a.mb
    total = steps or (a.warmup + a.steps)
    tables = runlib.bench_tables(name=tag, model=PRESET[case["model"]], zero=case["zero"], gpus=case["gpus"], mb=mb,
                                 seq=a.seq, steps=total, ac=a.ac, cpu=a.cpu, ckpt_every=total if ckpt else 0)
    plan = runlib.write_run_folder(run, tables)
    log = out / f"{tag}.log"
    t0 = time.time()
    if case["launcher"] == "ds":
        rc = runlib.launch_deepspeed(run, case["gpus"], log, timeout=a.case_timeout, cpu=a.cpu)
    else:
        rc = runlib.launch_srun_style(run, case["gpus"], log, timeout=a.case_timeout, cpu=a.cpu)
    recs = runlib.read_metrics(run)
    if steps is not None:  # a resume: only the steps this run made
        recs = [r for r in recs if r["step"] > total - a.resume_steps]
    row = {"case": tag, **case, "mb": mb, "seq": a.seq, "ac": a.ac, "rc": rc, "wall_s": round(time.time() - t0, 1),
           "plan_gpu_gb": plan["memory"]["per_rank_gb"], **runlib.summarize(recs, case["gpus"], a.warmup)}
    if rc:
        row["error_tail"] = runlib.tail(log, 15)
    (out / f"{tag}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    print("RESULT " + json.dumps(row), flush=True)
    return row


def resume_half(a: argparse.Namespace, out: Path, rows: list[dict[str, Any]], spec: str) -> dict[str, Any] | None:
    """Save on N GPUs (the case itself, with a checkpoint at its last step), resume on N/2."""
    model, zero, n = spec.split(":")
    case = {"model": model, "zero": int(zero), "gpus": int(n), "launcher": "srun", "mb": 0}
    saved = run_case(a, case, out, ckpt=True)
    rows.append(saved)
    if saved["rc"]:
        return None
    run = out / f"run-{model}-z{zero}-g{n}-srun-save"
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    half = {**case, "gpus": int(n) // 2}
    row = run_case(a, half, out, run=run, steps=a.warmup + a.steps + a.resume_steps)
    log_text = (out / f"{model}-z{zero}-g{int(n) // 2}-srun-resume.log").read_text(errors="replace")
    row.update({"resumed_from": ckpts, "universal": "universal" in log_text,
                "loss_before": saved.get("last_loss"), "loss_after_first": row.get("first_loss")})
    print("RESUME " + json.dumps(row), flush=True)
    rows.append(row)
    return row


def table(rows: list[dict[str, Any]], skipped: list[str]) -> str:
    base: dict[tuple[str, int], tuple[int, float]] = {}  # (model, zero) -> (fewest GPUs, tokens/s per GPU)
    for r in rows:
        key = (r["model"], r["zero"])
        ok = not r["rc"] and r.get("tokens_per_s_per_gpu") and "resume" not in r["case"]
        if ok and (key not in base or r["gpus"] < base[key][0]):
            base[key] = (r["gpus"], r["tokens_per_s_per_gpu"])
    lines = [("| case | GPUs | launcher | mb | tokens/s per GPU | scaling vs fewest GPUs | model TFLOPS/GPU | MFU | "
              "GPU peak GB (plan) | step s | first/last loss | rc |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get((r["model"], r["zero"]))
        eff = f"{r['tokens_per_s_per_gpu'] / b[1]:.1%} of {b[0]}" if b and r.get("tokens_per_s_per_gpu") else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        lines.append(f"| {r['case']} | {r['gpus']} | {r['launcher']} | {r['mb']} | {r.get('tokens_per_s_per_gpu')} | "
                     f"{eff} | {r.get('model_tflops_per_gpu')} | {mfu} | {r.get('gpu_peak_gb')} ({r['plan_gpu_gb']}) | "
                     f"{r.get('step_s')} | {r.get('first_loss')}/{r.get('last_loss')} | {r['rc']} |")
    lines += [f"| {s} | not run: budget spent | | | | | | | | | | |" for s in skipped]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help="comma list of model:zero:gpus:srun|ds[:mb], "
                    "or resume=model:zero:N (save on N, resume on N/2)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="measured steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--resume-steps", type=int, default=3)
    ap.add_argument("--ac", default="true", choices=["true", "false", "auto"], help="activation checkpointing")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (gloo): a smoke test of this script")
    ap.add_argument("--case-timeout", type=float, default=240)
    ap.add_argument("--budget-s", type=float, default=520, help="stop starting cases after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-multi-gpu"))
    a = ap.parse_args()
    a.ac = {"true": True, "false": False}.get(a.ac, a.ac)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    cases = [c for c in a.cases.split(",") if c]
    for c in cases:  # checked before the runs start: a typo costs no device time
        if not c.startswith("resume="):
            parse_case(c)
    for c in cases:
        if time.time() - t0 > a.budget_s:
            skipped.append(c)
        elif c.startswith("resume="):
            resume_half(a, out, rows, c.removeprefix("resume="))
        else:
            rows.append(run_case(a, parse_case(c), out))
    env = dict(runlib.NVLS_OFF)  # set in every rank's environment by runlib
    (out / "multi_gpu.json").write_text(json.dumps({"rows": rows, "skipped": skipped, "env": env,
                                                     "wall_s": round(time.time() - t0, 1)}, indent=1))
    print("\nNCCL/NVLS settings in every process: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print(table(rows, skipped), flush=True)


if __name__ == "__main__":
    main()
