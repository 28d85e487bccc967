"""torch's scaled_dot_product_attention backends, one at a time, at the Llama shapes hpctrain trains (causal,
bf16, seq 4096): forward+backward time, TFLOPS and the largest difference from the flash backend.

transformers' "sdpa" attention calls torch's SDPA with enable_gqa=True when there is no mask (the grouped key
and value heads are not repeated); with a mask it repeats them. Both calls are timed. The node's
`[model] attention = "auto"` orders the backends by what this probe measures (hpctrain.node.model.attention).

    source bench/gpu/setup.sh
    python bench/gpu/sdpa_probe.py --out $OUT

Prints one `RESULT {json}` line per (shape, call, backend) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

# (name, query heads, key/value heads, head dim, micro-batch): Llama 3.2 1B / 3B, Llama 3.1 8B.
SHAPES = [("llama-1b", 32, 8, 64, 4), ("llama-3b", 24, 8, 128, 2), ("llama-8b", 32, 8, 128, 2)]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def one(shape: tuple[str, int, int, int, int], seq: int, backend: str, gqa: bool, reps: int,
        ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    name, hq, hkv, d, b = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, seq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    kv_heads = hkv if gqa else hq
    k = torch.randn(b, kv_heads, seq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(b, kv_heads, seq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(b, hq, seq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    row: dict[str, Any] = {"shape": name, "call": "enable_gqa" if gqa else "repeated kv", "backend": backend,
                           "batch": b, "seq": seq}

    def step() -> torch.Tensor:
        with sdpa_kernel([BACKENDS[backend]]):
            out = sdpa(q, k, v, is_causal=True, **({"enable_gqa": True} if gqa else {}))
            out.backward(dout)
        return out

    try:
        out = step()
    except RuntimeError as exc:
        row["error"] = str(exc).splitlines()[0][:200]
        return row
    key = f"{name}-{gqa}"
    if key in ref:
        row["max_abs_diff_vs_flash"] = float((out.float() - ref[key]).abs().max())
    else:
        ref[key] = out.detach().float()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    # causal attention FLOPs: 4 b h s^2 d / 2 forward, x 2.5 for forward + backward (the backward does 2x)
    flops = 4 * b * hq * seq * seq * d / 2 * 3.5
    row.update({"fwd_bwd_ms": round(s * 1e3, 3), "tflops": round(flops / s / 1e12, 1)})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sdpa-probe"))
    a = ap.parse_args()
    rows = []
    ref: dict[str, torch.Tensor] = {}
    for shape in SHAPES:
        for gqa in (True, False):
            for backend in BACKENDS:  # flash first: the reference output
                rows.append(one(shape, a.seq, backend, gqa, a.reps, ref))
                print("RESULT " + json.dumps(rows[-1]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "sdpa_probe.json").write_text(json.dumps(rows, indent=1))
    print("| shape | call | backend | fwd+bwd ms | TFLOPS | max diff vs flash |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['call']} | {r['backend']} | {r.get('fwd_bwd_ms', '-')} | {r.get('tflops', '-')} | "
              f"{r.get('max_abs_diff_vs_flash', r.get('error', '-'))} |")


if __name__ == "__main__":
    main()
