"""Fused Triton kernels from Liger Kernel (`[model] kernels = "liger"`; the plan's `kernels` says whether a rank
applies them): RMSNorm, RoPE and SwiGLU as single kernels, and the fused linear cross-entropy, which computes
the loss and its gradient chunk by chunk from the last hidden states and the output head and so never holds
the (tokens x vocab) logits, 12 bytes per element at the loss for Llama-3's 128k vocabulary.

Why: a LoRA step of the Llama-3.1-8B shape on one H200 spent 54% of its kernel time in matmuls and ~1/3 in the
frozen base's unfused element-wise work (the RMSNorms' fp32 upcast, RoPE, SwiGLU, the loss; BENCHMARKS.md,
2026-12-03), and the unfused activations kept LoRA at micro-batch 2 without recompute.

Applied to the model instance after it is built and loaded, before PEFT wraps it (LoRA's wrappers then sit on
the projections the fused MLP still calls) and before deepspeed.initialize. The fused cross-entropy reads
`lm_head.weight` without calling the head module, so ZeRO-3 (which gathers a parameter only when its module
runs) would hand it an empty partition: under ZeRO-3 it stays off and transformers' loss is kept.
"""

from __future__ import annotations

import logging
from typing import Any

from hpctrain.node.runconf import NodeInputError

log = logging.getLogger("hpctrain.node")


def fused_ce_allowed(zero_stage: int, pp: int) -> bool:
    """Whether the fused linear cross-entropy may replace the model's forward (see the module's docstring)."""
    return zero_stage < 3 and pp == 1


def apply(model: Any, fused_ce: bool) -> str:
    """Patch `model` (a transformers causal LM, not yet wrapped) in place; returns what was applied.
    Raises NodeInputError naming the fix when the package is missing or does not know the model's family."""
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as exc:
        raise NodeInputError(f"[model] kernels = \"liger\": liger-kernel cannot be imported on this rank ({exc}). "
                             "Fix: install it in the image (pip install liger-kernel; it needs triton, which "
                             "CUDA builds of torch bring), or set [model] kernels = \"none\".") from exc
    model_type = str(getattr(model.config, "model_type", ""))
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise NodeInputError(f"[model] kernels = \"liger\": Liger Kernel has no kernels for model_type "
                             f"{model_type!r} (it knows {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)[:12])}, "
                             "...). Fix: set [model] kernels = \"none\".")
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=fused_ce)
    what = "RMSNorm, RoPE, SwiGLU" + (" and the fused linear cross-entropy" if fused_ce else
                                      "; transformers' loss (ZeRO-3 or pipeline: the head's weight is partitioned)")
    log.info("kernels: Liger Kernel's %s on %s", what, model_type)
    return what
