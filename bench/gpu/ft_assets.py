"""What the fine-tuning benchmark needs, made on the machine that runs it (no network there):

* a local model folder of a Llama shape with random bf16 weights: config.json (with pad/bos/eos ids) plus sharded
  safetensors and their index, written shard by shard from `torch.device("meta")` shapes, so the host never holds
  more than one shard (Llama-3.1-8B: 16 GB on disk, ~2 GB of host memory at a time);
* a byte-level BPE tokenizer saved with `PreTrainedTokenizerFast.save_pretrained` beside the weights, with a
  simple chat_template. Its vocabulary is the model's exactly (128,256 for the 8B shape): a small BPE trained on
  the synthetic corpus, its merges extended with pairs of existing tokens until the size matches;
* SFT data, the same examples as `chat.jsonl` (OpenAI-style `messages`) and `alpaca.jsonl` (instruction, input,
  output): prompts and responses of log-normal token lengths (mean ~280 tokens an example at the 8B vocabulary,
  median ~210, p99 ~1,400, a long tail);
* `assets.json`: what was made, with the data's token counts (total, response) under the chat template.

    python bench/gpu/ft_assets.py --model llama-8b --out /tmp/ft-assets        # on the device
    python bench/gpu/ft_assets.py --model llama-tiny --out /tmp/ft-assets      # CPU smoke size
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

# Llama 3.1 8B's shape (and a tiny one for the CPU); the vocabulary comes from --vocab.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 8192},
    "llama-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 2048},
}
VOCAB = {"llama-8b": 128256, "llama-1b": 128256, "llama-tiny": 512}
SPECIALS = ["<|pad|>", "<|begin_of_text|>", "<|eot|>", "<|start|>"]
BOS, EOS, PAD = "<|begin_of_text|>", "<|eot|>", "<|pad|>"
# The assistant turns inside {% generation %} so transformers can also return an assistant-token mask.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|eot|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")


# -------------------------------------------------------------------------------------------- text
class Words:
    """A synthetic language: syllable words drawn with Zipf frequencies (a long-tailed lexicon, like prose)."""

    def __init__(self, seed: int, n_words: int = 40000) -> None:
        rng = np.random.default_rng(seed)
        cons, vows = list("bcdfghjklmnprstvwz"), list("aeiou")
        syl = [c + v for c in cons for v in vows] + [c + v + "n" for c in cons[:8] for v in vows]
        lens = rng.choice([1, 2, 2, 3, 3, 4], size=n_words)
        words = {"".join(rng.choice(syl, size=int(k))) for k in lens}
        self.lex = rng.permutation(np.array(sorted(words)))  # Zipf ranks unrelated to spelling
        rank = np.arange(1, len(self.lex) + 1, dtype=np.float64)
        p = 1.0 / rank**1.1
        self.p = p / p.sum()
        self.rng = rng

    def text(self, n: int) -> str:
        ws = self.rng.choice(self.lex, size=max(1, n), p=self.p)
        out, sentence = [], 0
        for w in ws:
            sentence += 1
            if sentence > 8 and self.rng.random() < 0.15:
                out.append(w + ".")
                sentence = 0
            else:
                out.append(w)
        return " ".join(out)


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """n lengths with this mean (log-normal: most short, a long tail), clipped to [lo, hi]."""
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(rng.lognormal(mu, sigma, size=n), lo, hi).astype(int)


# -------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(out: Path, vocab: int, words: Words) -> Any:
    """A byte-level BPE of exactly `vocab` ids, saved as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    base = min(vocab, 8000)
    trainer = trainers.BpeTrainer(vocab_size=base, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((words.text(200) for _ in range(3000)), trainer)
    data = json.loads(tok.to_str())
    model = data["model"]
    ids: dict[str, int] = model["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Extend to the model's vocabulary: merges of two existing tokens (valid BPE, rarely produced), so the
    # tokenizer's ids are exactly the embedding's rows.
    pieces = [t for t, _ in sorted(ids.items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    i = 0
    while len(ids) < vocab:
        a = pieces[i % len(pieces)]
        for b in pieces[:64]:
            if len(ids) >= vocab:
                break
            if a + b not in ids:
                ids[a + b] = len(ids)
                merges.append((a, b))
        i += 1
    model["vocab"], model["merges"] = ids, [list(m) for m in merges]
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token=BOS,
                                   eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == vocab, (len(fast), vocab)
    fast.save_pretrained(str(out))
    return fast


# -------------------------------------------------------------------------------------------- weights
def write_model(out: Path, shape: str, vocab: int, tok: Any, *, shard_gb: float = 2.0, seed: int = 0,
                device: str = "auto") -> dict[str, Any]:
    """config.json + model-0000K-of-0000N.safetensors + index: random bf16 weights (std 0.02, norms 1), made one
    tensor at a time (on the GPU where there is one: 8 B normal draws on the host take minutes)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-5,
                      initializer_range=0.02, use_cache=False, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SHAPES[shape])
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(str(out))
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    tensors = [(n, tuple(p.shape)) for n, p in meta.named_parameters()]
    del meta
    limit = shard_gb * 1e9
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0.0
    for name, shp in tensors:
        nbytes = 2.0 * math.prod(shp)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0.0
        shards[-1].append((name, shp))
        size += nbytes
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    gen = torch.Generator(device=dev).manual_seed(seed)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        body = {}
        for name, shp in shard:
            if name.endswith("norm.weight"):
                t = torch.ones(shp, dtype=torch.bfloat16)
            else:
                t = torch.empty(shp, dtype=torch.bfloat16, device=dev).normal_(0.0, 0.02, generator=gen).cpu()
            body[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(body, str(out / fname), metadata={"format": "pt"})
        del body
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"params": sum(math.prod(s) for _, s in tensors), "bytes": total, "shards": len(shards), "device": dev}


# -------------------------------------------------------------------------------------------- data
def write_data(out: Path, tok: Any, words: Words, n: int, *, prompt_mean: float, resp_mean: float,
               max_tokens: int, seed: int) -> dict[str, Any]:
    """chat.jsonl and alpaca.jsonl (the same examples); token counts measured with the tokenizer."""
    rng = np.random.default_rng(seed + 1)
    # Tokens per word of this language under this tokenizer (to aim the word counts at token lengths).
    sample = words.text(2000)
    per_word = len(tok(sample, add_special_tokens=False)["input_ids"]) / 2000
    p_len = lognormal_lengths(rng, n, prompt_mean, 0.9, 4, max_tokens // 2)
    r_len = lognormal_lengths(rng, n, resp_mean, 1.0, 2, max_tokens)
    chat, alpaca, fulls, heads = [], [], [], []
    for i in range(n):
        prompt = words.text(int(p_len[i] / per_word))
        answer = words.text(int(r_len[i] / per_word))
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        if i % 5 == 0:  # some examples carry a system turn, as chat data does
            msgs.insert(0, {"role": "system", "content": words.text(12)})
        chat.append(json.dumps({"messages": msgs}))
        alpaca.append(json.dumps({"instruction": prompt, "input": "", "output": answer}))
        fulls.append(tok.apply_chat_template(msgs, tokenize=False))
        heads.append(tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True))
    # Batch encoding runs in the tokenizer's Rust threads (6,000 examples one by one took minutes on 2 cores).
    total = [len(x) for x in tok(fulls, add_special_tokens=False)["input_ids"]]
    resp = [t - len(h) for t, h in zip(total, tok(heads, add_special_tokens=False)["input_ids"], strict=True)]
    (out / "chat.jsonl").write_text("\n".join(chat) + "\n")
    (out / "alpaca.jsonl").write_text("\n".join(alpaca) + "\n")
    tot, rsp = np.array(total), np.array(resp)
    return {"examples": n, "tokens": int(tot.sum()), "response_tokens": int(rsp.sum()),
            "mean_tokens": round(float(tot.mean()), 1), "median_tokens": int(np.median(tot)),
            "p99_tokens": int(np.percentile(tot, 99)), "max_tokens": int(tot.max()),
            "mean_response_tokens": round(float(rsp.mean()), 1),
            "response_frac": round(float(rsp.sum() / tot.sum()), 4)}


def build(out: Path, model: str, *, examples: int, prompt_mean: float = 80.0, resp_mean: float = 180.0,
          seq: int = 4096, seed: int = 0, weights: bool = True) -> dict[str, Any]:
    """The model folder (out/model), the data (out/chat.jsonl, out/alpaca.jsonl) and out/assets.json."""
    t0 = time.time()
    folder = out / "model"
    folder.mkdir(parents=True, exist_ok=True)
    words = Words(seed)
    tok = build_tokenizer(folder, VOCAB[model], words)
    t_tok = time.time()
    info: dict[str, Any] = {"model": model, "vocab": len(tok), "folder": str(folder),
                            "tokenizer_s": round(t_tok - t0, 1)}
    if weights:
        info.update(write_model(folder, model, VOCAB[model], tok, seed=seed))
    t_w = time.time()
    info["weights_s"] = round(t_w - t_tok, 1)
    info["data"] = write_data(out, tok, words, examples, prompt_mean=prompt_mean, resp_mean=resp_mean,
                              max_tokens=seq, seed=seed)
    info["data_s"] = round(time.time() - t_w, 1)
    (out / "assets.json").write_text(json.dumps(info, indent=1))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--examples", type=int, default=6000)
    ap.add_argument("--seq", type=int, default=4096, help="longest example (tokens) the lengths are clipped to")
    ap.add_argument("--out", default="/tmp/ft-assets")
    a = ap.parse_args()
    print("ASSETS " + json.dumps(build(Path(a.out), a.model, examples=a.examples, seq=a.seq)), flush=True)


if __name__ == "__main__":
    main()
