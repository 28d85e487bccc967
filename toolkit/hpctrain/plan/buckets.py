"""ZeRO-3 bucket sizes, prefetch and persistence: one small table by device kind and model size.

Read by the DeepSpeed config builder (hpctrain.render.deepspeed) and by the memory model
(hpctrain.plan.memory, which counts the reduce bucket), so the estimate and the config agree.

Why a table and not HF's "auto" rule (reduce h*h, prefetch 0.9*h*h, persistence 10*h): on GPU ranks the
rule's buckets are small (4.19 M / 3.77 M / 20,480 at h = 2048), so ZeRO-3 issues many small reduces and
gathers, and it measured slower than DeepSpeed's own defaults. Measured 2026-12-01 on one H200 (16 cores),
Llama-1B (1.24 B params) ZeRO-3, seq 4096, bf16, micro-batch 4 with activation checkpointing, alternating
runs, median tokens/s (raw rows: bench/results/gpu-2026-12-01/):

    python bench/gpu/bucket_sweep.py --case mb4 --variants h2,dsdef,big,plain --rounds 3 --out $OUT
    python bench/gpu/bucket_sweep.py --case mb6 --case mb4 --variants dsdef,plain --rounds 2 --out $OUT

    reduce / prefetch / persistence        entrypoint tok/s (n)   x plain DeepSpeed (32,551, n = 5)
    h*h rule: 4.19 M / 3.77 M / 20,480     31,829 (3)             0.978
    DeepSpeed defaults: 5e8 / 5e7 / 1e5    33,465 (4)             1.028   <- chosen
    5e8 / 5e8 / 1e6                        32,473 (3)             0.998
    (micro-batch 6, no checkpointing: defaults 45,531 (2) vs plain 45,706 (2): 0.996, within run-to-run noise)

The defaults' reduce bucket costs ~1 GB more GPU memory at 1B (47.4 vs 46.4 GB peak). Above 2 B parameters
the entrypoint has not been measured with these values; issue 18's plain DeepSpeed loop (DeepSpeed's
defaults) beat the entrypoint with the h*h rule at 3B with optimizer offload (0.95x) and at 8B (0.98x), so
the GPU rows agree. CPU ranks keep the h*h rule: the CPU tests train tiny models, where small buckets keep
the host memory of several ranks low.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Zero3Buckets:
    """The zero_optimization keys this table decides (elements, except persistence: parameters per tensor)."""

    reduce: int  # reduce_bucket_size
    prefetch: int  # stage3_prefetch_bucket_size
    persistence: int  # stage3_param_persistence_threshold


DEEPSPEED_DEFAULTS = Zero3Buckets(reduce=500_000_000, prefetch=50_000_000, persistence=100_000)

# (device, up to this many parameters, buckets), first match wins.
TABLE: tuple[tuple[str, float, Zero3Buckets | None], ...] = (
    ("gpu", 2e9, DEEPSPEED_DEFAULTS),  # measured at 1.24 B (above)
    ("gpu", float("inf"), DEEPSPEED_DEFAULTS),  # 3B / 8B: from plain DeepSpeed's lead in issue 18 (above)
    ("cpu", float("inf"), None),  # None: the h*h rule
)


def h2_rule(hidden: int) -> Zero3Buckets:
    """HF's "auto" values (transformers' deepspeed integration), for small CPU runs."""
    return Zero3Buckets(reduce=hidden * hidden, prefetch=int(0.9 * hidden * hidden), persistence=10 * hidden)


def zero3_buckets(device: str, params: int, hidden: int) -> Zero3Buckets:
    """The row of TABLE for this device kind ("gpu"/"cpu") and parameter count."""
    for dev, up_to, buckets in TABLE:
        if dev == device and params <= up_to:
            return buckets or h2_rule(hidden)
    return h2_rule(hidden)
