"""A fused LoRA forward for PEFT's `lora.Linear` (issue 26 item 5: LoRA 8B >= 1.8x the full fine-tune).

PEFT computes `result + lora_B(lora_A(dropout(x))) * scaling`: after the B matmul it writes the out-shaped
product, reads it again for `* scaling`, and once more for `+ result` (12 bytes of memory traffic per output
element in bf16, and the same again in backward), over every adapted linear of every layer. Folding B, the
scaling and the add into one GEMM with an accumulate (`torch.addmm(result, a, B^T, alpha=scaling)`) leaves one
read and one write of the output. The dropout (and `dropout = 0`: none) stays PEFT's.

Only the plain case takes it (one active adapter, not merged, no DoRA/variant, no `adapter_names`, input in
the adapter's dtype, a 2-D view of the output possible); everything else calls PEFT's own forward.

    n = install(model)       # every lora.Linear of the model; returns how many
    uninstall(model)
    set_dropout(model, off=True)   # dropout -> Identity (the adapters' `lora_dropout = 0`), reversible
"""

from __future__ import annotations

import types
from typing import Any

_ORIG = "_hpctrain_peft_forward"
_DROP = "_hpctrain_peft_dropout"


def fused_forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    import torch

    adapters = [a for a in self.active_adapters if a in self.lora_A]
    if (args or kwargs or self.disable_adapters or self.merged or len(adapters) != 1
            or adapters[0] in getattr(self, "lora_variant", {})):
        return getattr(self, _ORIG)(x, *args, **kwargs)
    name = adapters[0]
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    if x.dtype != lora_a.weight.dtype:
        return getattr(self, _ORIG)(x, *args, **kwargs)
    result = self.base_layer(x)
    if result.dtype != lora_b.weight.dtype or not result.is_contiguous():
        return getattr(self, _ORIG)(x, *args, **kwargs)
    a = lora_a(self.lora_dropout[name](x))
    out = torch.addmm(result.reshape(-1, result.shape[-1]), a.reshape(-1, a.shape[-1]), lora_b.weight.t(),
                      alpha=float(self.scaling[name]))
    return out.view(result.shape)


def _lora_linears(model: Any) -> list[Any]:
    from peft.tuners.lora.layer import Linear

    return [m for m in model.modules() if type(m) is Linear]


def install(model: Any) -> int:
    n = 0
    for m in _lora_linears(model):
        if not hasattr(m, _ORIG):
            setattr(m, _ORIG, m.forward)
            m.forward = types.MethodType(fused_forward, m)
            n += 1
    return n


def uninstall(model: Any) -> int:
    n = 0
    for m in _lora_linears(model):
        if hasattr(m, _ORIG):
            m.forward = getattr(m, _ORIG)
            delattr(m, _ORIG)
            n += 1
    return n


def set_dropout(model: Any, off: bool) -> int:
    """Swap every adapter's dropout for Identity (off) or back (the original modules are kept)."""
    import torch

    n = 0
    for m in _lora_linears(model):
        for name in list(m.lora_dropout.keys()):
            if off and not isinstance(m.lora_dropout[name], torch.nn.Identity):
                setattr(m, _DROP, {**getattr(m, _DROP, {}), name: m.lora_dropout[name]})
                m.lora_dropout[name] = torch.nn.Identity()
                n += 1
            elif not off and name in getattr(m, _DROP, {}):
                m.lora_dropout[name] = getattr(m, _DROP)[name]
                n += 1
    return n
