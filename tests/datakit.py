"""Real text and a real tokenizer for data tests, without downloads.

`stdlib_texts()` reads Python's own standard-library sources (every machine here has them);
`build_tokenizer(dir)` trains a byte-level BPE on them with the `tokenizers` library and saves it as a
`PreTrainedTokenizerFast` folder (tokenizer.json, tokenizer_config.json, special_tokens_map.json), the
kind of folder `hpctrain data prepare --tokenizer DIR` and `[data] tokenizer` take.

    from datakit import build_tokenizer, stdlib_texts, write_jsonl
    tok = build_tokenizer(tmp_path / "tok", vocab_size=512)
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def stdlib_files(limit: int | None = None) -> list[Path]:
    """The .py files of the standard library, in a stable order (sorted paths)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    return files[:limit] if limit else files


def stdlib_texts(limit: int | None = 200, max_bytes: int = 0) -> list[str]:
    """Up to `limit` standard-library source files as documents (non-empty; only files of at most
    `max_bytes` when given, for small fast tests)."""
    out: list[str] = []
    for p in stdlib_files():
        if limit and len(out) >= limit:
            break
        if max_bytes and p.stat().st_size > max_bytes:
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if text.strip():
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
