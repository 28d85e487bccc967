"""LoRA through PEFT (hpctrain.node.model.lora): training on 2 CPU ranks under ZeRO-2 and ZeRO-3, adapter-only
checkpoints, resume at the same and at another world size, the export (adapter + merged), the planner's
memory model and the submit-time refusals.

The base is a tiny Llama written here with save_pretrained. Six launches in all (~10-50 s each on 2 busy
cores): each run checks several facts.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.errors import HpcUsageError
from runkit import events, losses_by_step, make_run, metrics, spec_toml, tiny_tables, torchrun

LORA = {"r": 4, "dropout": 0.0}  # no dropout: a loss recomputed from the export must match the logged one


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"


def _base(root: Path, tied: bool = False) -> Path:
    """llama-tiny with random weights, saved as a pretrained folder (safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpctrain.spec import presets

    d = presets.preset_config("llama-tiny")
    d.pop("architectures", None)
    d["tie_word_embeddings"] = tied
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "base")
    return root / "base"


def _lora_run(run: Path, base: Path, **sections: Any) -> Path:
    return make_run(run, model={"config": "", "path": str(base)}, lora=LORA, **sections)


def _batch_loss(model: Any, cursors: list[int]) -> float:
    """Mean loss of `model` over the synthetic micro-batches at `cursors` (the data every rank reads)."""
    import torch

    from hpctrain.node.data.loader import DataSource

    src = DataSource(None, mode="padded", micro=2, seq_len=32, budget=64, seed=7, pad_id=256, vocab=320)
    with torch.no_grad():
        return sum(float(model(**src.batch(c).model_inputs()).loss) for c in cursors) / len(cursors)


def _checkpoint_tensors(folder: Path) -> tuple[set[str], int]:
    """(module keys, elements of every tensor) in a checkpoint's DeepSpeed files (rng files aside)."""
    import torch

    keys: set[str] = set()
    total = 0

    def walk(obj: Any) -> None:
        nonlocal total
        if torch.is_tensor(obj):
            total += obj.numel()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    for f in folder.glob("*_states.pt"):
        state = torch.load(f, map_location="cpu", weights_only=False)
        keys |= set(state.get("module") or {})
        walk({k: v for k, v in state.items() if k != "ds_config"})
    return keys, total


BASE_PARAMS = 123200  # llama-tiny (untied; 102720 tied)


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ZeRO-2 on 2 ranks, 6 steps, checkpoints every 2: crashes after step 3, resumes from step-2, exports.
    The head is tied to the embedding: a tied frozen weight must stay out of the checkpoint too."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora2")
    base = _base(root, tied=True)
    run = _lora_run(root / "run", base, train={"steps": 6, "lr": 1e-2}, parallel={"zero": 2},
                    checkpoint={"every_steps": 2, "keep": 3, "export_hf": True})
    first = torchrun(run, 2, env={"HPCTRAIN_FAIL_AT_STEP": "3"})
    assert first.returncode != 0
    _ok(torchrun(run, 2))
    return {"base": base, "run": run}


@pytest.mark.deepspeed
def test_zero2_trains_adapters_only_and_resumes_where_it_stopped(zero2_run: dict[str, Path]) -> None:
    run = zero2_run["run"]
    recs = metrics(run)
    step3 = [r["loss"] for r in recs if r["step"] == 3]
    assert len(step3) == 2 and step3[0] == step3[1]  # the resumed attempt re-ran step 3 exactly
    loss = losses_by_step(run)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6] and loss[6] < loss[1] - 0.01
    log = "\n".join(p.read_text() for p in (run / "logs").glob("*rank-0.log"))
    assert "LoRA r=4 alpha=8 on every linear layer but the head: 8704 trainable parameters" in log
    ckpt = run / "checkpoints" / "step-6"
    assert json.loads((ckpt / "hpctrain.json").read_text())["adapters"] is True
    keys, elements = _checkpoint_tensors(ckpt)
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert elements < BASE_PARAMS / 2  # adapters (8704) + their fp32 Adam state, not the base (131904)


