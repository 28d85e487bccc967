"""Pipeline parallel for the Llama family: embed | decoder layers | norm + head as DeepSpeed LayerSpecs.

LayerSpec builds only the layers of this rank's stage, so a pipeline stage never materialises the whole
model. Activations between stages are the hidden states alone: positions are recomputed per stage and
attention is plain causal, so batches are full rows (padded mode; packing needs per-row positions).
Tied input/output embeddings are untied here (TiedLayerSpec would add a cross-stage all-reduce).
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.node.data.loader import IGNORE


class EmbedPipe(nn.Module):  # type: ignore[misc]  # torch is not type-checked (pyproject: mypy)
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=cfg.initializer_range)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderPipe(nn.Module):  # type: ignore[misc]
    def __init__(self, cfg: Any, index: int) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        self.layer = LlamaDecoderLayer(cfg, index)
        self.rotary = LlamaRotaryEmbedding(config=cfg)
        for m in self.layer.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.initializer_range)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        pe = self.rotary(hidden, position_ids=pos)
        out = self.layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, tuple) else out


class HeadPipe(nn.Module):  # type: ignore[misc]
    def __init__(self, cfg: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=cfg.initializer_range)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss HF's causal LMs compute: predict token t+1 at position t, ignoring -100."""
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                       labels[:, 1:].reshape(-1), ignore_index=IGNORE)


def build_pipeline(cfg: Any, num_stages: int, activation_checkpointing: bool) -> Any:
    """The PipelineModule; raises ValueError for a model family it does not know."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    if cfg.model_type not in ("llama",):
        raise ValueError(f"pipeline parallel supports the Llama family only (model_type {cfg.model_type!r})")
    cfg.tie_word_embeddings = False
    layers = [LayerSpec(EmbedPipe, cfg)]
    layers += [LayerSpec(DecoderPipe, cfg, i) for i in range(cfg.num_hidden_layers)]
    layers.append(LayerSpec(HeadPipe, cfg))
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=causal_lm_loss,
                          partition_method="parameters",
                          activation_checkpoint_interval=1 if activation_checkpointing else 0)


def hf_name(layer_idx: int, local: str, num_layers: int) -> str:
    """Pipeline layer index + parameter name -> the Hugging Face LlamaForCausalLM name."""
    if layer_idx == 0:
        return "model." + local
    if layer_idx <= num_layers:
        return f"model.layers.{layer_idx - 1}." + local.removeprefix("layer.")
    return local if local.startswith("lm_head") else "model." + local


def pipe_name(hf: str, num_layers: int) -> tuple[int, str]:
    """Inverse of hf_name."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", hf)
    if m:
        return int(m.group(1)) + 1, "layer." + m.group(2)
    if hf.startswith("model.embed_tokens"):
        return 0, hf.removeprefix("model.")
    return num_layers + 1, hf.removeprefix("model.")


def load_pretrained_into(module: Any, path: str, num_layers: int) -> None:
    """Copy a local HF folder's weights into this stage's layers (reads only the tensors it needs)."""
    from safetensors import safe_open

    files = sorted(glob.glob(str(Path(path) / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: pipeline parallel loads *.safetensors weights only")
    tied = json.loads((Path(path) / "config.json").read_text()).get("tie_word_embeddings", False)
    layers = dict(zip(range(module._local_start, module._local_stop), module.forward_funcs, strict=True))
    sources: dict[str, list[tuple[int, str]]] = {}  # HF tensor name -> destinations in this stage
    for idx, layer in layers.items():
        for local in layer.state_dict():
            name = hf_name(idx, local, num_layers)
            if tied and name == "lm_head.weight":
                name = "model.embed_tokens.weight"
            sources.setdefault(name, []).append((idx, local))
    with torch.no_grad():
        for f in files:
            with safe_open(f, framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                    for idx, local in sources.get(key, []):
                        dst = layers[idx].state_dict()[local]
                        dst.copy_(fh.get_tensor(key).to(dst.dtype))
