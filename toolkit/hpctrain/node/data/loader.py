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

SFT formats ([data] format = "alpaca" | "chat", data/sft.py) carry their loss mask inside the documents: a
token the loss does not cover (the prompt, the user's turns) is stored as -(id + 1). Every mode above decodes
it when it builds a batch (input id = -x - 1, label -100), so the mask travels through padding, dynamic
batching, packing and the epoch plan without a second array. `Batch.trained` counts the labels the loss
really sees (label != -100 after the model's one-token shift): the metrics' trained tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hpctrain.node.data.epochplan import EpochPlan, plan_epoch
from hpctrain.node.data.tokenize import Tokenizer
from hpctrain.node.runconf import NodeInputError

IGNORE = -100


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    tokens: int  # real (non-pad) tokens
    slots: int  # rows * padded length
    trained: int = 0  # tokens the loss covers: labels != -100 from the second position of each row on

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        if device is not None and str(device) != "cpu":
            out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
        return out


# ---------------------------------------------------------------------------------------------- reading
def read_texts(source: str, fmt: str, text_field: str) -> list[str]:
    """All documents of a jsonl/text file, a folder of them, or a `save_to_disk` folder, read by `data prepare`'s
    reader (hpctrain.data.inputs): the in-RAM path and a prepared folder of the same source hold the same
    documents. [data] format = "jsonl" / "text" reads every such file so, whatever its name says."""
    from hpctrain.data import inputs
    from hpctrain.errors import HpcUsageError

    try:
        found = inputs.find_inputs([source])
        if fmt in ("jsonl", "text"):
            found = [dataclasses.replace(i, kind=fmt) if i.kind in ("jsonl", "text") else i for i in found]
        texts = [t for n, inp in enumerate(found) for unit in inputs.units_of(inp, n, WHOLE_FILE)
                 for t in inputs.read_texts(inp, unit, text_field)]
    except HpcUsageError as exc:  # worded for `data prepare`'s flags: said again as [data]'s
        raise NodeInputError(f"[data] source = {source!r}: {exc.message.replace('--text-field', '[data] text_field')}"
                             ) from exc
    if not texts:
        raise NodeInputError(f"{source}: no non-empty documents found.")
    return texts


WHOLE_FILE = 1 << 62  # units_of's shard size: one unit per file, read in order


def _is_saved_dataset(path: Path) -> bool:
    return any((path / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


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


# ---------------------------------------------------------------------------------------------- SFT records
SFT_FORMATS = ("alpaca", "chat")


def sft_encoding(d: Any, tok: Tokenizer) -> Any:
    """data/sft.py's view of the node's tokenizer; refuses chat without a chat_template (or with "byte")."""
    from hpctrain.data import sft

    hf = getattr(tok, "tok", None)  # HFTokenizer's transformers tokenizer; None for the byte tokenizer
    if d.format == "chat":
        try:
            sft.check_chat_tokenizer(hf, d.tokenizer)
        except sft.SftInputError as exc:
            raise NodeInputError(str(exc)) from None
    return sft.Encoding(tok.encode, tok.bos_id, tok.eos_id, hf)


def _sft_files(source: str) -> list[tuple[str, Any]]:
    """(name, records) per input: jsonl files (a file, or a folder's, sorted) or a save_to_disk folder's rows.
    A record is (where, parsed record or sft.Bad)."""
    from hpctrain.data import inputs, sft
    from hpctrain.errors import HpcUsageError

    path = Path(source)
    if not path.exists():
        raise NodeInputError(f"[data] source = {source!r}: no such file or folder. Point it at a .jsonl file of "
                             "records, a folder of them, or a datasets.save_to_disk folder on the shared filesystem.")
    if path.is_dir() and _is_saved_dataset(path):
        import datasets

        ds: Any = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return [(str(path), ((f"{path} row {i}", row) for i, row in enumerate(ds)))]
    files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json")) if path.is_dir() else [path]
    if not files:
        raise NodeInputError(f"[data] source = {source!r}: holds no .jsonl files of records and is not a "
                             "datasets.save_to_disk folder. Fix: point it at jsonl records (docs/data.md).")

    def lines(f: Path) -> Iterator[tuple[str, Any]]:
        if inputs.is_json_array(inputs.Input(str(f), "jsonl")):  # one JSON array of records (alpaca_data.json)
            try:
                items = inputs.json_items(str(f))
            except HpcUsageError as exc:
                raise NodeInputError(f"[data] source = {source!r}: {exc.message}") from exc
            yield from ((f"{f} item {i}", rec) for i, rec in enumerate(items))
            return
        with f.open("rb") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield f"{f}:{n}", sft.parse_line(line)
                    except sft.Bad as bad:
                        yield f"{f}:{n}", bad

    return [(str(f), lines(f)) for f in files]


def sft_docs(d: Any, tok: Tokenizer) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Every usable record of [data] source as one signed id array (the loss mask in the sign), and the
    tally of the records read (data/sft.py): a file none of whose records is usable is refused."""
    from hpctrain.data import sft

    renderer = sft.Renderer(d.format, sft_encoding(d, tok), d.seq_len, d.overlong, d.messages_field)
    total, docs = sft.Tally(), []
    for name, records in _sft_files(d.source):
        t = sft.Tally()
        for where, rec in records:
            got = sft.render_into(renderer, rec, where, t)
            if got is not None:
                docs.append(sft.signed(*got))
        if t.all_bad():
            raise NodeInputError(sft.all_bad_message(name, t))
        total.merge(t)
    if not docs:
        raise NodeInputError(f"[data] source = {d.source!r}: no records found. Fix: point it at {d.format} "
                             "records (docs/data.md).")
    return docs, total.to_json()


# ---------------------------------------------------------------------------------------------- batches
class Corpus(Protocol):
    """Pieces by index: an in-RAM list of token arrays, or a memory-mapped prepared folder (node/data/prepared.py)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class DataSource:
    """Micro-batches by global index, for a document corpus or a synthetic stream. `masked`: the documents
    carry an SFT loss mask as negative ids (module docstring); `report`: data/sft.py's Tally as JSON."""

    def __init__(self, docs: Corpus | None, *, mode: str, micro: int, seq_len: int, budget: int,
                 seed: int, pad_id: int, vocab: int, lengths: np.ndarray | None = None, masked: bool = False,
                 report: dict[str, Any] | None = None) -> None:
        self.docs, self.mode, self.micro, self.seq_len = docs, mode, micro, seq_len
        self.budget, self.seed, self.pad_id, self.vocab = budget, seed, pad_id, vocab
        self.masked, self.report = masked, report or {}
        if lengths is None and docs is not None:
            lengths = np.fromiter((len(docs[i]) for i in range(len(docs))), dtype=np.int64, count=len(docs))
        self.lengths = lengths
        self._plans: dict[int, EpochPlan] = {}
        self._epoch_len: int | None = None
        self._pending: tuple[int, Future[EpochPlan]] | None = None

    @property
    def synthetic(self) -> bool:
        return self.docs is None

    def batches_per_epoch(self) -> int:
        if self.synthetic:
            return 0
        if self._epoch_len is None:
            self._epoch_len = len(self._plan(0))
        return self._epoch_len

    def prefetch(self, epoch: int = 0) -> None:
        """Plan `epoch` on a background thread while the rank builds its engine (numpy's sorts release the
        GIL): a million documents take about a second to plan on a busy CPU, off the start-up's critical path."""
        if self.synthetic or epoch in self._plans or self._pending is not None:
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-plan")
        self._pending = (epoch, pool.submit(self._compute, epoch))
        pool.shutdown(wait=False)

    def _compute(self, epoch: int) -> EpochPlan:
        assert self.lengths is not None
        return plan_epoch(self.lengths, self.mode, self.micro, self.seq_len, self.budget, self.seed, epoch)

    def _plan(self, epoch: int) -> EpochPlan:
        # Computed on first use (or by prefetch) and kept for one epoch at a time.
        if epoch not in self._plans:
            pending, self._pending = self._pending, None
            plan = pending[1].result() if pending is not None and pending[0] == epoch else self._compute(epoch)
            self._plans = {epoch: plan}
        return self._plans[epoch]

    def batch(self, g: int) -> Batch:
        """Micro-batch number g (global over all data-parallel ranks)."""
        if self.synthetic:
            return self._synthetic(g)
        n = self.batches_per_epoch()  # every epoch has epoch 0's length, so g maps to (epoch, batch) alone
        plan = self._plan(g // n)
        b = g % n % len(plan)  # packing another permutation may give a few batches fewer: wrap, stay pure
        assert self.docs is not None
        if self.mode == "pack":
            return self._packed([[self.docs[int(i)] for i in row] for row in plan.rows(b)])
        docs = [self.docs[int(i)] for i in plan.pieces(b)]
        return self._padded(docs, self.seq_len if self.mode == "padded" else None)

    def _synthetic(self, g: int) -> Batch:
        # Learnable counting sequences (start, stride random): the loss visibly falls within tens of steps.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
        v = min(self.vocab, 256)
        start = torch.randint(0, v, (self.micro, 1), generator=gen)
        stride = torch.randint(1, 4, (self.micro, 1), generator=gen)
        x = (start + stride * torch.arange(self.seq_len)) % v
        return Batch(x, x.clone(), None, x.numel(), x.numel(), self.micro * (self.seq_len - 1))

    def _padded(self, docs: list[np.ndarray], length: int | None) -> Batch:
        width = length or _round_up(max(len(d) for d in docs), 8)
        x = np.full((len(docs), width), self.pad_id, dtype=np.int64)
        y = np.full((len(docs), width), IGNORE, dtype=np.int64)
        for r, d in enumerate(docs):
            ids, labels = self._split(d)
            x[r, :len(d)] = ids
            y[r, :len(d)] = labels
        real = sum(len(d) for d in docs)
        return Batch(torch.from_numpy(x), torch.from_numpy(y), None, real, x.size, _trained(y))

    def _split(self, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input ids, labels) of one document: the same array twice, or decoded from the SFT sign."""
        if not self.masked:
            return doc, doc
        return np.where(doc < 0, -doc - 1, doc), np.where(doc < 0, IGNORE, doc)

    def _packed(self, rows: list[list[np.ndarray]]) -> Batch:
        x = np.full((len(rows), self.seq_len), self.pad_id, dtype=np.int64)
        y = np.full_like(x, IGNORE)
        pos = np.zeros_like(x)
        real = 0
        for r, row in enumerate(rows):
            at = 0
            for doc in row:
                n = len(doc)
                ids, labels = self._split(doc)
                x[r, at:at + n] = ids
                y[r, at + 1:at + n] = labels[1:]  # never predict a document's first token from the previous one
                pos[r, at:at + n] = _ARANGE[:n] if n <= len(_ARANGE) else np.arange(n)
                at += n
                real += n
            # Pads continue counting so they form their own "document" and are not merged into the last one.
            pos[r, at:] = np.arange(self.seq_len - at)
        return Batch(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(pos), real, x.size, _trained(y))


def _trained(y: np.ndarray) -> int:
    # The model predicts labels[:, 1:] from the positions before them: the first label of a row never counts.
    return int(np.count_nonzero(y[:, 1:] != IGNORE))


_ARANGE = np.arange(1 << 16, dtype=np.int64)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def batching_mode(d: Any, force_padded: bool) -> str:
    return "padded" if force_padded else ("pack" if d.pack else ("dynamic" if d.dynamic_batching else "padded"))


def build_source(spec: Any, tok: Tokenizer, micro: int, vocab: int, force_padded: bool = False) -> DataSource:
    """The DataSource a spec asks for: synthetic, a prepared folder (memory-mapped, node/data/prepared.py), or raw
    text that every rank reads and tokenizes in RAM (small data only: [data] max_raw_bytes)."""
    from hpctrain.node.data import prepared

    d = spec.data
    budget = d.tokens_per_batch or micro * d.seq_len
    if d.source == "synthetic" or d.format == "synthetic":
        return DataSource(None, mode="padded", micro=micro, seq_len=d.seq_len, budget=budget,
                          seed=spec.train.seed, pad_id=tok.pad_id, vocab=vocab)
    mode = batching_mode(d, force_padded)
    if prepared.is_prepared_source(d.source, d.format):
        m = prepared.open_manifest(d.source, vocab, d.seq_len)
        _check_sft_folder(d, m)
        pieces = prepared.open_pieces(d.source, "train", m, d.seq_len)
        return DataSource(pieces, mode=mode, micro=micro, seq_len=d.seq_len, budget=budget, seed=spec.train.seed,
                          pad_id=prepared.pad_id(m), vocab=vocab, lengths=pieces.lengths, masked=m.masked,
                          report=m.records)
    if tok.vocab_size > vocab:
        raise NodeInputError(f"[data] tokenizer {d.tokenizer!r} has {tok.vocab_size} ids but the model's vocab_size "
                             f"is {vocab}; use a model with vocab_size >= {tok.vocab_size} (set [model] overrides).")
    prepared.check_raw_size(d.source, d.max_raw_bytes)
    if d.format in SFT_FORMATS:
        docs, report = sft_docs(d, tok)
        return DataSource(docs, mode=mode, micro=micro, seq_len=d.seq_len, budget=budget, seed=spec.train.seed,
                          pad_id=tok.pad_id, vocab=vocab, masked=True, report=report)
    texts = read_texts(d.source, d.format, d.text_field)
    docs = tokenize_docs(texts, tok, d.seq_len)
    return DataSource(docs, mode=mode, micro=micro, seq_len=d.seq_len, budget=budget, seed=spec.train.seed,
                      pad_id=tok.pad_id, vocab=vocab)


def build_eval_source(spec: Any, micro: int, vocab: int, force_padded: bool = False) -> DataSource | None:
    """The validation split of a prepared folder, batched like training; None when eval is off."""
    from hpctrain.node.data import prepared

    d, t = spec.data, spec.train
    if t.eval_every <= 0:
        return None
    if d.source == "synthetic" or d.format == "synthetic" or not prepared.is_prepared_source(d.source, d.format):
        raise NodeInputError(f"[train] eval_every = {t.eval_every}: evaluation reads the validation split of a "
                             f"prepared folder, and [data] source = {d.source!r} is not one. Fix: run "
                             f"`{prepared.PREPARE_HINT} --val-fraction 0.01` and set [data] source to the --out "
                             "folder, or set [train] eval_every = 0.")
    m = prepared.open_manifest(d.source, vocab, d.seq_len)
    if m.val.documents == 0:
        raise NodeInputError(f"[train] eval_every = {t.eval_every}: {d.source} has no validation split. Fix: "
                             f"prepare it again with --val-fraction (e.g. 0.01), or set [train] eval_every = 0.")
    pieces = prepared.open_pieces(d.source, "val", m, d.seq_len)
    budget = d.tokens_per_batch or micro * d.seq_len
    return DataSource(pieces, mode=batching_mode(d, force_padded), micro=micro, seq_len=d.seq_len, budget=budget,
                      seed=t.seed, pad_id=prepared.pad_id(m), vocab=vocab, lengths=pieces.lengths, masked=m.masked)


def _check_sft_folder(d: Any, m: Any) -> None:
    """format = alpaca/chat on a prepared folder: it must hold that format's masks, or every token would train."""
    made = str(m.options.get("format") or "text")
    if d.format in SFT_FORMATS and (not m.masked or made != d.format):
        raise NodeInputError(f"[data] format = {d.format!r}: {d.source} was prepared as {made!r}"
                             f"{'' if m.masked else ', without loss masks'}. Fix: prepare it with `hpctrain data "
                             f"prepare INPUT --format {d.format} --seq-len {d.seq_len} --tokenizer DIR --out DIR`, "
                             "or set [data] format = \"prepared\" to train on it as it is.")


def iter_epoch(src: DataSource) -> Iterator[Batch]:
    """All batches of epoch 0 (tests and the padding report)."""
    for g in range(src.batches_per_epoch()):
        yield src.batch(g)
