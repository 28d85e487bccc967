"""Tiny Hugging Face causal-LM folders of the common families, and a multi-rank loader that digests them.

`make_folder` writes what `save_pretrained` writes for a tiny model of one family (random weights, so every
tensor differs from any init). Run as a script under torchrun, this module loads folders through hpctrain's
own `build_model` under ZeRO-3 and writes, from rank 0, a sha256 of every parameter (gathered) and buffer,
or the NodeInputError a folder raised. An item `zero1=FOLDER:PRECISION` (or `zero2=`) instead builds the model
as the node does for ZeRO 0-2 (from_pretrained) and runs `deepspeed.initialize` with the ds_config a run at that
stage renders; every rank digests engine.module and its optimizer's fp32 master partition (`engine_digests`):

    python -m torch.distributed.run --nproc-per-node 2 tests/familykit.py OUT.json [zero1=]FOLDER:PRECISION ...
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# hidden 32-64, 2 layers, a small vocabulary; odd sizes where a family allows them (explicit head_dim), so
# ZeRO-3's padded last partition is exercised too.
_SMALL: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 128}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}

FAMILIES: dict[str, dict[str, Any]] = {
    # config.json as a real Llama-3 folder writes it: the legacy rope_scaling / rope_theta keys, pad_token_id
    "llama3": {"model_type": "llama", "pad_token_id": 0, "tie_word_embeddings": False,
               "legacy_json": {"rope_scaling": _LLAMA3_ROPE, "rope_theta": 500000.0}},
    "llama-yarn-tied": {"model_type": "llama", "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
                        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32}},
    "mistral": {"model_type": "mistral", "sliding_window": 16, "head_dim": 16, "hidden_size": 48,
                "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True, "use_sliding_window": False},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "hidden_size": 33, "vocab_size": 97,
              "tie_word_embeddings": True},  # q/k norms; 33 x 97: odd sizes, a padded last partition
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "pad_token_id": 0, "sliding_window": 16,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 16},
    "phi3": {"model_type": "phi3", "pad_token_id": 95, "bos_token_id": 1, "eos_token_id": 2,
             "tie_word_embeddings": False},  # fused qkv_proj and gate_up_proj
    # GPT-2: Conv1D layers (weights stored [in, out]), learned positions, a tied head, LayerNorm biases
    "gpt2": {"model_type": "gpt2", "tie_word_embeddings": True},
    # GPT-NeoX (Pythia): partial rotary, parallel residual; its head is `embed_out` on disk, `lm_head` in the model
    "gpt_neox": {"model_type": "gpt_neox", "rotary_pct": 0.25, "tie_word_embeddings": False},
    "gemma": {"model_type": "gemma", "head_dim": 16, "pad_token_id": 0},  # scaled embedding, tied head
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 16, "pad_token_id": 0, "sliding_window": 16,
                    "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0},  # local/global layers, two RoPEs
    "olmo2": {"model_type": "olmo2", "pad_token_id": 1, "tie_word_embeddings": False},  # q/k norms, post-norms
    "phi": {"model_type": "phi", "partial_rotary_factor": 0.5, "tie_word_embeddings": False},  # phi-2: biases, dense
    "starcoder2": {"model_type": "starcoder2", "use_bias": True, "sliding_window": 16},
    "granite": {"model_type": "granite", "embedding_multiplier": 12.0, "logits_scaling": 8.0,
                "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "tie_word_embeddings": True},
    "falcon": {"model_type": "falcon", "new_decoder_architecture": True, "num_kv_heads": 2, "bias": False},
    "stablelm": {"model_type": "stablelm", "partial_rotary_factor": 0.25, "use_qkv_bias": True,
                 "tie_word_embeddings": False},
    # MoE: one tensor per expert on disk, fused [experts, 2 x intermediate, hidden] in the model
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": False},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "tie_word_embeddings": False},
}


def family_config(name: str) -> Any:
    """The transformers config of one family, tiny."""
    from transformers import AutoConfig

    body = {**_SMALL, **{k: v for k, v in FAMILIES[name].items() if k != "legacy_json"}}
    return AutoConfig.for_model(body.pop("model_type"), **body)


def make_folder(root: Path, name: str, *, max_shard_size: str | None = None, dtype: str = "float32",
                seed: int = 0) -> Path:
    """save_pretrained of a tiny `name` model with random (not freshly initialised) weights; returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5)  # norms and biases too: a load that leaves one at its init shows
    model = model.to(getattr(torch, dtype))
    out = root / name
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    legacy = FAMILIES[name].get("legacy_json")
    if legacy:
        cfg = json.loads((out / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        (out / "config.json").write_text(json.dumps({**cfg, **legacy}, indent=2))
    return out


def digest(t: Any) -> str:
    """sha256 of a tensor's bytes (dtype-exact)."""
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def file_digests(folder: Path, dtype: Any) -> dict[str, str]:
    """The digest of every tensor the folder's safetensors hold, cast to `dtype` (the model's), under the model's
    names (`model_names`)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return {k: digest(v.to(dtype)) for k, v in model_names(tensors).items()}


_EXPERT = re.compile(r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_GATE, _UP, _DOWN = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")


def _pick(tensors: dict[str, Any], names: tuple[str, str]) -> Any:
    return next(tensors[n] for n in names if n in tensors)


def model_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """The stored tensors as transformers 5's modules hold them, written out by hand (not with transformers'
    conversion list, which the loader uses): GPT-NeoX's `embed_out` is `lm_head`; Mixtral's `block_sparse_moe` is
    `mlp`; the experts of a layer are stacked, gate and up concatenated: gate_up_proj [E, 2I, H], down_proj
    [E, H, I]."""
    import torch

    out: dict[str, Any] = {}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for key, t in tensors.items():
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
            continue
        key = {"embed_out.weight": "lm_head.weight"}.get(key, key).replace(".block_sparse_moe.", ".mlp.")
        out[key] = t
    for layer, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([_pick(d, _GATE), _pick(d, _UP)])
                                                                for d in order])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([_pick(d, _DOWN) for d in order])
    return out


def model_digests(model: Any, zero3: bool) -> dict[str, dict[str, str]]:
    """Every parameter (each tied name too) gathered whole, and every buffer."""
    import contextlib

    params: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if zero3:
            import deepspeed

            ctx: Any = deepspeed.zero.GatheredParameters([p])
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            params[name] = digest(p.data)
    return {"params": params, "buffers": {n: digest(b) for n, b in model.named_buffers()}}


def _fresh_stats(model: Any) -> dict[str, Any]:
    """A freshly initialised ZeRO-3 model's embedding and first query projection, gathered."""
    import deepspeed

    emb = model.get_input_embeddings()
    q = model.model.layers[0].self_attn.q_proj.weight
    with deepspeed.zero.GatheredParameters([emb.weight, q]):
        pad = emb.weight.data[emb.padding_idx]
        stats = {"pad_row_abs_max": float(pad.abs().max()), "embed_std": float(emb.weight.data.float().std()),
                 "q_proj_std": float(q.data.float().std())}
    return {"stats": stats}


def stage_ds_config(folder: str, precision: str, stage: int) -> dict[str, Any]:
    """The ds_config `deepspeed.initialize` gets on the node for a 2-rank CPU run of `folder` at ZeRO `stage`:
    rendered at submit (build_ds_config of the resolved spec and its plan), then the node's allocation edits."""
    from hpctrain.node.runconf import effective_ds_config
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.deepspeed import build_ds_config
    from hpctrain.spec.model import resolve

    flags = {"model.path": folder, "model.config": "", "resources.tasks_per_node": 2, "resources.gpus_per_node": 0,
             "parallel.zero": stage, "train.precision": precision, "train.micro_batch": 1, "train.grad_accum": 1,
             "data.seq_len": 32, "tracking.backends": "none"}  # no monitor: it would write into the cwd
    spec = resolve(None, flags, check=False)
    cfg, _ = effective_ds_config(build_ds_config(spec, make_plan(spec)), dp=2, universal=False, use_gpu=False)
    return cfg


def _master(engine: Any) -> dict[str, Any]:
    """This rank's share of the optimizer's fp32 master weights: the flat partition its optimizer steps
    (`flat`, padding included), the parameter elements mapped into it (`mapped`), and the parameters whose
    mapped fragment is not exactly the module's value there, in fp32 (`differs`)."""
    import torch

    inner = engine.optimizer.optimizer  # the torch AdamW DeepSpeed wraps: it holds only this rank's partition
    flat = sum(p.numel() for g in inner.param_groups for p in g["params"])
    mapped, differs = 0, []
    for name, p in engine.module.named_parameters():
        link = getattr(p, "_hp_mapping", None)  # set by DeepSpeed where this rank's partition covers `p`
        if link is None:
            continue
        hp, at = link.get_hp_fragment(), link.lp_fragment_address
        mapped += hp.numel()
        if not torch.equal(hp, p.data.reshape(-1).narrow(0, at.start, at.numel).float()):
            differs.append(name)
    return {"optimizer": type(engine.optimizer).__name__, "stage": engine.zero_optimization_stage(),
            "elements": sum(p.numel() for p in engine.module.parameters()), "flat": flat, "mapped": mapped,
            "differs": differs}


def engine_digests(folder: str, precision: str, stage: int) -> dict[str, Any]:
    """ZeRO 1/2 as the node runs it: build_model's from_pretrained, then deepspeed.initialize (which casts the
    module to bf16 under bf16 and broadcasts rank 0's weights); engine.module's digests and `_master`."""
    from types import SimpleNamespace

    import deepspeed

    from hpctrain.node.model.build import build_model, hf_config

    cfg = stage_ds_config(folder, precision, stage)
    spec = SimpleNamespace(path=folder, config="", overrides={}, freeze=())
    model = build_model(spec, hf_config(spec), precision, cfg, zero3=False)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    # No gc.collect() after it (its reference cycles hold a few tiny models): a full collection in a process
    # that imported torch, DeepSpeed and transformers cost 0.95 CPU-s, six times the engine's build.
    return {**model_digests(engine.module, zero3=False), **_master(engine)}


def _zero3_config(precision: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


_STAGE = re.compile(r"^zero([12])=")
OWN_ARANGE = "own-arange="  # as if transformers had no prevent_arange_dtype_change (5.17): hpctrain's own patch


@contextlib.contextmanager
def _without_transformers_arange(hide: bool) -> Iterator[None]:
    import transformers.integrations.deepspeed as tds

    saved = tds.__dict__.pop("prevent_arange_dtype_change") if hide else None
    try:
        yield
    finally:
        if saved is not None:
            tds.prevent_arange_dtype_change = saved


def main(argv: list[str]) -> None:
    """torchrun entry: load each FOLDER:PRECISION with build_model under ZeRO-3, each zeroN=FOLDER:PRECISION
    through a ZeRO-N engine (every rank's result, in rank order); rank 0 writes the digests."""
    import gc
    import os
    import resource
    from types import SimpleNamespace

    import torch

    from hpctrain.node import dist
    from hpctrain.node.model.build import build_model, hf_config
    from hpctrain.node.runconf import NodeInputError

    dist.init_process_group(dist.detect(), use_gpu=False, timeout_min=3)  # gloo, without the shm op's JIT build
    import transformers.modeling_utils  # noqa: F401  (before the freeze below)

    # The objects torch, DeepSpeed and transformers made on import live as long as the process: frozen, the full
    # collections build_model's ZeRO-3 tie runs (and DeepSpeed's) skip them, ~0.9 CPU-s each in this process.
    gc.freeze()
    results: dict[str, Any] = {}
    for item in argv[1:]:
        stage = _STAGE.match(item)
        if stage:
            mine = engine_digests(*item[stage.end():].rsplit(":", 1), int(stage[1]))
            ranks: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, mine)
            results[item] = {"ranks": ranks}
            continue
        folder, precision = item.removeprefix("fresh=").removeprefix(OWN_ARANGE).rsplit(":", 1)
        fresh = item.startswith("fresh=")  # a new model from the folder's config.json, not its weights
        spec = SimpleNamespace(path="" if fresh else folder, config=folder if fresh else "", overrides={}, freeze=())
        try:
            with _without_transformers_arange(item.startswith(OWN_ARANGE)):
                model = build_model(spec, hf_config(spec), precision, _zero3_config(precision), zero3=True)
        except NodeInputError as exc:
            results[item] = {"error": str(exc)}
            continue
        results[item] = _fresh_stats(model) if fresh else model_digests(model, zero3=True)
        results[item]["partitioned"] = all(p.data.numel() == 0 for p in model.parameters())
        del model
    results["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.distributed.barrier()
    if int(os.environ["RANK"]) == 0:
        Path(argv[0]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
