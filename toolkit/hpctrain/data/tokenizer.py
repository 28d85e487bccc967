"""The tokenizer `data prepare` runs: a local Hugging Face tokenizer folder, or "byte" (no files).

A fast tokenizer folder holds `tokenizer.json`, which the `tokenizers` library loads by itself: prepare
uses it directly (`Tokenizer.from_file` + `encode_batch_fast`), not through transformers, so a worker
starts in ~0.1 s instead of ~2 s, and ids come without the offsets and Python BatchEncoding transformers
builds around them. The ids are those of `AutoTokenizer.from_pretrained(DIR)(text, add_special_tokens=False)`
(tests/test_data_prepare.py checks it). bos/eos come from tokenizer_config.json (special_tokens_map.json for
older folders). "byte" is the node's ByteTokenizer: UTF-8 bytes 0-255, pad 256, bos 257, eos 258.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.errors import bad_value

if TYPE_CHECKING:
    import numpy as np

BYTE = "byte"
FIX = "pass --tokenizer with a local tokenizer folder holding tokenizer.json (a fast tokenizer), or 'byte'"


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer; `hash` covers every file of its folder."""

    path: str
    hash: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None


def _special(folder: Path, name: str) -> str | None:
    """The text of special token `name` ("bos_token") from tokenizer_config.json or special_tokens_map.json."""
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((folder / fname).read_text(encoding="utf-8")).get(name)
        except (OSError, ValueError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


# Where transformers (5.x) finds a tokenizer folder's chat template, besides tokenizer_config.json's
# "chat_template": save_pretrained writes chat_template.jinja, and named templates into a folder;
# chat_template.json is a processor's (counted, so that no folder transformers can render with is refused).
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def has_chat_template(folder: Path) -> bool | None:
    """Whether a tokenizer folder holds a chat template, read from its files (no transformers import): None
    when it cannot tell (no folder, no readable tokenizer_config.json), so a caller refuses only a sure no."""
    if not folder.is_dir():
        return None
    if any((folder / name).exists() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return bool(config.get("chat_template")) if isinstance(config, dict) else None


# Model weights beside the tokenizer (the tokenizer is the model folder by default for a fine-tune): no tokenizer
# reads them, and hashing them read the whole model at every submit and prepare (16 GB for an 8B folder; a
# 2.47 GB 1B folder took 10.8 s cold). Llama downloads also hold original/consolidated.00.pth.
WEIGHT_SUFFIXES = frozenset((".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"))


def folder_hash(folder: Path) -> str:
    """sha256 over the names and bytes of the folder's files (sorted), model weights left out: any edit of a
    tokenizer file is another tokenizer."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix not in WEIGHT_SUFFIXES):
        h.update(str(f.relative_to(folder)).encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def describe(name: str) -> TokenizerInfo:
    """Check the tokenizer and say what it is (no tokenizing yet)."""
    if name == BYTE:
        return TokenizerInfo(path=BYTE, hash=BYTE, vocab_size=259, bos_id=257, eos_id=258)
    folder = Path(name)
    if not (folder / "tokenizer.json").is_file():
        raise bad_value("--tokenizer", name, "not a folder holding tokenizer.json (a fast tokenizer)", FIX)
    tok = _load(folder)
    ids: dict[str, int | None] = {}
    for which in ("bos_token", "eos_token"):
        text = _special(folder, which)
        ids[which] = tok.token_to_id(text) if text else None
    return TokenizerInfo(path=str(folder.absolute()), hash=folder_hash(folder),
                         vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
                         bos_id=ids["bos_token"], eos_id=ids["eos_token"])


def _load(folder: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for a malformed file
        raise bad_value("--tokenizer", str(folder), f"tokenizer.json cannot be loaded ({exc})", FIX) from None


class Encoder:
    """Texts -> one id array per text (the tokenizer's own threads off: prepare runs one per process)."""

    def __init__(self, info: TokenizerInfo, dtype: str, bos: bool, eos: bool) -> None:
        self.info, self.dtype = info, dtype
        self.head = [info.bos_id] if bos and info.bos_id is not None else []
        self.tail = [info.eos_id] if eos and info.eos_id is not None else []
        self.tok = None if info.path == BYTE else _load(Path(info.path))

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        import numpy as np

        if self.tok is None:
            rows = [list(t.encode("utf-8")) for t in texts]
        else:
            rows = [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]
        return [np.asarray(self.head + r + self.tail, dtype=self.dtype) for r in rows]

    def sft(self, chat: bool) -> Any:
        """data/sft.py's Encoding of this tokenizer: one text at a time, bos/eos from the folder, and for
        chat the transformers tokenizer (its chat_template; loaded only then, ~2 s)."""
        from hpctrain.data.sft import Encoding

        info = self.info
        if self.tok is None:
            return Encoding(lambda t: list(t.encode("utf-8")), info.bos_id, info.eos_id, None)
        tok = self.tok
        return Encoding(lambda t: list(tok.encode(t, add_special_tokens=False).ids), info.bos_id, info.eos_id,
                        chat_tokenizer(info.path) if chat else None)


def chat_tokenizer(path: str) -> Any:
    """The folder as a transformers tokenizer (what renders a chat_template), or None for "byte"."""
    if path == BYTE:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
