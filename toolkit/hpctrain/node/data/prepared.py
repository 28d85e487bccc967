"""A prepared folder (hpctrain.data.format) as the node's corpus: memory-mapped, read lazily.

Every rank maps the shards and holds only the index arrays (int64 offsets per document, plus the piece index
below); the tokens of a batch are paged in when that batch is built, so start-up time and resident memory do
not grow with the corpus (bench/loader_bench.py). Documents longer than seq_len are read as seq_len pieces,
as the in-RAM path's tokenize_docs cuts them, through a (document, offset, length) index instead of copies.

A folder of an SFT format (data/sft.py) carries a loss mask per shard (.mask, memory-mapped like the tokens):
its pieces come out as signed ids, a token the loss does not cover as -(id + 1) (node/data/loader.py decodes them).
Its examples were cut at prepare's --seq-len, so a run with a shorter seq_len is refused rather than cutting
responses away from their prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.data import format as fmt
from hpctrain.node.runconf import NodeInputError

PREPARE_HINT = "hpctrain data prepare INPUT --tokenizer DIR --out DIR"


class LeanSplit:
    """The reading side of format.PreparedSplit with less held per document, for corpora of millions.

    The .idx offsets stay memory-mapped (a batch touches two of their pages per document it reads); the
    lengths planning needs are read through in blocks (no page of the index stays mapped) and kept as int32:
    4 bytes a document instead of PreparedSplit's 16. The checks are PreparedSplit's.
    """

    BLOCK = 1 << 20  # offsets read at a time for the lengths

    def __init__(self, folder: str | Path, split: str, manifest: fmt.Manifest) -> None:
        self.folder, self.dtype = Path(folder), np.dtype(manifest.dtype)
        info: fmt.Split = getattr(manifest, split)
        self.shards = info.shards
        self._tokens: list[np.memmap[Any, Any] | None] = [None] * len(self.shards)
        self._masks: list[np.memmap[Any, Any] | None] = [None] * len(self.shards)
        self.masked = any(sh.mask for sh in self.shards)
        self._offsets: list[np.memmap[Any, Any]] = []
        self.lengths = np.zeros(info.documents if info.documents else 0, dtype=np.int32)
        at = 0
        for sh in self.shards:
            path = self.folder / sh.index
            size = path.stat().st_size if path.is_file() else -1
            offsets = np.memmap(path, dtype=np.int64, mode="r") if size > 0 else np.zeros(0, dtype=np.int64)
            last = int(offsets[-1]) if len(offsets) else 0
            if len(offsets) != sh.documents + 1 or last != sh.tokens or at + sh.documents > len(self.lengths):
                raise fmt.PreparedFormatError(f"{path}: {len(offsets) - 1} documents / {last} tokens, the manifest "
                                              f"says {sh.documents} / {sh.tokens}. Run `hpctrain data prepare` again.")
            for i in range(0, sh.documents, self.BLOCK):
                block = np.fromfile(path, dtype=np.int64, count=min(self.BLOCK, sh.documents - i) + 1, offset=8 * i)
                self.lengths[at + i:at + i + len(block) - 1] = np.diff(block)
            self._offsets.append(offsets)
            at += sh.documents
        if at != len(self.lengths):
            raise fmt.PreparedFormatError(f"{self.folder}: the shards of {split} hold {at} documents, the manifest "
                                          f"says {len(self.lengths)}. Run `hpctrain data prepare` again.")
        counts = np.asarray([sh.documents for sh in self.shards], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def doc(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self._first, i, side="right")) - 1
        j = i - int(self._first[s])
        mm = self._tokens[s]
        if mm is None:
            sh = self.shards[s]
            mm = self._tokens[s] = np.memmap(self.folder / sh.path, dtype=self.dtype, mode="r", shape=(sh.tokens,))
        o = self._offsets[s]
        ids = mm[int(o[j]):int(o[j + 1])]
        if not self.masked:
            return ids
        mk = self._masks[s]
        if mk is None:
            sh = self.shards[s]
            mk = self._masks[s] = np.memmap(self.folder / sh.mask, dtype=np.uint8, mode="r", shape=(sh.tokens,))
        ids = ids.astype(np.int64)
        return np.where(mk[int(o[j]):int(o[j + 1])] != 0, ids, -ids - 1)


class Pieces:
    """The seq_len pieces of one split's documents; pieces of one token are dropped (nothing to predict)."""

    def __init__(self, split: LeanSplit, seq_len: int) -> None:
        self.split = split
        lengths = split.lengths
        ids = np.int32 if len(lengths) < 2**31 else np.int64
        self.offset: np.ndarray | None = None
        if not (lengths > seq_len).any():  # the common case: a piece is a document, no offsets to keep
            short = lengths <= 1
            self.doc: np.ndarray | None = np.flatnonzero(~short).astype(ids) if short.any() else None
            self.lengths = lengths if self.doc is None else lengths[self.doc]
            return
        counts = np.where(lengths > seq_len, (lengths + seq_len - 1) // seq_len, 1)
        doc = np.repeat(np.arange(len(lengths), dtype=ids), counts)
        first = np.cumsum(counts, dtype=np.int64) - counts
        offset = (np.arange(len(doc), dtype=np.int64) - np.repeat(first, counts)) * seq_len
        del counts, first
        length = np.minimum(seq_len, lengths[doc] - offset)
        keep = length > 1
        self.doc, self.offset, self.lengths = doc[keep], offset[keep], length[keep].astype(np.int32)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        d = int(self.doc[i]) if self.doc is not None else i
        o = int(self.offset[i]) if self.offset is not None else 0
        return self.split.doc(d)[o:o + int(self.lengths[i])]


def is_prepared_source(source: str, data_format: str) -> bool:
    """[data] format = "prepared", or a folder with a manifest under "auto" (or a raw format's name)."""
    if data_format == "prepared":
        if not fmt.is_prepared(source):
            raise NodeInputError(f"[data] source = {source!r}: format = \"prepared\" but there is no "
                                 f"{fmt.MANIFEST} in it (a prepare that did not finish leaves none). "
                                 f"Fix: run `{PREPARE_HINT}` and point [data] source at its --out folder.")
        return True
    # "jsonl"/"text" name the raw inputs a folder was prepared from; its manifest.json is not a document.
    # An SFT format names how the folder was prepared: the node checks it holds that format's masks.
    return data_format in ("auto", "jsonl", "text", "alpaca", "chat") and Path(source).is_dir() \
        and fmt.is_prepared(source)


def open_manifest(source: str, model_vocab: int, seq_len: int = 0) -> fmt.Manifest:
    """The manifest, checked against the model: every id the corpus holds must have an embedding row."""
    try:
        m = fmt.read_manifest(source)
    except fmt.PreparedFormatError as exc:
        raise NodeInputError(str(exc)) from exc
    if m.vocab_size > model_vocab:
        raise NodeInputError(f"[data] source = {source!r}: prepared with a tokenizer of {m.vocab_size} ids, but the "
                             f"model's vocab_size is {model_vocab}. Fix: use a model with vocab_size >= "
                             f"{m.vocab_size} (set [model] overrides) or prepare the data with the model's tokenizer.")
    want = int(m.options.get("seq_len") or 0)
    if m.masked and seq_len and want > seq_len:
        raise NodeInputError(f"[data] seq_len = {seq_len}: {source} was prepared as {m.options.get('format')} "
                             f"records of up to {want} tokens (--seq-len {want}), and cutting them again here would "
                             f"train on responses without their prompts. Fix: set [data] seq_len = {want}, or "
                             f"prepare again with --seq-len {seq_len}.")
    if m.train.documents == 0:
        raise NodeInputError(f"[data] source = {source!r}: the prepared train split holds no documents. "
                             f"Fix: run `{PREPARE_HINT}` on a non-empty input.")
    return m


def pad_id(m: fmt.Manifest) -> int:
    # Pads carry label -100 and sit after the real tokens of a causal row: any valid id does.
    return int(m.eos_id) if m.eos_id is not None else 0


def open_pieces(source: str, split: str, m: fmt.Manifest, seq_len: int) -> Pieces:
    try:
        return Pieces(LeanSplit(source, split, m), seq_len)
    except fmt.PreparedFormatError as exc:
        raise NodeInputError(str(exc)) from exc


def raw_size(source: str) -> int:
    """Bytes the in-RAM path would read: the file, or every file under the folder."""
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_raw_size(source: str, limit: int) -> None:
    """The in-RAM path reads and tokenizes the whole corpus on every rank: fine for tests and small fine-tunes,
    a host-memory and start-up trap beyond that."""
    if limit <= 0 or not Path(source).exists():
        return
    size = raw_size(source)
    if size > limit:
        raise NodeInputError(f"[data] source = {source!r}: {size / 1e6:.1f} MB of raw text is more than "
                             f"[data] max_raw_bytes = {limit} ({limit / 1e6:.0f} MB), and every rank would "
                             f"tokenize all of it in RAM. Fix: tokenize it once with `{PREPARE_HINT}` and set [data] "
                             "source to "
                             "the --out folder (or raise [data] max_raw_bytes).")
