"""Tokenizers: a byte-level one that needs no files, or a local Hugging Face tokenizer folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Protocol

from hpctrain.node.runconf import NodeInputError


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def save(self, out_dir: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 pad, 257 bos, 258 eos. Any model with vocab >= 259 fits."""

    vocab_size = 259
    pad_id = 256
    bos_id: int | None = 257
    eos_id: int | None = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, out_dir: Path) -> None:
        info = {"type": "byte", "vocab_size": self.vocab_size, "pad_id": self.pad_id, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "note": "ids 0-255 are UTF-8 bytes (hpctrain.node.data.tokenize.ByteTokenizer)"}
        (out_dir / "tokenizer_info.json").write_text(json.dumps(info, indent=2) + "\n")


class HFTokenizer:
    """A tokenizer folder on the shared filesystem (never a hub id: compute nodes are offline)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id
        pad = self.tok.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_id if self.eos_id is not None else 0))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def save(self, out_dir: Path) -> None:
        self.tok.save_pretrained(str(out_dir))


def load_tokenizer(name: str) -> Tokenizer:
    """"byte" or a local tokenizer folder; a missing folder is a clear input error."""
    if name in ("", "byte"):
        return ByteTokenizer()
    path = Path(name)
    if not path.is_dir():
        raise NodeInputError(f"[data] tokenizer = {name!r}: no such folder. Use a local tokenizer folder "
                             "(tokenizer.json / tokenizer_config.json) on the shared filesystem, or \"byte\".")
    return HFTokenizer(name)


# Beside tokenizer*: the files a tokenizer folder may hold. transformers 5's save_pretrained writes the chat
# template to chat_template.jinja (not tokenizer_config.json), and named extra templates to a folder: an export
# without them loads a tokenizer without a chat_template.
TOKENIZER_SIDE_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                        "chat_template.jinja", "chat_template.json")
CHAT_TEMPLATES_DIR = "additional_chat_templates"


def copy_tokenizer_files(src: str, out_dir: Path) -> None:
    """Copy a tokenizer folder's files (chat templates included) next to an exported model (no transformers
    import needed)."""
    for f in Path(src).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_SIDE_FILES):
            shutil.copy2(f, out_dir / f.name)
        elif f.is_dir() and f.name == CHAT_TEMPLATES_DIR:
            shutil.copytree(f, out_dir / f.name, dirs_exist_ok=True)
