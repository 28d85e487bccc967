"""Real text and a real tokenizer for data tests, without downloads.

`stdlib_texts()` reads Python's own standard-library sources (every machine here has them);
`build_tokenizer(dir)` trains a byte-level BPE on them with the `tokenizers` library and saves it as a
`PreTrainedTokenizerFast` folder (tokenizer.json, tokenizer_config.json, special_tokens_map.json), the
kind of folder `hpctrain data prepare --tokenizer DIR` and `[data] tokenizer` take. `write_prepared` and
`synthetic_prepared` write prepared folders with hpctrain.data.format directly (node-side tests, benchmarks).

    from datakit import build_tokenizer, stdlib_texts, write_jsonl
    tok = build_tokenizer(tmp_path / "tok", vocab_size=512)
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hpctrain.data import format as fmt

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def stdlib_files(limit: int | None = None) -> list[Path]:
    """The .py files of the standard library in a stable order: the top folder's (sorted), then the
    packages' (sorted paths)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    top = sorted(root.glob("*.py"))
    deeper = sorted(p for p in root.rglob("*.py") if p.parent != root and "site-packages" not in p.parts)
    files = [p for p in top + deeper if p.is_file()]
    return files[:limit] if limit else files


def stdlib_texts(limit: int | None = 200, max_bytes: int = 0, min_chars: int = 200) -> list[str]:
    """Up to `limit` standard-library source files of at least `min_chars` characters as documents (only files
    of at most `max_bytes` when given, for small fast tests)."""
    out: list[str] = []
    for p in stdlib_files():
        if limit and len(out) >= limit:
            break
        if max_bytes and p.stat().st_size > max_bytes:
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if len(text.strip()) >= min_chars:
            out.append(text)
    return out


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({field: t, "id": i}) + "\n")
    return path


def _batches(texts: list[str], size: int = 64) -> Iterator[list[str]]:
    for i in range(0, len(texts), size):
        yield texts[i:i + size]


def build_tokenizer(out: Path, vocab_size: int = 1024, texts: list[str] | None = None) -> Path:
    """Train a byte-level BPE on `texts` (default: 200 stdlib files) and save a PreTrainedTokenizerFast folder.

    <s> is bos, </s> eos, <pad> pad (ids 0-3 are the specials). Takes about a second at vocab 1024.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts if texts is not None else stdlib_texts()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_batches(texts), trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    out.mkdir(parents=True, exist_ok=True)
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
