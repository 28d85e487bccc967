"""Issue 18 goal 3: the ZeRO optimizer-offload step against the sum of its parts, on one GPU, in one call.

1. `--parts` (one process): the parts of a 3B step measured alone. Forward+backward of the bf16 model at the
   case's micro-batch (activation checkpointing, no DeepSpeed); DeepSpeedCPUAdam over all parameters in
   fp32, in sub-groups of 1e9 like ZeRO-3, with this process's threads; the copies at their pinned pace
   (fp32 gradients GPU -> host, bf16 parameters host -> GPU). Beside them, the two pieces of DeepSpeed's
   ZeRO-3 step that are neither (found in stage3.py): the blocking fp32 -> bf16 copy-back from pageable
   memory, and the multiply of every CPU gradient by the combined scale; and hpctrain.node.model.zero_offload's
   copy-backs (the pinned, chunked one; the default one, cast on the GPU from the page-locked master).
2. `--breakdown V` (after the runs): the plain loop (bench/gpu/plain_ds.py --breakdown) once per variant, timing
   forward, backward, step and the step's pieces between synchronisations (not a baseline).
3. `--variants` (before the breakdowns): the entrypoint and the plain loop in alternating fresh processes
   (bench/node_gpu.py --only entry|plain), rounds rotating the order; medians and ratios at the end.

Rows go to OUT/rows.jsonl as they come, the table to OUT/table.md. Stops starting runs past --budget seconds.

    source bench/gpu/setup.sh
    python bench/gpu/offload_parts.py --parts --breakdown z3,z3fix --variants entry3,plain3,entry2,plain2 \
        --rounds 1 --out $OUT
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

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"

# node_gpu.py arguments (and extra environment) of each variant; every one: seq 4096, activation checkpointing.
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "entry3": (["--only", "entry", "--zero", "3", "--offload", "optimizer"], {}),
    "entry3nofix": (["--only", "entry", "--zero", "3", "--offload", "optimizer"], {"HPCTRAIN_ZERO3_OFFLOAD_FIX": "0"}),
    "plain3": (["--only", "plain", "--zero", "3", "--offload", "optimizer"], {}),
    "entry2": (["--only", "entry", "--zero", "2", "--offload", "optimizer"], {}),
    "plain2": (["--only", "plain", "--zero", "2", "--offload", "optimizer"], {}),
    "entry1": (["--only", "entry", "--zero", "1", "--offload", "optimizer"], {}),
    "plain1": (["--only", "plain", "--zero", "1", "--offload", "optimizer"], {}),
}
# plain_ds.py --breakdown arguments of each breakdown variant.
BREAKDOWNS: dict[str, list[str]] = {
    "z3": ["--zero", "3", "--offload", "optimizer"],
    "z3fix": ["--zero", "3", "--offload", "optimizer", "--zero3-offload-fix"],
    "z2": ["--zero", "2", "--offload", "optimizer"],
}


# ------------------------------------------------------------------------------------------ the parts alone
def _timed(fn: Any, sync: Any, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs after one warm-up run."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def parts(a: argparse.Namespace) -> dict[str, Any]:
    """Every part alone, each in its own function so that its buffers are freed before the next."""
    import torch

    res: dict[str, Any] = {"kind": "parts", "model": a.model, "mb": a.mb, "seq": a.seq,
                           "torch_threads": torch.get_num_threads(),
                           "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
                           "cpus": len(os.sched_getaffinity(0))}
    res.update(_fwd_bwd_part(a))
    torch.cuda.empty_cache()
    _emit(a, res)
    res.update(_copy_parts(int(res["params"])))
    torch.cuda.empty_cache()
    _emit(a, res)
    res.update(_adam_part(int(res["params"])))
    res["sum_of_parts_s"] = round(res["fwd_bwd_s"] + res["cpu_adam_s"] + res["grads_d2h_fp32_pinned_s"]
                                  + res["params_h2d_bf16_pinned_s"], 4)
    return res


def _fwd_bwd_part(a: argparse.Namespace) -> dict[str, Any]:
    """Forward+backward of the bf16 model on the GPU, activation checkpointing, no DeepSpeed."""
    import torch
    from plain_ds import SHAPES
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=a.seq, **SHAPES[a.model])
    with torch.device("cuda"):  # initialised on the GPU: HF's init of 3 B parameters on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    x = torch.randint(0, cfg.vocab_size, (a.mb, a.seq), device="cuda")

    def fwd_bwd() -> None:
        model(input_ids=x, labels=x).loss.backward()
        for p in model.parameters():
            p.grad = None

    return {"params": sum(p.numel() for p in model.parameters()),
            "fwd_bwd_s": round(_timed(fwd_bwd, torch.cuda.synchronize, 3), 4)}


def _spans(n: int) -> list[tuple[int, int]]:
    """(start, length) of ZeRO-3's optimizer sub-groups of 1e9 elements (one rank holds every parameter)."""
    group = 10**9
    return [(s, min(group, n - s)) for s in range(0, n, group)]


