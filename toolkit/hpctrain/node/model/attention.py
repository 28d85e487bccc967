"""The attention kernel: `[model] attention` -> transformers' attn_implementation and torch's SDPA backend order.

transformers' "sdpa" attention calls torch.nn.functional.scaled_dot_product_attention, and torch picks the first
backend in its priority order that supports the call (flash, then memory-efficient, then math, then cuDNN, as
torch 2.11 ships). "auto" keeps transformers' default ("sdpa" where the model supports it, else "eager") and, on
a GPU kind in MEASURED, moves the backend measured fastest there to the front (the others stay behind it as
fallbacks, so a call the first cannot serve still runs); on a GPU rank whose rows are packed documents it takes
FlexAttention where the model class supports it (`resolve`'s docstring has the measurement). "sdpa-<backend>" puts that
backend first on any GPU; "sdpa" keeps torch's order; the other values are transformers' own implementations,
passed through (flash_attention_2/3 need their packages in the container).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKENDS = ("cudnn", "flash", "efficient", "math")  # names of torch.nn.attention.SDPBackend members, lower-case

# Compute capability -> the backend measured fastest for whole training steps, where it differs from torch's
# own order. Empty: on the H200 (9.0; torch 2.11, cuDNN 9.19, transformers 5.17) torch's order starts with
# flash, and cuDNN alone ran causal bf16 SDPA 1.6-1.8x faster at the Llama 1B/3B/8B shapes, seq 4096
# (bench/gpu/sdpa_probe.py, 2026-12-02), but moved first it changed Llama-1B's whole step by 0.4% (1.329 vs
# 1.334 s, the planner's 8 x 2, one run each): inside the model it is not what decides (BENCHMARKS.md).
MEASURED: dict[tuple[int, int], str] = {}


@dataclass(frozen=True)
class Choice:
    hf: str  # transformers' attn_implementation ("": its default, sdpa where the model supports it)
    first: str  # SDPA backend moved to the front of torch's order ("" = torch's own order)
    why: str


def resolve(setting: str, capability: tuple[int, int] | None, packed_flex: bool = False) -> Choice:
    """What `[model] attention = setting` means on a rank whose GPU has this compute capability (None: CPU).
    `packed_flex`: the rows are packed documents and the model supports FlexAttention. transformers turns packed
    position_ids into a (micro x 1 x seq x seq) boolean mask for SDPA, which then cannot take its flash kernel;
    FlexAttention gets a block mask instead. Measured on one H200 (Llama-3.1-8B shape, 16 x 4096, the planner's
    ZeRO-3 offload plan; bench/gpu/ft_alternate.py, BENCHMARKS.md 2026-12-03): packed SFT steps 1.136x the
    synthetic step with SDPA, 0.965x with FlexAttention; LoRA 5.58 s vs 6.91 s. So "auto" picks it there
    (GPU ranks only: torch's FlexAttention has no CPU backward)."""
    if setting.startswith("sdpa-"):
        return Choice("sdpa", setting.removeprefix("sdpa-"), f"[model] attention = {setting}")
    if setting != "auto":
        return Choice(setting, "", f"[model] attention = {setting}")
    if capability is None:
        return Choice("", "", "auto: torch's own SDPA order (a CPU rank)")
    if packed_flex:
        return Choice("flex_attention", "", "auto: packed rows on a GPU: FlexAttention's block mask, no seq x seq "
                                            "mask (measured faster than SDPA with the mask)")
    where = f"compute capability {capability[0]}.{capability[1]}"
    first = MEASURED.get(capability, "")
    if first:
        return Choice("", first, f"auto: {first} first, measured fastest end to end on {where}")
    return Choice("", "", f"auto: torch's own SDPA order (nothing measured for {where})")


def apply(choice: Choice) -> str:
    """Set torch's SDPA backend priority for this process (global: the autograd threads see it too).
    Returns "" when done (or nothing to do), else why it could not be (this torch has no priority order)."""
    if not choice.first:
        return ""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}
    order = [getattr(SDPBackend, names[b]) for b in (choice.first, *(b for b in BACKENDS if b != choice.first))]
    try:
        # Entered for the rest of the process: the training runs inside it, backward and recompute included.
        sdpa_kernel(order, set_priority=True).__enter__()
    except TypeError as exc:  # torch before 2.6: no set_priority
        return f"torch's SDPA order kept ({exc})"
    return ""


def capability() -> tuple[int, int] | None:
    """This rank's GPU compute capability, None on a CPU rank."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def supports_flex(cfg: Any) -> bool:
    """Whether transformers' causal-LM class for this config declares FlexAttention support."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        return bool(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], "_supports_flex_attn", False))
    except (ImportError, KeyError, ValueError):
        return False
