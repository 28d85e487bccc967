"""The attention kernel: `[model] attention` -> transformers' attn_implementation and torch's SDPA backend order.

transformers' "sdpa" attention calls torch.nn.functional.scaled_dot_product_attention, and torch picks the first
backend in its priority order that supports the call (flash, then memory-efficient, then math, then cuDNN, as
torch 2.11 ships). "auto" keeps transformers' default ("sdpa" where the model supports it, else "eager") and, on
a GPU kind in MEASURED, moves the backend measured
fastest there to the front (the others stay behind it as fallbacks, so a call the first cannot serve still
runs). "sdpa-<backend>" puts that backend first on any GPU; "sdpa" keeps torch's order; the other values are
transformers' own implementations, passed through (flash_attention_2/3 need their packages in the container).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("cudnn", "flash", "efficient", "math")  # names of torch.nn.attention.SDPBackend members, lower-case

# Compute capability -> the backend measured fastest for causal bf16 training at seq 4096 (bench/gpu/sdpa_probe.py).
MEASURED: dict[tuple[int, int], str] = {}


@dataclass(frozen=True)
class Choice:
    hf: str  # transformers' attn_implementation ("": its default, sdpa where the model supports it)
    first: str  # SDPA backend moved to the front of torch's order ("" = torch's own order)
    why: str


def resolve(setting: str, capability: tuple[int, int] | None) -> Choice:
    """What `[model] attention = setting` means on a rank whose GPU has this compute capability (None: CPU)."""
    if setting.startswith("sdpa-"):
        return Choice("sdpa", setting.removeprefix("sdpa-"), f"[model] attention = {setting}")
    if setting != "auto":
        return Choice(setting, "", f"[model] attention = {setting}")
    first = MEASURED.get(capability, "") if capability is not None else ""
    if first:
        return Choice("", first, f"auto: {first} first, measured fastest on compute capability "
                                 f"{capability[0]}.{capability[1]} (bench/gpu/sdpa_probe.py)")
    where = "a CPU rank" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
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