def _copy_parts(n: int) -> dict[str, Any]:
    """The copies at the pinned pace, DeepSpeed's copy-back from pageable memory, the fix's copy-back, and
    the CPU multiply of every gradient (unscale_and_clip_grads)."""
    import torch

    from hpctrain.node.model.pinned import pin_in_place
    from hpctrain.node.model.zero_offload import DeviceCast, PinnedStager

    sync = torch.cuda.synchronize
    gpu32 = torch.empty(n, dtype=torch.float32, device="cuda")
    gpu16 = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    host32 = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host16 = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    res = {"grads_d2h_fp32_pinned_s": round(_timed(lambda: host32.copy_(gpu32, non_blocking=True), sync, 3), 4),
           "params_h2d_bf16_pinned_s": round(_timed(lambda: gpu16.copy_(host16, non_blocking=True), sync, 3), 4),
           "params_h2d_fp32_pinned_s": round(_timed(lambda: gpu32.copy_(host32, non_blocking=True), sync, 3), 4)}
    host32 = host16 = torch.empty(0)  # free the pinned buffers before the pageable master is allocated
    # Pageable, as ZeRO-3 keeps the CPU master weights (filled, not randn: torch's CPU randn is serial).
    master = torch.full((n,), 0.01, dtype=torch.float32)
    master[: 1 << 24] = torch.randn(1 << 24)  # varied values where the copy is checked bit for bit
    spans = _spans(n)

    def ds_copy_back() -> None:  # stage3._reassign_or_swap_out_partitioned_parameters, one sub-group at a time
        for s, m in spans:
            gpu16[s:s + m].copy_(master[s:s + m])

    res["ds_copy_back_pageable_s"] = round(_timed(ds_copy_back, sync, 2), 4)
    expect = gpu16[: 1 << 24].clone()
    stager = PinnedStager(torch.bfloat16)

    def fixed_copy_back() -> None:
        for s, m in spans:
            stager.copy(gpu16[s:s + m], master[s:s + m])

    gpu16.zero_()
    res["fixed_copy_back_s"] = round(_timed(fixed_copy_back, sync, 3), 4)
    res["fixed_copy_back_bit_identical_first_16M"] = bool(torch.equal(gpu16[: 1 << 24], expect))
    # The default since 2026-12-02: the master page-locked in place, fp32 over PCIe, the cast on the GPU
    # (asynchronous in a step; timed here until its copies are done).
    t0 = time.perf_counter()
    res["device_cast_pinned_in_place"] = pin_in_place(master)
    res["pin_in_place_s"] = round(time.perf_counter() - t0, 3)
    caster = DeviceCast()

    def device_cast_copy_back() -> None:
        for s, m in spans:
            caster.copy(gpu16[s:s + m], master[s:s + m])
        caster.wait()

    gpu16.zero_()
    res["device_cast_copy_back_s"] = round(_timed(device_cast_copy_back, sync, 3), 4)
    res["device_cast_bit_identical_first_16M"] = bool(torch.equal(gpu16[: 1 << 24], expect))
    res["cpu_grad_mul_s"] = round(_timed(lambda: master.mul_(1.0), lambda: None, 3), 4)
    return res


