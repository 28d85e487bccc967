"""Training data: documents -> token rows -> micro-batches that are a pure function of their index.

Every micro-batch is chosen by its global index g = cursor0 + ((step - step0) * grad_accum + micro) * dp
+ dp_rank, through an epoch plan that depends only on (seed, epoch). A resumed run therefore sees
bit-identical batches, and the data position saved in a checkpoint is the single integer `cursor`
(global micro-batches consumed).

Modes: "padded" (every row padded to seq_len: the baseline), "dynamic" (length-bucketed batches filled to a
token budget, padded only to the longest row in the batch), "pack" (documents concatenated into seq_len
rows; position_ids restart at each document so Hugging Face builds a block-diagonal causal mask, and the
first token of each document is never predicted from the previous one). Right padding needs no attention
mask: with causal attention real tokens never see the pads after them, and pads carry label -100.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpctrain.node.runconf import NodeInputError
from hpctrain.node.tokenize import Tokenizer

IGNORE = -100
PLAN_WINDOW = 256  # dynamic batching sorts by length inside windows of this many batches' worth of docs
# (plan_epoch on 20,000 log-normal lengths, median seq/6, micro 4, seq 4096: 2.8% padding with 256, 8.3% with 64)


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    tokens: int  # real (non-pad) tokens
    slots: int  # rows * padded length

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        if device is not None and str(device) != "cpu":
            out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
        return out


# ---------------------------------------------------------------------------------------------- reading
def read_texts(source: str, fmt: str, text_field: str) -> list[str]:
    """All documents of a jsonl/text file, a folder of them, or a `save_to_disk` folder."""
    path = Path(source)
    if not path.exists():
        raise NodeInputError(f"[data] source = {source!r}: no such file or folder. Point it at a .jsonl/.txt "
                             "file, a folder of them, or a datasets.save_to_disk folder on the shared filesystem.")
    if fmt == "arrow" or (fmt == "auto" and path.is_dir() and _is_saved_dataset(path)):
        return _read_arrow(path, text_field)
    files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".txt")) if path.is_dir() else [path]
    if not files:
        raise NodeInputError(f"{path}: folder holds no .jsonl/.txt files and is not a datasets.save_to_disk folder.")
    texts: list[str] = []
    for f in files:
        is_json = fmt == "jsonl" or (fmt == "auto" and f.suffix in (".jsonl", ".json"))
        texts.extend(_read_jsonl(f, text_field) if is_json else _read_text(f))
    if not texts:
        raise NodeInputError(f"{source}: no non-empty documents found.")
    return texts


def _is_saved_dataset(path: Path) -> bool:
    return any((path / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _read_jsonl(path: Path, field: str) -> list[str]:
    out: list[str] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise NodeInputError(f"{path}:{lineno}: not valid JSON ({exc.msg}).") from exc
            if not isinstance(rec, dict) or field not in rec:
                keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
                raise NodeInputError(f"{path}:{lineno}: record has no text field {field!r} (it has: {keys}). "
                                     "Set [data] text_field to the field that holds the text.")
            if str(rec[field]).strip():
                out.append(str(rec[field]))
    return out


def _read_text(path: Path) -> list[str]:
    return [line.rstrip("\n") for line in path.read_text(errors="replace").splitlines() if line.strip()]


def _read_arrow(path: Path, field: str) -> list[str]:
    import datasets

    ds: Any = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if field not in ds.column_names:
        raise NodeInputError(f"{path}: dataset has no text field {field!r} (columns: {', '.join(ds.column_names)}). "
                             "Set [data] text_field to the column that holds the text.")
    return [str(t) for t in ds[field] if str(t).strip()]


def tokenize_docs(texts: list[str], tok: Tokenizer, seq_len: int) -> list[np.ndarray]:
    """bos + text + eos, split into pieces of at most seq_len tokens (long documents become several)."""
    docs: list[np.ndarray] = []
    for text in texts:
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)
        ids += [tok.eos_id] if tok.eos_id is not None else []
        for i in range(0, len(ids), seq_len):
            piece = ids[i:i + seq_len]
            if len(piece) > 1:
                docs.append(np.asarray(piece, dtype=np.int64))
    return docs


# ---------------------------------------------------------------------------------------------- planning
def plan_epoch(lengths: np.ndarray, mode: str, micro: int, seq_len: int, budget: int, seed: int,
               epoch: int) -> list[list[int]]:
    """The batches of one epoch as lists of document indices, in training order (pure in its inputs)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    if mode == "padded":
        batches = [order[i:i + micro].tolist() for i in range(0, len(order), micro)]
    elif mode == "dynamic":
        batches = _bucket(order, lengths, budget, micro * PLAN_WINDOW)
    elif mode == "pack":
        batches = _pack(order, lengths, micro, seq_len)
    else:
        raise ValueError(f"unknown batching mode {mode!r}")
    perm = rng.permutation(len(batches))  # shuffle batch order so lengths do not drift through the epoch
    return [batches[i] for i in perm]


def _bucket(order: np.ndarray, lengths: np.ndarray, budget: int, window: int) -> list[list[int]]:
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window].tolist(), key=lambda d: int(lengths[d]))
        cur: list[int] = []
        for d in chunk:
            longest = _round_up(int(lengths[d]), 8)  # chunk is sorted: the newcomer is the longest
            if cur and (len(cur) + 1) * longest > budget:
                batches.append(cur)
                cur = []
            cur.append(d)
        if cur:
            batches.append(cur)
    return batches


