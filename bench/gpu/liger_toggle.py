"""Liger Kernel on and off on one built engine (bench only): the ".liger" window modifier of ft_alternate.py.

`on` applies the node's own hpctrain.node.model.kernels.apply to the (PEFT-unwrapped) transformers model in place;
`off` undoes it: Liger binds its forwards to module instances (`module.__dict__["forward"]`, "extra_repr",
"_get_name") and replaces modeling_llama.apply_rotary_pos_emb; dropping the instance entries restores the classes'
methods, and the module function is put back. Only the forward changes, never a parameter, so the engine, its
optimizer and ZeRO's hooks (which run in Module.__call__) stay as they are.
"""

from __future__ import annotations

from typing import Any

_ORIG: dict[str, Any] = {}
_BOUND = ("forward", "extra_repr", "_get_name")


def _base(model: Any) -> Any:
    return getattr(model, "get_base_model", lambda: model)()


def on(model: Any, fused_ce: bool) -> str:
    from transformers.models.llama import modeling_llama

    from hpctrain.node.model import kernels

    _ORIG.setdefault("rope", modeling_llama.apply_rotary_pos_emb)
    if _ORIG.get("on"):
        return "liger"
    kernels.apply(_base(model), fused_ce)
    _ORIG["on"] = True
    return "liger"


def off(model: Any) -> None:
    from transformers.models.llama import modeling_llama

    if not _ORIG.get("on"):
        return
    for m in _base(model).modules():
        for name in _BOUND:
            m.__dict__.pop(name, None)
    modeling_llama.apply_rotary_pos_emb = _ORIG["rope"]
    _ORIG["on"] = False


def loss_check(engine: Any, batch: Any, fused_ce: bool) -> dict[str, float]:
    """The loss of one micro-batch without and with Liger, eval mode (no dropout), no gradient: the same model
    and tokens, so the two differ only by the kernels' arithmetic. skip_logits=True makes Liger's forward take
    the fused cross-entropy even in eval mode (it is what training runs)."""
    import torch

    model = engine.module
    was = model.training
    model.eval()
    inputs = batch.model_inputs(engine.device)
    with torch.no_grad():
        off(model)
        unfused = float(engine(**inputs).loss.float().item())
        on(model, fused_ce)
        fused = float(engine(**inputs, **({"skip_logits": True} if fused_ce else {})).loss.float().item())
        off(model)
    model.train(was)
    return {"loss_unfused": unfused, "loss_liger": fused, "abs_diff": abs(fused - unfused)}