@pytest.mark.deepspeed
def test_export_writes_adapter_and_merged_model_with_equal_logits(zero2_run: dict[str, Path]) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, base = zero2_run["run"], zero2_run["base"]
    hf = run / "hf"  # the end-of-run export
    adapter = load_file(hf / "adapter" / "adapter_model.safetensors")
    assert json.loads((hf / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in adapter.items())  # B starts at 0: it trained
    merged = AutoModelForCausalLM.from_pretrained(hf).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), hf / "adapter").eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-5)
    # The base under the adapters is the pretrained folder, untouched: the merged model reproduces the loss the
    # trainer measured after its last step.
    final = [e for e in events(run) if e["event"] == "finished"][-1]
    assert _batch_loss(merged, [final["next_batch"]]) == pytest.approx(final["next_batch_loss"], abs=1e-5)


@pytest.mark.deepspeed
def test_zero3_with_recompute_resumes_on_another_world_size(tmp_path: Path) -> None:
    """ZeRO-3 (PEFT's layers added after zero.Init), activation checkpointing on a frozen base; 2 ranks to 1
    through a universal checkpoint; `hpctrain export --tag` of the 2-rank checkpoint predicts the first
    resumed step's loss, so the adapters and their optimizer came back."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = _base(tmp_path)
    common: dict[str, Any] = {"parallel": {"zero": 3}, "checkpoint": {"every_steps": 4, "export_hf": False}}
    run = _lora_run(tmp_path / "run", base, train={"steps": 4, "lr": 1e-2, "activation_checkpointing": True},
                    **common)
    _ok(torchrun(run, 2))
    keys, elements = _checkpoint_tensors(run / "checkpoints" / "step-4")
    assert all(".lora_" in k for k in keys) and elements < BASE_PARAMS / 2
    out = tmp_path / "step4"
    res = subprocess.run([sys.executable, "-m", "hpctrain", "export", str(run), "--tag", "step-4", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, check=False)
    _ok(res)
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    first = [v for k, v in adapter.items() if ".layers.0." in k and ".lora_B." in k]
    assert first and all(v.abs().sum() > 0 for v in first)  # recompute passed gradients down to the first block
    _lora_run(run, base, train={"steps": 5, "lr": 1e-2, "activation_checkpointing": True}, **common)
    _ok(torchrun(run, 1))
    loss = losses_by_step(run)
    assert sorted(loss) == [1, 2, 3, 4, 5] and loss[4] < loss[1]
    assert (run / "checkpoints" / "universal-step-4").is_dir()
    # One rank, micro 2 x accum 2: step 5 reads micro-batches 16 and 17 (cursor 4 steps x 2 x 2 ranks).
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert _batch_loss(merged, [16, 17]) == pytest.approx(loss[5], abs=1e-5)


@pytest.mark.deepspeed
def test_qlora_on_cpu_ranks_resumes_on_another_world_size_and_exports(tmp_path: Path) -> None:
    """QLoRA (quantize = "4bit": bitsandbytes NF4 base layers, its CPU kernels) on 2 CPU ranks under ZeRO-2: the
    base really is 4-bit, checkpoints hold the adapters alone, 2 ranks resume on 1 through a universal checkpoint,
    and the export merges the adapters into the unquantized base exactly as PEFT applies them to it."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _base(tmp_path)
    common: dict[str, Any] = {"model": {"config": "", "path": str(base)}, "lora": {**LORA, "quantize": "4bit"},
                              "parallel": {"zero": 2}, "checkpoint": {"every_steps": 4, "export_hf": False}}
    run = make_run(tmp_path / "run", train={"steps": 4, "lr": 1e-2, "precision": "bf16"}, **common)
    _ok(torchrun(run, 2))
    log = (run / "logs" / "attempt-0.rank-0.log").read_text()
    quantized = re.search(r"LoRA r=4 alpha=8 on .*: (\d+) trainable parameters of (\d+)", log)
    assert quantized, log[-3000:]
    # 4-bit: the base's block linears count half their weights (two 4-bit values a byte), so the total is less
    # than the full-precision base's.
    assert int(quantized.group(2)) < BASE_PARAMS
    keys, elements = _checkpoint_tensors(run / "checkpoints" / "step-4")
    assert keys and all(".lora_" in k for k in keys) and elements < BASE_PARAMS / 2
    make_run(run, train={"steps": 5, "lr": 1e-2, "precision": "bf16"}, **common)
    _ok(torchrun(run, 1))
    loss = losses_by_step(run)
    assert sorted(loss) == [1, 2, 3, 4, 5] and all(math.isfinite(v) for v in loss.values())
    assert (run / "checkpoints" / "universal-step-4").is_dir()
    out = tmp_path / "export"
    res = subprocess.run([sys.executable, "-m", "hpctrain", "export", str(run), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, check=False)
    _ok(res)
    ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        before = plain(ids).logits
        adapted = PeftModel.from_pretrained(plain, out / "adapter").eval()(ids).logits
    assert (adapted - before).abs().max() > 1e-3  # the adapters trained
    assert (merged - adapted).abs().max() < 1e-4


def test_checkpoint_of_the_other_kind_is_refused(tmp_path: Path) -> None:
    """A full fine-tune's checkpoint cannot resume as LoRA, nor the reverse: one message naming the fix
    (Checkpointer.load checks it on every rank before DeepSpeed reads a file)."""
    pytest.importorskip("torch")
    from hpctrain.node.checkpointing import checkpoint as ckpt
    from hpctrain.node.runconf import NodeInputError

    lora_point = ckpt.ResumePoint("step-4", tmp_path / "step-4", {"step": 4, "adapters": True})
    full_point = ckpt.ResumePoint("step-4", tmp_path / "step-4", {"step": 4})
    ckpt.check_adapters(lora_point, True)
    ckpt.check_adapters(full_point, False)
    with pytest.raises(NodeInputError, match=r"written by a LoRA run, and this run is a full fine-tune .* Fix:"):
        ckpt.check_adapters(lora_point, False)
    with pytest.raises(NodeInputError, match=r"written by a full fine-tune run, and this run is LoRA"):
        ckpt.check_adapters(full_point, True)


# ------------------------------------------------------------------------------------------- planner
def _spec(tmp_path: Path, lora: dict[str, Any], **sections: Any) -> Any:
    from hpctrain.spec import presets
    from hpctrain.spec.model import from_toml_text

    (tmp_path / "config.json").write_text(json.dumps(presets.preset_config("llama-8b")))
    tables = tiny_tables(model={"config": "", "path": str(tmp_path)}, lora=lora, **sections)
    return from_toml_text(spec_toml(tables))


GPU_8B = {"resources": {"nodes": 1, "gpus_per_node": 1, "tasks_per_node": 1, "gpu_mem_gb": 80, "mem": "500G"},
          "data": {"source": "synthetic", "seq_len": 4096},
          "train": {"micro_batch": 1, "grad_accum": 8, "precision": "bf16"}, "parallel": {"zero": "auto"}}


def test_lora_param_count_is_r_times_in_plus_out() -> None:
    from hpctrain.plan.memory import lora_param_count
    from hpctrain.plan.planner import model_arch
    from hpctrain.spec import presets

    a = model_arch(presets.preset_config("llama-8b"))
    assert lora_param_count(a, 16) == 41_943_040  # PEFT's count for Llama-3-8B, r=16, all linear layers
    assert lora_param_count(a, 8, ("q_proj", "v_proj")) == 32 * 8 * ((4096 + 4096) + (4096 + 1024))


def test_planner_lora_8b_fits_one_gpu_without_offload(tmp_path: Path) -> None:
    from hpctrain.plan.planner import make_plan

    full = make_plan(_spec(tmp_path, {"r": 0}, **GPU_8B))
    lora = make_plan(_spec(tmp_path, {"r": 16}, **GPU_8B))
    assert full.offload != "none"  # a full fine-tune of 8B needs offload on one 80 GB GPU
    assert (lora.zero_stage, lora.offload) == (0, "none") and lora.memory["fits"]
    b = lora.memory["breakdown"]
    assert 14.5 < b["weights"] < 15.5  # the frozen bf16 base (8.03 B x 2 bytes), weights only
    assert b["optimizer"] < 0.6 and b["grads"] < 0.1  # 42 M adapters: fp32 master + m + v, bf16 gradients
    assert lora.memory["lora_params"] == 41_943_040
    assert any(r.startswith("LoRA r=16") and "41.9 M adapter parameters" in r for r in lora.reasons)
    qlora = make_plan(_spec(tmp_path, {"r": 16, "quantize": "4bit"}, **GPU_8B))
    assert qlora.memory["breakdown"]["weights"] < 6  # NF4 blocks + bf16 embeddings and head
    assert qlora.zero_stage < 3 and qlora.offload == "none"


def test_planner_lora_zero3_counts_adapter_state_only(tmp_path: Path) -> None:
    from hpctrain.plan.planner import make_plan

    tables = {**GPU_8B, "resources": {**GPU_8B["resources"], "gpus_per_node": 4, "tasks_per_node": 4},
              "parallel": {"zero": 3}}
    full, lora = make_plan(_spec(tmp_path, {"r": 0}, **tables)), make_plan(_spec(tmp_path, {"r": 16}, **tables))
    fb, lb = full.memory["breakdown"], lora.memory["breakdown"]
    assert lb["weights"] == pytest.approx(fb["weights"] * (1 + 41_943_040 / full.param_count), rel=1e-3)
    assert lb["optimizer"] < fb["optimizer"] / 100 and lb["step_transient"] < fb["step_transient"] / 10


@pytest.mark.parametrize(("lora", "measured_gb"), [({"r": 16}, 17.992), ({"r": 16, "quantize": "4bit"}, 16.548)],
                         ids=["lora", "qlora"])
def test_planner_lora_matches_the_h200_peaks(tmp_path: Path, lora: dict[str, Any], measured_gb: float) -> None:
    """torch.cuda.max_memory_allocated of hpctrain's node on one H200 (2026-12-02; Llama-3.2-1B shape, random
    weights, r = 16, dropout 0.05, ZeRO-2, bf16, micro 2 x 2048 tokens, no recompute): the estimate without
    the CUDA runtime term, within 3%."""
    from hpctrain.plan.memory import GiB
    from hpctrain.plan.planner import make_plan
    from hpctrain.spec import presets
    from hpctrain.spec.model import from_toml_text

    (tmp_path / "config.json").write_text(json.dumps(presets.preset_config("llama-1b")))
    tables = tiny_tables(model={"config": "", "path": str(tmp_path)}, lora=lora,
                         resources={"nodes": 1, "gpus_per_node": 1, "tasks_per_node": 1, "gpu_mem_gb": 78},
                         data={"source": "synthetic", "seq_len": 2048},
                         train={"micro_batch": 2, "grad_accum": 1, "precision": "bf16",
                                "activation_checkpointing": False}, parallel={"zero": 2})
    plan = make_plan(from_toml_text(spec_toml(tables)))
    predicted = (plan.memory["per_rank_gb"] - plan.memory["breakdown"]["runtime"]) * GiB / 1e9
    assert predicted == pytest.approx(measured_gb, rel=0.03)


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("lora", "sections", "field", "fix"), [
    ({"r": 8, "quantize": "4bit"}, {"resources": {"gpus_per_node": 2}}, "parallel.zero = 3", "--zero 2"),
    ({"r": 8, "quantize": "4bit"}, {"resources": {"gpus_per_node": 2}, "parallel": {"zero": 2, "offload": "optimizer"}},
     "parallel.offload = 'optimizer'", "--offload none"),
    ({"r": 8}, {"parallel": {"zero": 1, "pp": 2}}, "parallel.pp = 2", "pp = 1"),
    ({"r": 8}, {"model": {"freeze": ["model.embed_tokens.*"]}}, "model.freeze", "remove [model] freeze"),
    ({"r": 0, "quantize": "4bit"}, {}, "lora.quantize = '4bit'", "lora.r"),
    ({"r": 8, "alpha": -1.0}, {}, "lora.alpha = -1.0", "alpha = 0"),
])
def test_submit_refuses_what_cannot_run(tmp_path: Path, lora: dict[str, Any], sections: dict[str, Any], field: str,
                                        fix: str) -> None:
    from hpctrain.spec.model import from_toml_text

    model = {"config": "", "path": str(tmp_path), **sections.pop("model", {})}
    with pytest.raises(HpcUsageError) as err:
        from_toml_text(spec_toml(tiny_tables(model=model, lora=lora, **sections)))
    assert str(err.value).startswith(field) and "Fix:" in str(err.value) and fix in str(err.value)


def test_lora_needs_a_pretrained_model() -> None:
    from hpctrain.spec.model import from_toml_text

    with pytest.raises(HpcUsageError, match=r"^lora.r = 8: LoRA adapts a pretrained model .* Fix: pass --model DIR"):
        from_toml_text(spec_toml(tiny_tables(lora={"r": 8})))
