"""The model: a Hugging Face causal LM from a local folder or a config, built for DeepSpeed."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hpctrain.node.runconf import NodeInputError

log = logging.getLogger("hpctrain.node")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_model_inputs(model_spec: Any) -> None:
    """Fail fast (before the process group exists) on a model the node cannot build."""
    if bool(model_spec.path) == bool(model_spec.config):
        raise NodeInputError("[model]: set exactly one of path (a local Hugging Face folder) or config "
                             "(a config.json path or a preset name such as \"llama-tiny\").")
    if model_spec.path and not (Path(model_spec.path) / "config.json").is_file():
        raise NodeInputError(f"[model] path = {model_spec.path!r}: no config.json there. Point it at a local folder "
                             "written by save_pretrained (compute nodes are offline: no hub ids).")
    if model_spec.config:
        load_config_dict(model_spec.config)


def load_config_dict(name: str) -> dict[str, Any]:
    """A preset name, or a config.json path (a folder holding one also works)."""
    from hpctrain.spec import presets

    if name in presets.PRESETS:
        return presets.preset_config(name)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise NodeInputError(f"[model] config = {name!r}: neither a preset ({', '.join(sorted(presets.PRESETS))}) "
                             "nor an existing config.json.")
    try:
        return dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise NodeInputError(f"{path}: not valid JSON ({exc.msg}).") from exc


def hf_config(model_spec: Any) -> Any:
    """The transformers config object with the spec's overrides applied."""
    from transformers import AutoConfig

    if model_spec.path:
        cfg = AutoConfig.from_pretrained(model_spec.path, local_files_only=True)
    else:
        d = load_config_dict(model_spec.config)
        d.pop("architectures", None)
        cfg = AutoConfig.for_model(d.pop("model_type", "llama"), **d)
    for key, value in dict(model_spec.overrides).items():
        setattr(cfg, key, value)
    cfg.use_cache = False  # training: no KV cache
    return cfg


def build_model(model_spec: Any, cfg: Any, precision: str, ds_config: dict[str, Any], zero3: bool,
                attn: str = "", device: str = "cpu") -> Any:
    """from_pretrained or from_config, partitioned at construction for ZeRO-3 (no rank holds it whole).
    `attn`: transformers' attn_implementation ("": transformers' default; hpctrain.node.attention).
    `device`: where a fresh model is built without ZeRO-3 ("cuda" on GPU ranks: the current device)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    _import_model_code(cfg)
    dtype = DTYPES[precision]
    if model_spec.path and not zero3:
        with _attention_refused(attn):
            return AutoModelForCausalLM.from_pretrained(model_spec.path, config=cfg, dtype=dtype,
                                                        local_files_only=True, attn_implementation=attn or None)
    # Without ZeRO-3 a GPU rank builds (and initialises) the fresh model on its GPU, as DeepSpeed would move it
    # there anyway: on the host, every rank of a node held the whole model in fp32 (4 N bytes each: 32 GB per
    # rank for 8B) and ran transformers' init twice on the CPU. On the H200 machine (2026-12-02) a Llama-1B
    # ZeRO-0 run of the entrypoint took 60 s start to end against the plain loop's 30 s (which builds on the
    # GPU), with a 7.0 GB host peak against 2.1 GB.
    init = deepspeed.zero.Init(config_dict_or_path=ds_config) if zero3 else torch.device(device)
    with init, _attention_refused(attn):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,  # type: ignore[no-untyped-call]
                                                 attn_implementation=attn or None)
    if model_spec.path:
        # ZeRO-3: fill the partitioned model one tensor at a time (transformers' own ZeRO-3 loading
        # path needs `accelerate`; this needs nothing and never holds more than one tensor whole).
        load_partitioned(model, model_spec.path)
    else:
        reinit_weights(model, zero3)
    return model


@contextlib.contextmanager
def _attention_refused(attn: str) -> Iterator[None]:
    """transformers' refusal of an asked-for attention implementation (its package missing from the image, a
    model without it) as a usage error that names the setting and the fix, not a traceback."""
    try:
        yield
    except (ImportError, ValueError) as exc:
        text = str(exc)
        if not attn or not any(w in text.lower() for w in ("attention", "attn", "sdpa")):
            raise
        raise NodeInputError(f"[model] attention = {attn!r}: transformers cannot use it here ({text.splitlines()[0]}). "
                             "Fix: install its package in the image, or set [model] attention = \"auto\" "
                             "(transformers' default).") from exc


def load_partitioned(model: Any, path: str) -> None:
    """Copy a local folder's *.safetensors weights into a ZeRO-3 partitioned model (rank 0 reads)."""
    import glob

    import deepspeed
    from safetensors import safe_open

    files = sorted(glob.glob(str(Path(path) / "*.safetensors")))
    if not files:
        raise NodeInputError(f"[model] path = {path!r}: no *.safetensors files; ZeRO-3 loads safetensors only. "
                             "Fix: re-save the model with save_pretrained(..., safe_serialization=True).")
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    rank0 = torch.distributed.get_rank() == 0
    loaded: set[str] = set()
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                param = params.get(key)
                if param is None:
                    continue
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                    if rank0:
                        param.copy_(fh.get_tensor(key).to(param.dtype))
                loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise NodeInputError(f"[model] path = {path!r}: the weights lack {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}; is config.json from the same model?")


def _import_model_code(cfg: Any) -> None:
    """Import the model's module (and torch._dynamo, which transformers pulls in) before zero.Init.

    zero.Init patches torch.Tensor.__new__; torch._dynamo imported lazily inside it fails with
    "Signature mismatch ... tensor_pynew".
    """
    import torch._dynamo  # noqa: F401
    from transformers import AutoModelForCausalLM

    try:
        AutoModelForCausalLM._model_mapping[type(cfg)]
    except KeyError:
        pass  # unknown architecture: from_config raises a clear error itself


def reinit_weights(model: Any, zero3: bool) -> None:
    """Re-run HF's weight init with every parameter whole, then tie.

    Under zero.Init the parameters are already partitioned when HF's post_init runs, so its init never
    reaches them and they keep torch's defaults; a tied embedding then starts with std 1 and the first loss
    is ~200 instead of ln(vocab) (seen on the H200 with Llama-1B). Gathering one module at a time keeps
    peak memory at one layer.
    """
    import deepspeed

    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if zero3 else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if not zero3 or torch.distributed.get_rank() == 0:
                model._init_weights(module)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def apply_freeze(model: Any, patterns: tuple[str, ...]) -> int:
    """requires_grad=False for parameters whose name matches any fnmatch pattern; returns how many."""
    if not patterns:
        return 0
    frozen = 0
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        names = [n for n, _ in model.named_parameters()][:8]
        raise NodeInputError(f"[model] freeze = {list(patterns)}: matches no parameter. Names look like: "
                             f"{', '.join(names)} ...")
    return frozen


def param_count(model: Any) -> int:
    """Total parameters, counting ZeRO-3 partitioned ones at full size (ds_numel)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += int(getattr(p, "ds_numel", p.numel()))
    return total


def flops_per_token(cfg: Any, n_params: int, seq_len: int) -> float:
    """Model FLOPs per trained token: 6*N (without the input embedding) + 12*L*H*S attention."""
    emb = cfg.vocab_size * cfg.hidden_size
    tied = getattr(cfg, "tie_word_embeddings", False)
    n = n_params - (0 if tied else emb)
    return float(6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len)
