"""Built-in model presets: Hugging Face config dicts by name (torch-free).

`plan/` (memory estimate, parameter count) and the node trainer (`from_config`) both read these,
so a preset name means the same model on the login node and on the compute node.
Vocabulary sizes are at least 259 so that the byte-level tokenizer (256 bytes + pad/bos/eos) fits.
"""

from __future__ import annotations

from typing import Any

_LLAMA_BASE: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "use_cache": False,
}


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tie: bool,
           max_pos: int = 8192, rope_theta: float = 500000.0) -> dict[str, Any]:
    return {**_LLAMA_BASE, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
            "tie_word_embeddings": tie, "max_position_embeddings": max_pos, "rope_theta": rope_theta}


PRESETS: dict[str, dict[str, Any]] = {
    # Tests and the demo: ~0.2 M parameters, trains at tens of steps/s on one CPU core.
    "llama-tiny": _llama(64, 128, 2, 4, 4, 320, tie=False, max_pos=2048, rope_theta=10000.0),
    "llama-10m": _llama(256, 704, 4, 4, 4, 12000, tie=False),
    "llama-100m": _llama(768, 2048, 8, 12, 12, 32000, tie=False),
    # Shapes of Llama 3.2 1B / 3B and Llama 3.1 8B (random init; GPU benchmarks).
    "llama-1b": _llama(2048, 8192, 16, 32, 8, 128256, tie=True),
    "llama-3b": _llama(3072, 8192, 28, 24, 8, 128256, tie=True),
    "llama-8b": _llama(4096, 14336, 32, 32, 8, 128256, tie=False),
}


def preset_config(name: str) -> dict[str, Any]:
    """A copy of the preset's config dict; raises KeyError listing the valid names."""
    try:
        return dict(PRESETS[name])
    except KeyError:
        valid = ", ".join(sorted(PRESETS))
        raise KeyError(f"unknown model preset {name!r}; valid presets: {valid}") from None


def llama_param_count(cfg: dict[str, Any]) -> int:
    """Parameter count of a Llama-family config dict (embeddings included once if tied)."""
    h, i, n = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    heads, v = int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
    kv = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or h // heads)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * i
    per_layer = attn + mlp + 2 * h
    emb = v * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return n * per_layer + emb + h
