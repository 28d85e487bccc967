"""hpctrain.node.model.zero_offload on the CPU: when the ZeRO-3 offload step fix applies, and that its "scale is
exactly 1.0" test is DeepSpeed's own arithmetic (the copy itself needs a GPU: bench/gpu/offload_parts.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hpctrain.node.model import zero_offload as Z


def deepspeed_scale(loss_scale: float, clip_grad: float, total_norm: Any) -> float:
    """stage3.unscale_and_clip_grads (DeepSpeed 0.19.8), verbatim arithmetic."""
    combined_scale = loss_scale
    if clip_grad > 0.0:
        clip = ((total_norm / loss_scale) + 1e-6) / clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * loss_scale
    return float(combined_scale)


@pytest.mark.parametrize("norm", [0.0, 0.5, 0.999999, 1.0, 1.0000001, 1.5, 1e6])
@pytest.mark.parametrize("clip", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_combined_scale_is_deepspeeds(norm: float, clip: float, loss_scale: float) -> None:
    total = torch.tensor(norm * loss_scale)
    assert Z.combined_scale(loss_scale, clip, total) == deepspeed_scale(loss_scale, clip, total)


def fake_stage3(**over: Any) -> Any:
    cls = type("DeepSpeedZeroOptimizer_Stage3", (), {})
    opt = cls()
    attrs = {"fp16_partitioned_groups_flat": [], "fp32_partitioned_groups_flat": [], "subgroup_to_device": {0: "cpu"},
             "clip_grad": 1.0, "loss_scale": 1.0, "offload_optimizer": True, "swap_optimizer": False,
             "_unflatten_partitioned_parameters": print, "unscale_and_clip_grads": print,
             "_reassign_or_swap_out_partitioned_parameters": print, "_post_step": print, **over}
    for k, v in attrs.items():
        setattr(opt, k, v)
    return opt


def test_applies_only_to_zero3_with_the_optimizer_on_the_cpu() -> None:
    assert "not ZeRO-3" in Z.applies(SimpleNamespace())
    assert "not offloaded" in Z.applies(fake_stage3(offload_optimizer=False))
    assert "NVMe" in Z.applies(fake_stage3(swap_optimizer=True))
    lacking = fake_stage3()
    del lacking.subgroup_to_device
    assert "lacks subgroup_to_device" in Z.applies(lacking)
    if not torch.cuda.is_available():
        assert Z.applies(fake_stage3()) == "no CUDA device"
    else:
        assert "no optimizer sub-group on the CPU" in Z.applies(fake_stage3(subgroup_to_device={0: "cuda"}))


def test_switch_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTRAIN_ZERO3_OFFLOAD_FIX", "0")
    opt = fake_stage3()
    assert Z.install(opt).startswith("off")
    assert opt.unscale_and_clip_grads is print  # nothing patched
    assert Z.enabled({}) and Z.enabled({"HPCTRAIN_ZERO3_OFFLOAD_FIX": "1"})


def test_cpu_adam_prebuilt_only_where_deepspeed_builds_it() -> None:
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    assert Z.needs_cpu_adam(offload, use_gpu=True)
    assert not Z.needs_cpu_adam(offload, use_gpu=False)  # CPU ranks: torch's AdamW
    torch_adam = {**offload, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert not Z.needs_cpu_adam(torch_adam, use_gpu=True)
    assert not Z.needs_cpu_adam({"zero_optimization": {"stage": 3}, "optimizer": {"params": {}}}, use_gpu=True)
    assert Z.prebuild_cpu_adam(torch_adam, use_gpu=True) is None
    assert Z.join_cpu_adam(None) == 0.0
