"""Real data for tests, with no downloads: a byte-level BPE tokenizer trained on Python's own standard-library
sources (saved as a PreTrainedTokenizerFast folder), and prepared folders written with hpctrain.data.format
from that text tokenized by that tokenizer."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from hpctrain.data import format as fmt

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_texts(limit: int = 200, min_chars: int = 200) -> list[str]:
    """Source files of the standard library, in a fixed order (one document each)."""
    out: list[str] = []
    for f in sorted(STDLIB.glob("*.py")):
        text = f.read_text(errors="replace")
        if len(text) >= min_chars:
            out.append(text)
        if len(out) >= limit:
            break
    return out


def build_tokenizer(out: Path, vocab_size: int = 512, texts: list[str] | None = None) -> Path:
    """Train a byte-level BPE on stdlib text and save it where AutoTokenizer.from_pretrained(out) finds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts or stdlib_texts(60), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return out


def write_prepared(folder: Path, tokenizer_dir: Path, texts: list[str], *, val_every: int = 0,
                   shard_docs: int = 50) -> fmt.Manifest:
    """Tokenize texts (bos + text + eos) into a prepared folder; every val_every-th document goes to val."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    docs = [np.asarray([tok.bos_token_id, *tok.encode(t, add_special_tokens=False), tok.eos_token_id])
            for t in texts]
    dtype = fmt.dtype_for(len(tok))
    splits = {"train": [d for i, d in enumerate(docs) if not val_every or i % val_every],
              "val": [d for i, d in enumerate(docs) if val_every and i % val_every == 0]}
    written = {}
    for name, ds in splits.items():
        shards = tuple(fmt.write_shard(folder, name, k, ds[i:i + shard_docs], dtype)
                       for k, i in enumerate(range(0, len(ds), shard_docs)))
        written[name] = fmt.Split(tokens=sum(s.tokens for s in shards), documents=len(ds), shards=shards)
    m = fmt.Manifest(vocab_size=len(tok), dtype=dtype, train=written["train"], val=written["val"],
                     bos_id=tok.bos_token_id, eos_id=tok.eos_token_id)
    fmt.write_manifest(folder, m)
    return m


def synthetic_prepared(folder: Path, tokens: int, *, vocab: int = 32_000, median: float = 600.0,
                       sigma: float = 1.0, shard_tokens: int = 100_000_000, seed: int = 0) -> fmt.Manifest:
    """A realistic-shaped corpus of `tokens` random ids (log-normal document lengths), written shard by shard
    so that memory stays at one shard (the benchmarks' 0.1 GB and 2 GB folders)."""
    rng = np.random.default_rng(seed)
    dtype = fmt.dtype_for(vocab)
    shards, left, k = [], tokens, 0
    while left > 0:
        n = min(shard_tokens, left)
        lengths = np.maximum(2, rng.lognormal(np.log(median), sigma, size=int(2 * n / median) + 16).astype(np.int64))
        lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), n)) + 1]
        lengths[-1] -= max(0, int(lengths.sum()) - n)
        lengths = lengths[lengths > 0]
        flat = rng.integers(0, vocab, size=int(lengths.sum()), dtype=np.uint32).astype(dtype)
        docs = np.split(flat, np.cumsum(lengths)[:-1])
        shards.append(fmt.write_shard(folder, "train", k, docs, dtype))
        left, k = left - int(lengths.sum()), k + 1
    m = fmt.Manifest(vocab_size=vocab, dtype=dtype, train=fmt.Split(
        tokens=sum(s.tokens for s in shards), documents=sum(s.documents for s in shards), shards=tuple(shards)),
        bos_id=1, eos_id=2)
    fmt.write_manifest(folder, m)
    return m
