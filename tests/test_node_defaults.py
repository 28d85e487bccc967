"""What a rank chooses by itself: the attention kernel ([model] attention, hpctrain.node.model.attention), the GPU
allocator default, where a fresh model is built, and the imports of its start-up (hpctrain.node.launch.imports)."""

from __future__ import annotations

import pytest

from hpctrain.node.dist import DistEnv, prepare_process_env
from hpctrain.node.model import attention


def test_auto_keeps_transformers_default_and_moves_only_a_measured_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = attention.resolve("auto", None)
    assert (cpu.hf, cpu.first) == ("", "") and "CPU" in cpu.why
    monkeypatch.setattr(attention, "MEASURED", {(9, 0): "cudnn"})
    hopper = attention.resolve("auto", (9, 0))
    assert (hopper.hf, hopper.first) == ("", "cudnn") and "9.0" in hopper.why
    other = attention.resolve("auto", (8, 0))
    assert (other.hf, other.first) == ("", "") and "8.0" in other.why


def test_auto_takes_flex_for_packed_rows_on_a_gpu_only() -> None:
    from transformers import LlamaConfig

    assert attention.supports_flex(LlamaConfig())
    assert attention.resolve("auto", (9, 0), packed_flex=True).hf == "flex_attention"
    assert attention.resolve("auto", None, packed_flex=True).hf == ""  # CPU ranks: no FlexAttention backward
    assert attention.resolve("sdpa", (9, 0), packed_flex=True).hf == "sdpa"  # an explicit setting wins


@pytest.mark.parametrize(("setting", "hf", "first"), [
    ("sdpa", "sdpa", ""), ("sdpa-flash", "sdpa", "flash"), ("sdpa-cudnn", "sdpa", "cudnn"),
    ("sdpa-efficient", "sdpa", "efficient"), ("eager", "eager", ""), ("flash_attention_2", "flash_attention_2", "")])
def test_explicit_settings(setting: str, hf: str, first: str) -> None:
    got = attention.resolve(setting, (9, 0))
    assert (got.hf, got.first) == (hf, first)
    assert got.first in ("", *attention.BACKENDS)


def test_every_spec_value_resolves() -> None:
    import typing

    from hpctrain.spec.model import Attention

    for value in typing.get_args(Attention):
        got = attention.resolve(value, (9, 0))
        assert got.first in ("", *attention.BACKENDS), value


def test_the_spec_refuses_an_unknown_kernel() -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import from_toml_text
    from runkit import spec_toml, tiny_tables

    with pytest.raises(HpcUsageError, match=r"model.attention = 'fast'.*'sdpa-cudnn'"):
        from_toml_text(spec_toml(tiny_tables(model={"config": "llama-tiny", "attention": "fast"})))


def test_the_model_is_built_with_the_chosen_implementation() -> None:
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from hpctrain.node.model.build import build_model, hf_config

    spec = SimpleNamespace(path="", config="llama-tiny", overrides={}, freeze=())
    cfg = hf_config(spec)
    eager = build_model(spec, cfg, "fp32", {}, zero3=False, attn="eager")
    assert eager.config._attn_implementation == "eager"
    default = build_model(spec, hf_config(spec), "fp32", {}, zero3=False)
    assert default.config._attn_implementation == "sdpa"  # transformers' default for Llama


def test_gpu_ranks_get_expandable_segments_unless_the_user_set_the_allocator() -> None:
    d = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500, source="test",
                job_id="")
    env: dict[str, str] = {}
    prepare_process_env(d, use_gpu=True, env=env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        mine = {key: "max_split_size_mb:512"}
        prepare_process_env(d, use_gpu=True, env=mine)
        assert mine[key] == "max_split_size_mb:512"
        assert len([k for k in mine if k.endswith("ALLOC_CONF")]) == 1
    cpu: dict[str, str] = {}
    prepare_process_env(d, use_gpu=False, env=cpu)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in cpu


def test_an_implementation_transformers_refuses_is_a_usage_error() -> None:
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    import importlib.util
    from types import SimpleNamespace

    from hpctrain.node.model.build import build_model, hf_config
    from hpctrain.node.runconf import NodeInputError

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    spec = SimpleNamespace(path="", config="llama-tiny", overrides={}, freeze=())
    with pytest.raises(NodeInputError, match=r"\[model\] attention = 'flash_attention_2'.*Fix: install"):
        build_model(spec, hf_config(spec), "fp32", {}, zero3=False, attn="flash_attention_2")


def test_a_fresh_model_without_zero3_is_built_on_the_ranks_device() -> None:
    """GPU ranks build it on their GPU (device="cuda"); "meta" here stands in for a device this machine lacks."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from hpctrain.node.model.build import build_model, hf_config

    spec = SimpleNamespace(path="", config="llama-tiny", overrides={}, freeze=())
    model = build_model(spec, hf_config(spec), "fp32", {}, zero3=False, device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.device.type for p in build_model(spec, hf_config(spec), "fp32", {}, zero3=False).parameters()} == {"cpu"}


def test_deepspeed_is_imported_without_mlflow_on_a_rank() -> None:
    """hpctrain.node.launch.imports: DeepSpeed's autotuner does not load mlflow on a rank (~1 s of every start),
    and mlflow itself still imports afterwards (the node's MLflow tracker)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")
    import subprocess
    import sys

    code = ("import sys; import hpctrain.node.launch.main; import deepspeed; "
            "import deepspeed.autotuning.autotuner as a; "
            "assert 'mlflow' not in sys.modules and a.has_mlflow is False; import mlflow; print('ok', mlflow.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "ok mlflow" in proc.stdout, proc.stderr[-2000:]
