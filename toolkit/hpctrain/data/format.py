"""The on-disk format of a prepared corpus, shared by `hpctrain data prepare` (writer) and every rank (reader).

A prepared folder is what Megatron's indexed datasets, nanotron's Nanosets and OLMo's memmap datasets are:

    DIR/manifest.json                       what is in the folder and how it was made (written last, atomically)
    DIR/train/shard-00000.bin               the tokens of whole documents, one flat array of `dtype`
    DIR/train/shard-00000.idx               int64 offsets into .bin: documents+1 entries, the first 0
    DIR/train/shard-00000.mask              SFT formats only: one uint8 per token, 1 = the loss covers it
    DIR/val/shard-00000.bin, .idx           the validation split, same layout

`dtype` is uint16 when every id fits (vocab_size <= 65536), else uint32: half the disk and page cache of
int32 for the common 32k-64k vocabularies. A folder is prepared exactly when manifest.json exists and names
FORMAT at VERSION: the manifest is written after every shard is in place, so a killed prepare leaves no
manifest and is never mistaken for a finished one. Nothing here imports numpy at module level, so the CLI
can read a manifest (`submit` checks vocabularies) without paying for it.

Versions: a folder without masks is written at VERSION 1, byte for byte as before the SFT formats (and its
cache key is unchanged); a folder with .mask files is written at MASKED_VERSION 2, which this hpctrain reads
beside 1 and an older one refuses (it would train on the prompts). Each masked shard names its mask file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

FORMAT = "hpctrain-tokens"
VERSION = 1
MASKED_VERSION = 2  # shards carry a .mask (data/sft.py); see the module docstring
READS = (VERSION, MASKED_VERSION)
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Shard:
    """One shard: `path` and `index` are relative to the prepared folder."""

    path: str
    index: str
    tokens: int
    documents: int
    mask: str = ""  # the .mask file (uint8 per token) of an SFT shard; "" = every token is trained on


@dataclass(frozen=True)
class Split:
    tokens: int = 0
    documents: int = 0
    shards: tuple[Shard, ...] = ()


@dataclass(frozen=True)
class Manifest:
    vocab_size: int
    dtype: str  # "uint16" | "uint32"
    train: Split
    val: Split = field(default_factory=Split)
    tokenizer_hash: str = ""
    # [{"path", "kind", "bytes", "mtime_ns", "sha256", "tokens", "documents"}, ...]: tokens/documents of both splits
    inputs: tuple[dict[str, Any], ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    key: str = ""  # content hash of inputs + tokenizer + options: the cache key
    bos_id: int | None = None
    eos_id: int | None = None
    hpctrain_version: str = ""
    tokenizer: str = ""  # the tokenizer folder prepare read ("byte" for the byte tokenizer); not part of the key
    records: dict[str, Any] = field(default_factory=dict)  # SFT formats: data/sft.py's Tally (records, bad by reason)
    format: str = FORMAT
    version: int = VERSION

    @property
    def tokens(self) -> int:
        return self.train.tokens

    @property
    def documents(self) -> int:
        return self.train.documents

    @property
    def masked(self) -> bool:
        """The shards carry loss masks (an SFT format): the node trains on the masked tokens only."""
        return any(sh.mask for sh in (*self.train.shards, *self.val.shards))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.records:
            del d["records"]  # a text folder's manifest stays as it was
        for split in ("train", "val"):
            for sh in d[split]["shards"]:
                if not sh["mask"]:
                    del sh["mask"]
        d["tokens"], d["documents"] = self.tokens, self.documents  # the headline figures, for readers of the file
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        def split(s: dict[str, Any] | None) -> Split:
            s = s or {}
            shards = tuple(Shard(**{k: sh[k] for k in ("path", "index", "tokens", "documents")},
                                 mask=str(sh.get("mask", ""))) for sh in s.get("shards", ()))
            return Split(tokens=int(s.get("tokens", 0)), documents=int(s.get("documents", 0)), shards=shards)

        return cls(vocab_size=int(d["vocab_size"]), dtype=str(d["dtype"]), train=split(d.get("train")),
                   val=split(d.get("val")), tokenizer_hash=str(d.get("tokenizer_hash", "")),
                   inputs=tuple(d.get("inputs", ())), options=dict(d.get("options", {})), key=str(d.get("key", "")),
                   bos_id=d.get("bos_id"), eos_id=d.get("eos_id"),
                   hpctrain_version=str(d.get("hpctrain_version", "")), tokenizer=str(d.get("tokenizer", "")),
                   records=dict(d.get("records") or {}), format=str(d.get("format", "")),
                   version=int(d.get("version", 0)))


class PreparedFormatError(ValueError):
    """A folder claims to be prepared but its manifest or shards do not match this format."""


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_prepared(folder: str | os.PathLike[str]) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    path = Path(folder) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PreparedFormatError(f"{path}: cannot read the manifest ({exc}). "
                                  "Run `hpctrain data prepare` again.") from exc
    if raw.get("format") != FORMAT or raw.get("version") not in READS:
        raise PreparedFormatError(f"{path}: format {raw.get('format')!r} version {raw.get('version')!r}; this "
                                  f"hpctrain reads {FORMAT!r} versions {', '.join(map(str, READS))}. Run `hpctrain "
                                  "data prepare` again.")
    return Manifest.from_json(raw)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder, fsync, rename: readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(folder: str | os.PathLike[str], manifest: Manifest) -> None:
    atomic_write_bytes(Path(folder) / MANIFEST, (json.dumps(manifest.to_json(), indent=1) + "\n").encode())


def write_shard(folder: str | os.PathLike[str], split: str, number: int, docs: list[np.ndarray],
                dtype: str, masks: list[np.ndarray] | None = None) -> Shard:
    """Write the documents as shard `number` of `split` (each file atomically) and describe it; with `masks`
    (one bool array per document) also the .mask file."""
    import numpy as np

    rel = f"{split}/shard-{number:05d}"
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(docs).astype(dtype, copy=False) if docs else np.zeros(0, dtype=dtype)
    root = Path(folder)
    atomic_write_bytes(root / f"{rel}.bin", flat.tobytes())
    atomic_write_bytes(root / f"{rel}.idx", offsets.tobytes())
    if masks is None:
        return Shard(path=f"{rel}.bin", index=f"{rel}.idx", tokens=int(offsets[-1]), documents=len(docs))
    bits = np.concatenate(masks).astype(np.uint8) if masks else np.zeros(0, dtype=np.uint8)
    if len(bits) != len(flat):
        raise ValueError(f"{rel}: {len(bits)} mask entries for {len(flat)} tokens")
    atomic_write_bytes(root / f"{rel}.mask", bits.tobytes())
    return Shard(path=f"{rel}.bin", index=f"{rel}.idx", tokens=int(offsets[-1]), documents=len(docs),
                 mask=f"{rel}.mask")


class PreparedSplit:
    """The documents of one split, memory-mapped: nothing is read until a document is asked for.

    `lengths` (one int64 per document) is the only array held in memory; it is what planning (dynamic
    batching, packing) needs. `doc(i)` returns a read-only view of document i in the shard's dtype.
    """

    def __init__(self, folder: str | os.PathLike[str], split: str = "train",
                 manifest: Manifest | None = None) -> None:
        import numpy as np

        self.folder = Path(folder)
        self.manifest = manifest or read_manifest(folder)
        info: Split = getattr(self.manifest, split)
        self.dtype = np.dtype(self.manifest.dtype)
        self._tokens: list[np.memmap[Any, Any] | None] = [None] * len(info.shards)
        self._offsets: list[np.ndarray] = []
        for sh in info.shards:
            offsets = np.fromfile(self.folder / sh.index, dtype=np.int64)
            if len(offsets) != sh.documents + 1 or int(offsets[-1]) != sh.tokens:
                raise PreparedFormatError(f"{self.folder / sh.index}: {len(offsets) - 1} documents / "
                                          f"{int(offsets[-1]) if len(offsets) else 0} tokens, the manifest says "
                                          f"{sh.documents} / {sh.tokens}. Run `hpctrain data prepare` again.")
            self._offsets.append(offsets)
        self.shards = info.shards
        counts = np.asarray([sh.documents for sh in info.shards], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]) if len(counts) else np.zeros(1, dtype=np.int64)
        self.lengths = (np.concatenate([np.diff(o) for o in self._offsets]) if self._offsets
                        else np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.lengths)

    def _map(self, s: int) -> np.memmap[Any, Any]:
        import numpy as np

        mm = self._tokens[s]
        if mm is None:
            sh = self.shards[s]
            mm = np.memmap(self.folder / sh.path, dtype=self.dtype, mode="r", shape=(sh.tokens,))
            self._tokens[s] = mm
        return mm

    def doc(self, i: int) -> np.ndarray:
        import numpy as np

        s = int(np.searchsorted(self._first, i, side="right")) - 1
        j = i - int(self._first[s])
        o = self._offsets[s]
        return self._map(s)[int(o[j]):int(o[j + 1])]

    def mask(self, i: int) -> np.ndarray | None:
        """Document i's loss mask (uint8, 1 = trained), or None for a shard without one (every token counts)."""
        import numpy as np

        s = int(np.searchsorted(self._first, i, side="right")) - 1
        sh = self.shards[s]
        if not sh.mask:
            return None
        j = i - int(self._first[s])
        o = self._offsets[s]
        mm = np.memmap(self.folder / sh.mask, dtype=np.uint8, mode="r", shape=(sh.tokens,))
        return mm[int(o[j]):int(o[j + 1])]
