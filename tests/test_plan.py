"""Plan: degrees, batch arithmetic, parameter counts, memory model, zero auto."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpctrain.errors import HpcUsageError
from hpctrain.plan.model import Plan
from hpctrain.plan.planner import (
    batch_sizes,
    load_model_config,
    make_plan,
    model_arch,
    param_count,
)
from hpctrain.spec.model import Data, Model, Parallel, Resources, Spec, Train


def spec(**kw: object) -> Spec:
    base: dict[str, object] = {"model": Model(config="llama-tiny")}
    base.update(kw)
    return Spec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("preset, expected", [
    ("llama-1b", 1_235_814_400),  # Llama 3.2 1B (tied embeddings)
    ("llama-3b", 3_212_749_824),  # Llama 3.2 3B (tied)
    ("llama-8b", 8_030_261_248),  # Llama 3.1 8B (untied)
])
def test_preset_param_counts_match_published(preset: str, expected: int) -> None:
    assert param_count(model_arch(load_model_config(Model(config=preset)))) == expected


def test_gpt2_and_mistral_configs(tmp_path: Path) -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
            "vocab_size": 50257}
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    assert param_count(model_arch(load_model_config(Model(config=str(tmp_path / "gpt2.json"))))) == 124_439_808
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
               "tie_word_embeddings": False}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(mistral))
    assert param_count(model_arch(load_model_config(Model(path=str(tmp_path / "m"))))) == 7_241_732_096


def test_tied_embeddings_counted_once() -> None:
    cfg = load_model_config(Model(config="llama-tiny"))
    untied = param_count(model_arch(cfg))
    tied = param_count(model_arch({**cfg, "tie_word_embeddings": True}))
    assert untied - tied == cfg["vocab_size"] * cfg["hidden_size"]


def test_overrides_apply() -> None:
    cfg = load_model_config(Model(config="llama-tiny", overrides={"num_hidden_layers": 4}))
    assert cfg["num_hidden_layers"] == 4


def test_world_and_dp() -> None:
    p = make_plan(spec(resources=Resources(nodes=4, gpus_per_node=8), parallel=Parallel(tp=2, pp=2, zero=1)))
    assert (p.world_size, p.ranks_per_node, p.dp, p.tp, p.pp) == (32, 8, 8, 2, 2)
    cpu = make_plan(spec(resources=Resources(nodes=2, tasks_per_node=3)))
    assert (cpu.world_size, cpu.ranks_per_node, cpu.device) == (6, 3, "cpu")
    assert make_plan(spec()).world_size == 1


def test_tp_pp_not_dividing_is_refused() -> None:
    with pytest.raises(HpcUsageError) as exc:
        make_plan(spec(resources=Resources(nodes=1, tasks_per_node=6), parallel=Parallel(tp=4, zero=1)))
    msg = str(exc.value)
    assert "parallel.tp*pp = 4" in msg and "world size 6" in msg and "Fix:" in msg and "[1, 2, 3, 6]" in msg


@pytest.mark.parametrize("m, a, g, dp, expected", [
    (2, 4, 0, 8, (2, 4, 64)), (2, 0, 64, 8, (2, 4, 64)), (0, 4, 64, 8, (2, 4, 64)),
    (0, 0, 64, 8, (8, 1, 64)), (0, 0, 0, 8, (1, 1, 8)), (2, 4, 64, 8, (2, 4, 64)), (1, 4, 4, 1, (1, 4, 4)),
])
def test_batch_arithmetic(m: int, a: int, g: int, dp: int, expected: tuple[int, int, int]) -> None:
    assert batch_sizes(spec(train=Train(micro_batch=m, grad_accum=a, global_batch=g)), dp) == expected


@pytest.mark.parametrize("m, a, g, dp, fix", [
    (2, 4, 60, 8, "--global-batch 64"),
    (3, 0, 20, 8, "--global-batch 24"),
    (3, 0, 64, 8, "--global-batch"),
    (0, 3, 64, 8, "--global-batch 48 or 72"),
    (2, 3, 32, 8, "--global-batch 48, or --grad-accum 2"),
])
def test_inconsistent_batches_name_the_fix(m: int, a: int, g: int, dp: int, fix: str) -> None:
    with pytest.raises(HpcUsageError) as exc:
        batch_sizes(spec(train=Train(micro_batch=m, grad_accum=a, global_batch=g)), dp)
    msg = str(exc.value)
    assert f"train.global_batch = {g}" in msg and fix in msg, msg


def test_memory_falls_with_zero_stage() -> None:
    p = make_plan(spec(model=Model(config="llama-8b"), resources=Resources(nodes=4, gpus_per_node=8),
                       parallel=Parallel(zero="auto"), data=Data(seq_len=2048), train=Train(micro_batch=1)))
    by = {(o["zero"], o["offload"]): o for o in p.options}
    assert by[(0, "none")]["device_gb"] > by[(1, "none")]["device_gb"] > by[(2, "none")]["device_gb"] \
        > by[(3, "none")]["device_gb"]
    assert by[(3, "optimizer")]["device_gb"] < by[(3, "none")]["device_gb"]
    assert by[(3, "optimizer")]["host_gb"] > by[(3, "none")]["host_gb"]
    # 8B in bf16 with Adam: 16 B/param = ~120 GiB of state unsharded: stage 0 cannot fit on 80 GiB.
    assert by[(0, "none")]["fits"] is False
    assert p.zero_stage == 1 and "fastest" in " ".join(p.reasons) or "do not fit: 0/none" in " ".join(p.reasons)


def test_zero_auto_single_gpu_chooses_offload() -> None:
    p = make_plan(spec(model=Model(config="llama-8b"), resources=Resources(gpus_per_node=1, gpu_mem_gb=80),
                       parallel=Parallel(zero="auto"), data=Data(seq_len=1024), train=Train(micro_batch=1)))
    assert p.offload in ("optimizer", "all")
    assert any("zero auto" in r for r in p.reasons)


def test_zero_auto_small_model_picks_stage0() -> None:
    p = make_plan(spec(resources=Resources(nodes=2, gpus_per_node=4), parallel=Parallel(zero="auto")))
    assert (p.zero_stage, p.offload) == (0, "none")
    assert "the fastest choice" in " ".join(p.reasons)


def test_zero_auto_nothing_fits_is_refused() -> None:
    with pytest.raises(HpcUsageError, match="no ZeRO/offload choice fits.*Fix"):
        make_plan(spec(model=Model(config="llama-8b"), resources=Resources(gpus_per_node=1, gpu_mem_gb=8, mem="16G"),
                       parallel=Parallel(zero="auto")))


def test_explicit_choice_that_does_not_fit_warns() -> None:
    p = make_plan(spec(model=Model(config="llama-8b"), resources=Resources(gpus_per_node=1), parallel=Parallel(zero=0)))
    assert p.zero_stage == 0 and any(r.startswith("WARNING") for r in p.reasons)


def test_pipeline_limits_auto_to_stage_0_1() -> None:
    p = make_plan(spec(model=Model(config="llama-1b"), resources=Resources(nodes=2, gpus_per_node=4),
                       parallel=Parallel(zero="auto", pp=2)))
    assert p.zero_stage in (0, 1)


def test_cpu_ranks_use_host_memory() -> None:
    p = make_plan(spec(resources=Resources(tasks_per_node=2)))
    assert p.device == "cpu" and p.memory["device_capacity_gb"] is None
    assert p.memory["per_host_gb"] == pytest.approx(2 * p.memory["per_rank_gb"], rel=1e-3)


def test_activation_checkpointing_reduces_activations() -> None:
    # A small vocabulary, so the logits (not touched by checkpointing) do not dominate.
    kw: dict[str, object] = {"model": Model(config="llama-1b", overrides={"vocab_size": 320}),
                             "resources": Resources(gpus_per_node=8), "data": Data(seq_len=4096),
                             "train": Train(micro_batch=4)}
    off = make_plan(spec(**kw)).memory["breakdown"]["activations"]
    kw["train"] = Train(micro_batch=4, activation_checkpointing=True)
    on = make_plan(spec(**kw)).memory["breakdown"]["activations"]
    assert on < off / 3


def test_plan_json_round_trips_through_from_json() -> None:
    p = make_plan(spec(resources=Resources(tasks_per_node=2)))
    assert Plan.from_json(p.to_json()) == p
    assert p.zero_stage == 3 and p.to_json() == make_plan(spec(resources=Resources(tasks_per_node=2))).to_json()


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.pop("dp"), "dp"),
    (lambda d: d.update(zero_stgae=3), "zero_stgae"),
    (lambda d: d.update(micro_batch="2"), "micro_batch"),
    (lambda d: d.update(activation_checkpointing=1), "activation_checkpointing"),
])
def test_plan_from_json_refuses_a_damaged_file(edit: Any, needle: str) -> None:
    data = json.loads(make_plan(spec()).to_json())
    edit(data)
    with pytest.raises(ValueError, match=needle):
        Plan.from_json(json.dumps(data))


# -- each ZeRO/offload rule once (spec.rules): the spec check, zero auto and ds_config agree ---------------

_KINDS = [(z, o, r, d, pp) for z in (0, 1, 2, 3) for o in ("none", "optimizer", "param", "all") for r in (1.0, 0.5)
          for d in ("cpu", "nvme") for pp in (1, 2)]


@pytest.mark.parametrize("zero, offload, ratio, device, pp", _KINDS)
def test_spec_accepts_exactly_what_the_rule_allows(zero: int, offload: str, ratio: float, device: str, pp: int) -> None:
    """An explicit choice passes validation iff kind_allowed says DeepSpeed runs it (pp > 1 needs ZeRO <= 1,
    an offload ratio needs ZeRO-3 with CPU optimizer offload, param offload needs ZeRO-3, ...), and the plan
    then keeps it."""
    from hpctrain.spec.rules import kind_allowed

    def build() -> Spec:
        return spec(resources=Resources(nodes=1, gpus_per_node=2),
                    parallel=Parallel(zero=zero, offload=offload, offload_ratio=ratio, offload_device=device,
                                      nvme_path="/local/nvme", pp=pp))

    if not kind_allowed((zero, offload, ratio), pp, device):
        with pytest.raises(HpcUsageError):
            build()
        return
    plan = make_plan(build())
    assert (plan.zero_stage, plan.offload, plan.offload_ratio) == (zero, offload, ratio)


@pytest.mark.parametrize("pp, device, offload", [(1, "cpu", "none"), (2, "cpu", "none"), (1, "nvme", "none"),
                                                 (1, "cpu", "optimizer"), (2, "cpu", "all")])
def test_zero_auto_chooses_only_allowed_kinds(pp: int, device: str, offload: str) -> None:
    """zero auto (spec.rules.zero_choices) never offers a choice the spec would refuse: with pp 2 no ZeRO 2/3,
    with NVMe no partial ratio (DeepSpeed does not split optimizer state with NVMe)."""
    from hpctrain.spec.rules import kind_allowed, zero_choices

    def build() -> Spec:
        return spec(resources=Resources(nodes=1, gpus_per_node=2), parallel=Parallel(
            zero="auto", offload=offload, offload_device=device, nvme_path="/local/nvme", pp=pp))

    if pp > 1 and offload == "all":  # no stage both allows: refused up front, not a planner crash
        with pytest.raises(HpcUsageError, match="pipeline engine"):
            build()
        return
    kinds = zero_choices(build().parallel, gpu=True)
    assert kinds and all(kind_allowed(k, pp, device) for k in kinds)
    if pp > 1:
        assert {z for z, _, _ in kinds} <= {0, 1}
        with pytest.raises(HpcUsageError, match="pipeline engine"):  # a ratio that no allowed stage can use
            spec(parallel=Parallel(zero="auto", offload="optimizer", offload_ratio=0.5, pp=pp))
    if device == "nvme":
        assert all(r == 1.0 for _, _, r in kinds)


def test_ds_config_writes_a_ratio_only_where_the_rule_allows() -> None:
    from hpctrain.render.deepspeed import build_ds_config

    s = spec(resources=Resources(nodes=1, gpus_per_node=2),
             parallel=Parallel(zero=3, offload="optimizer", offload_ratio=0.5))
    zero_block = build_ds_config(s, make_plan(s))["zero_optimization"]
    assert zero_block["offload_optimizer"]["ratio"] == 0.5
    full = spec(resources=Resources(nodes=1, gpus_per_node=2), parallel=Parallel(zero=2, offload="optimizer"))
    assert "ratio" not in build_ds_config(full, make_plan(full))["zero_optimization"]["offload_optimizer"]


@pytest.mark.parametrize(("mem", "size"), [("4000", 4000 * 2**20), ("512M", 2**29), ("64G", 64 * 2**30),
                                           ("2T", 2 * 2**40), ("8K", 8 * 2**10), ("", None), ("lots", None),
                                           ("64g", None), ("9" * 20, None)])
def test_one_reading_of_mem_for_the_rule_and_the_planner(mem: str, size: int | None) -> None:
    """resources.mem is read once (spec.rules.mem_bytes): the planner's host capacity is the same number."""
    from hpctrain.plan.memory import parse_mem_gb
    from hpctrain.spec.rules import mem_bytes

    assert mem_bytes(mem) == size
    assert parse_mem_gb(mem) == (None if size is None else size / 2**30)