def _pack(order: np.ndarray, lengths: np.ndarray, micro: int, seq_len: int) -> list[list[int]]:
    """Greedy first-fit of documents into rows; a batch is `micro` rows, rows separated by -1."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for d in order.tolist():
        n = int(lengths[d])
        for r, used in enumerate(fill[-8:], start=max(0, len(fill) - 8)):  # look back a little: near-linear
            if used + n <= seq_len:
                rows[r].append(d)
                fill[r] += n
                break
        else:
            rows.append([d])
            fill.append(n)
    batches: list[list[int]] = []
    for i in range(0, len(rows), micro):
        flat: list[int] = []
        for row in rows[i:i + micro]:
            flat.extend(row + [-1])
        batches.append(flat)
    return batches


# ---------------------------------------------------------------------------------------------- batches
class DataSource:
    """Micro-batches by global index, for a document corpus or a synthetic stream."""

    def __init__(self, docs: list[np.ndarray] | None, *, mode: str, micro: int, seq_len: int, budget: int,
                 seed: int, pad_id: int, vocab: int) -> None:
        self.docs, self.mode, self.micro, self.seq_len = docs, mode, micro, seq_len
        self.budget, self.seed, self.pad_id, self.vocab = budget, seed, pad_id, vocab
        self.lengths = np.asarray([len(d) for d in docs], dtype=np.int64) if docs is not None else None
        self._plans: dict[int, list[list[int]]] = {}

    @property
    def synthetic(self) -> bool:
        return self.docs is None

    def batches_per_epoch(self) -> int:
        return len(self._plan(0)) if not self.synthetic else 0

    def _plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            assert self.lengths is not None
            self._plans = {epoch: plan_epoch(self.lengths, self.mode, self.micro, self.seq_len, self.budget,
                                             self.seed, epoch)}
        return self._plans[epoch]

    def batch(self, g: int) -> Batch:
        """Micro-batch number g (global over all data-parallel ranks)."""
        if self.synthetic:
            return self._synthetic(g)
        n = len(self._plan(0))
        ids = self._plan(g // n)[g % n]
        if self.mode == "pack":
            return self._packed(ids)
        return self._padded([self.docs[i] for i in ids], self.seq_len if self.mode == "padded" else None)  # type: ignore[index]

    def _synthetic(self, g: int) -> Batch:
        # Learnable counting sequences (start, stride random): the loss visibly falls within tens of steps.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
        v = min(self.vocab, 256)
        start = torch.randint(0, v, (self.micro, 1), generator=gen)
        stride = torch.randint(1, 4, (self.micro, 1), generator=gen)
        x = (start + stride * torch.arange(self.seq_len)) % v
        return Batch(x, x.clone(), None, x.numel(), x.numel())

    def _padded(self, docs: list[np.ndarray], length: int | None) -> Batch:
        width = length or _round_up(max(len(d) for d in docs), 8)
        x = torch.full((len(docs), width), self.pad_id, dtype=torch.long)
        y = torch.full((len(docs), width), IGNORE, dtype=torch.long)
        for r, d in enumerate(docs):
            x[r, :len(d)] = torch.from_numpy(d)
            y[r, :len(d)] = torch.from_numpy(d)
        real = sum(len(d) for d in docs)
        return Batch(x, y, None, real, x.numel())

    def _packed(self, flat: list[int]) -> Batch:
        rows: list[list[int]] = [[]]
        for d in flat[:-1]:
            rows[-1].append(d) if d >= 0 else rows.append([])
        x = torch.full((len(rows), self.seq_len), self.pad_id, dtype=torch.long)
        y = torch.full_like(x, IGNORE)
        pos = torch.zeros_like(x)
        real = 0
        for r, row in enumerate(rows):
            at = 0
            for d in row:
                doc = torch.from_numpy(self.docs[d])  # type: ignore[index]
                n = len(doc)
                x[r, at:at + n] = doc
                y[r, at:at + n] = doc
                y[r, at] = IGNORE  # never predict a document's first token from the previous document
                pos[r, at:at + n] = torch.arange(n)
                at += n
                real += n
            # Pads continue counting so they form their own "document" and are not merged into the last one.
            pos[r, at:] = torch.arange(self.seq_len - at)
        return Batch(x, y, pos, real, x.numel())


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def build_source(spec: Any, tok: Tokenizer, micro: int, vocab: int, force_padded: bool = False) -> DataSource:
    """The DataSource a spec asks for (reads and tokenizes the corpus on every rank)."""
    d = spec.data
    budget = d.tokens_per_batch or micro * d.seq_len
    if d.source == "synthetic" or d.format == "synthetic":
        return DataSource(None, mode="padded", micro=micro, seq_len=d.seq_len, budget=budget,
                          seed=spec.train.seed, pad_id=tok.pad_id, vocab=vocab)
    if tok.vocab_size > vocab:
        raise NodeInputError(f"[data] tokenizer {d.tokenizer!r} has {tok.vocab_size} ids but the model's vocab_size "
                             f"is {vocab}; use a model with vocab_size >= {tok.vocab_size} (set [model] overrides).")
    texts = read_texts(d.source, d.format, d.text_field)
    docs = tokenize_docs(texts, tok, d.seq_len)
    mode = "padded" if force_padded else ("pack" if d.pack else ("dynamic" if d.dynamic_batching else "padded"))
    return DataSource(docs, mode=mode, micro=micro, seq_len=d.seq_len, budget=budget, seed=spec.train.seed,
                      pad_id=tok.pad_id, vocab=vocab)


def iter_epoch(src: DataSource) -> Iterator[Batch]:
    """All batches of epoch 0 (tests and the padding report)."""
    for g in range(src.batches_per_epoch()):
        yield src.batch(g)