def _adam_part(n: int) -> dict[str, Any]:
    """DeepSpeedCPUAdam over n fp32 parameters, one 1e9 sub-group per step() call as ZeRO-3 does."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    t0 = time.perf_counter()
    ps = [torch.nn.Parameter(torch.full((m,), 0.02, dtype=torch.float32)) for _, m in _spans(n)]
    for p in ps:
        p.grad = torch.full_like(p, 1e-3)
    alloc_s = round(time.perf_counter() - t0, 1)
    opt = DeepSpeedCPUAdam(ps, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, adamw_mode=True)

    def adam_step() -> None:
        for p in ps:
            opt.param_groups[0]["params"] = [p]
            opt.step()

    adam_s = _timed(adam_step, lambda: None, 3)
    return {"adam_alloc_s": alloc_s, "cpu_adam_s": round(adam_s, 4),
            "cpu_adam_gparams_per_s": round(n / adam_s / 1e9, 2)}


# ------------------------------------------------------------------------------------------ runs
def _emit(a: argparse.Namespace, row: dict[str, Any]) -> None:
    row = {**row, "utc": time.strftime("%H:%M:%S", time.gmtime())}
    print("ROW " + json.dumps(row), flush=True)
    with (Path(a.out) / "rows.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _sub(a: argparse.Namespace, cmd: list[str], env: dict[str, str], tag: str) -> dict[str, Any] | None:
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False,
                              env={**os.environ, **env}, cwd=str(ROOT))
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = str(exc.stdout or ""), str(exc.stderr or ""), 124
    lines = [x for x in out.splitlines() if x.startswith(("RESULT ", "ROW "))]
    if rc or not lines:
        with (Path(a.out) / "fail.log").open("a") as fh:
            fh.write(f"== {tag} rc {rc}\n{out[-3000:]}\n{err[-4000:]}\n")
        return None
    row = dict(json.loads(lines[-1].split(" ", 1)[1]))
    row["run_wall_s"] = round(time.time() - t0, 1)
    return row


def run_variant(a: argparse.Namespace, name: str, rnd: int) -> dict[str, Any] | None:
    args, env = VARIANTS[name]
    cmd = [sys.executable, str(ROOT / "bench" / "node_gpu.py"), "--model", a.model, "--mb", str(a.mb), "--seq",
           str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup), "--timeout", str(a.timeout - 20),
           "--out", f"{a.work}/{name}-{rnd}", "--tag", name, *args]
    row = _sub(a, cmd, env, f"{name} round {rnd}")
    if row is not None:
        row.update({"kind": "run", "variant": name, "round": rnd})
        tps = row["tokens_per_s_per_gpu"]
        row["step_s"] = row.get("step_s") or round(a.mb * a.seq / tps, 4)
    return row


def run_breakdown(a: argparse.Namespace, name: str) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29517",
           str(GPU / "plain_ds.py"), "--model", a.model, "--mb", str(a.mb), "--seq", str(a.seq), "--steps",
           str(a.steps), "--warmup", str(a.warmup), "--breakdown", *BREAKDOWNS[name]]
    row = _sub(a, cmd, {}, f"breakdown {name}")
    if row is not None:
        row.update({"kind": "breakdown", "variant": name})
    return row


def _steps(got: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['step_s']:.3f}" for r in got)


def table(rows: list[dict[str, Any]]) -> str:
    runs = [r for r in rows if r.get("kind") == "run"]
    med = {v: statistics.median(r["step_s"] for r in runs if r["variant"] == v) for v in {r["variant"] for r in runs}}
    part = next((r for r in rows if r.get("kind") == "parts" and "sum_of_parts_s" in r), None)
    out = ["| variant | n | median step s | steps (s) | tok/s | x plain same stage | x sum of parts |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in sorted(med):
        got = [r for r in runs if r["variant"] == v]
        stage = next((c for c in v if c.isdigit()), "")
        plain = med.get("plain" + stage) if v.startswith("entry") else None
        ratio = f"{plain / med[v]:.3f}" if plain else "-"  # speed ratio: plain's step over this one's
        parts_x = f"{med[v] / part['sum_of_parts_s']:.2f}" if part else "-"
        out.append(f"| {v} | {len(got)} | {med[v]:.3f} | {_steps(got)} | "
                   f"{statistics.median(r['tokens_per_s_per_gpu'] for r in got):.0f} | {ratio} | {parts_x} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3b")
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--parts", action="store_true", help="measure the parts alone first (a subprocess)")
    ap.add_argument("--parts-only", action="store_true", help=argparse.SUPPRESS)  # the subprocess itself
    ap.add_argument("--breakdown", default="", help=f"comma list of {sorted(BREAKDOWNS)}")
    ap.add_argument("--variants", default="", help=f"comma list of {sorted(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=200)
    ap.add_argument("--budget", type=float, default=540, help="start nothing past this many seconds")
    ap.add_argument("--est", type=float, default=60, help="expected seconds of one run (for the budget)")
    ap.add_argument("--work", default="/tmp/offload-parts")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    if a.parts_only:
        sys.path.insert(0, str(GPU))
        _emit(a, parts(a))
        return
    t_start = time.time()
    left = lambda: a.budget - (time.time() - t_start)
    if a.parts:
        row = _sub(a, [sys.executable, __file__, "--parts-only", "--model", a.model, "--mb", str(a.mb), "--seq",
                       str(a.seq), "--out", a.out], {}, "parts")
        print("parts:", json.dumps(row), flush=True)
    rows: list[dict[str, Any]] = []
    names = [v for v in a.variants.split(",") if v]
    for rnd in range(a.rounds):
        k = rnd % max(1, len(names))
        for v in names[k:] + names[:k]:
            if left() < a.est:
                print(f"budget: skipped {v} round {rnd}", flush=True)
                continue
            row = run_variant(a, v, rnd)
            print(f"{v} round {rnd}: " + (json.dumps(row) if row else "FAILED"), flush=True)
            if row:
                _emit(a, row)
    # The breakdowns last: they only say where a step's time goes, the runs above are the result.
    for name in filter(None, a.breakdown.split(",")):
        if left() < a.est:
            print(f"budget: skipped breakdown {name}", flush=True)
            continue
        row = run_breakdown(a, name)
        if row:
            _emit(a, row)
    rows = [json.loads(x) for x in (Path(a.out) / "rows.jsonl").read_text().splitlines()] \
        if (Path(a.out) / "rows.jsonl").exists() else []
    text = table(rows)
    (Path(a.out) / "table.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
