"""[model] kernels = "liger" (the planner's memory model, the node's application of Liger Kernel), the node's fast
ZeRO-3 offload engine build and the per-node compile cache: the CPU side of issue 26's H200 goals (the kernels
themselves need a GPU and Triton; their speed and loss agreement are measured on the H200, BENCHMARKS.md)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hpctrain.node import dist
from hpctrain.node.model import fast_init, kernels
from hpctrain.node.runconf import NodeInputError
from hpctrain.plan.planner import make_plan
from hpctrain.spec.model import Data as DataSpec
from hpctrain.spec.model import Lora, Model, Resources, Spec, Train
from hpctrain.spec.model import Parallel as ParallelSpec


def _spec_8b(tmp_path: Path, kernels_: str, gpus: int = 1, lora_r: int = 16) -> Spec:
    from hpctrain.spec import presets

    (tmp_path / "config.json").write_text(json.dumps({**presets.preset_config("llama-8b"), "model_type": "llama"}))
    res = Resources(nodes=1, gpus_per_node=gpus, tasks_per_node=1, gpu_mem_gb=139.0 if gpus else 0.0,
                    mem="125G" if gpus else "2000G")
    return Spec(model=Model(path=str(tmp_path), kernels=kernels_), resources=res,  # type: ignore[arg-type]
                data=DataSpec(seq_len=4096), lora=Lora(r=lora_r),
                train=Train(global_batch=16, micro_batch=0, grad_accum=0, activation_checkpointing="auto"),
                parallel=ParallelSpec(zero="auto"))


def test_liger_lets_lora_8b_run_micro_batch_4_without_recompute(tmp_path: Path) -> None:
    """One H200, LoRA r=16 on the 8B shape, global batch 16 x 4096: unfused, the planner's pick is micro-batch 2
    without recompute (the 128k-vocabulary loss alone is 11.7 GiB there); with Liger's fused kernels and loss it
    is micro-batch 4, with no logits term, and the plan says why."""
    plain = make_plan(_spec_8b(tmp_path, "none"))
    fused = make_plan(_spec_8b(tmp_path, "liger"))
    assert plain.kernels == "none" and fused.kernels == "liger"
    assert (plain.micro_batch, plain.activation_checkpointing) == (2, False)
    assert (fused.zero_stage, fused.micro_batch, fused.activation_checkpointing) == (0, 4, False)
    assert plain.memory["breakdown"]["logits"] > 10 and fused.memory["breakdown"]["logits"] < 1
    assert fused.memory["per_rank_gb"] < 0.9 * 139
    assert any(r.startswith("kernels = liger: fused RMSNorm") for r in fused.reasons)


def test_liger_is_off_on_cpu_ranks_with_a_reason(tmp_path: Path) -> None:
    plan = make_plan(_spec_8b(tmp_path, "liger", gpus=0, lora_r=0))
    assert plan.kernels == "none"
    assert any("kernels = liger -> none: CPU ranks" in r for r in plan.reasons)
    assert "kernels" in json.loads(plan.to_json())


def test_fused_cross_entropy_only_below_zero3() -> None:
    assert kernels.fused_ce_allowed(0, 1) and kernels.fused_ce_allowed(2, 1)
    assert not kernels.fused_ce_allowed(3, 1) and not kernels.fused_ce_allowed(0, 2)


def test_missing_liger_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as on an image without it
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    with pytest.raises(NodeInputError, match=r'kernels = "liger": liger-kernel cannot be imported.*Fix:.*"none"'):
        kernels.apply(model, fused_ce=True)


def _fake_liger(monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]]) -> None:
    """A stand-in for liger_kernel's dispatcher (its Triton kernels cannot run on a CPU): records the call."""
    mod = types.ModuleType("liger_kernel.transformers.monkey_patch")
    mod.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": object(), "qwen2": object()}  # type: ignore[attr-defined]
    mod._apply_liger_kernel_to_instance = lambda **kw: calls.append(kw)  # type: ignore[attr-defined]
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", mod)


def test_apply_dispatches_by_model_type_and_refuses_unknown_families(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    _fake_liger(monkeypatch, calls)
    llama = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    assert "fused linear cross-entropy" in kernels.apply(llama, fused_ce=True)
    assert "transformers' loss" in kernels.apply(llama, fused_ce=False)
    assert [c["fused_linear_cross_entropy"] for c in calls] == [True, False]
    assert all(c["model"] is llama and c["rms_norm"] and c["swiglu"] and c["rope"] for c in calls)
    gpt2 = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"))
    with pytest.raises(NodeInputError, match=r"no kernels for model_type 'gpt2'.*Fix"):
        kernels.apply(gpt2, fused_ce=True)


def test_fast_init_only_for_zero3_offload_on_gpu() -> None:
    z3off = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert fast_init.wanted(z3off, use_gpu=True, env={}) == ""
    assert "HPCTRAIN_FAST_INIT=0" in fast_init.wanted(z3off, True, env={"HPCTRAIN_FAST_INIT": "0"})
    assert fast_init.wanted(z3off, use_gpu=False, env={})
    assert fast_init.wanted({"zero_optimization": {"stage": 3}}, use_gpu=True, env={})


def test_fast_init_defragment_keeps_deepspeeds_path_on_the_host() -> None:
    """On host tensors the patched defragment is DeepSpeed's own: same flat buffer, same views."""
    import torch
    from deepspeed.runtime.zero.utils import defragment as ds_defragment

    fast_init.install()
    fast_init.install()  # once per process, whatever the callers
    import deepspeed.runtime.zero.stage3 as s3

    assert s3._hpctrain_fast_init
    a, b = [torch.arange(5.0), torch.arange(3.0) + 10], [torch.arange(5.0), torch.arange(3.0) + 10]
    ours, theirs = s3.defragment(a), ds_defragment(b)
    assert torch.equal(ours, theirs) and torch.equal(a[1], b[1]) and a[1].data_ptr() == ours.data_ptr() + 5 * 4


def test_compile_cache_per_host_beside_the_runs(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    got = dist.compile_cache_dir({}, str(run))
    assert Path(got).parent == tmp_path / "runs" / ".compile-cache"
    assert dist.compile_cache_dir({"HPCTRAIN_COMPILE_CACHE": "off"}, str(run)) == ""
    assert dist.compile_cache_dir({"HPCTRAIN_COMPILE_CACHE": "/x"}, str(run)) == "/x"
    d = dist.DistEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, source="single")
    env: dict[str, str] = {"TRITON_CACHE_DIR": "/mine"}
    dist.prepare_process_env(d, use_gpu=True, env=env, run_dir=str(run))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == got and env["TRITON_CACHE_DIR"] == "/mine"  # a user's setting wins
    cpu: dict[str, str] = {}
    dist.prepare_process_env(d, use_gpu=False, env=cpu, run_dir=str(run))
    assert "TORCHINDUCTOR_CACHE_DIR" not in cpu  # CPU ranks compile nothing
