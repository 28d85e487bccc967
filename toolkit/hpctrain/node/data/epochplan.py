"""The batches of one epoch as a few flat numpy arrays: planning a million documents holds no Python object
per document and takes a fraction of a second (bench/loader_bench.py measures it).

A plan is pure in (lengths, mode, micro, seq_len, budget, seed, epoch), so every rank computes the same one
and reads only its own batches from it. Rows hold piece ids (a piece is a document, or a seq_len part of a
longer one); a batch is a run of rows:

    padded   `micro` pieces of the epoch's permutation per batch, each padded to seq_len (the baseline)
    dynamic  pieces sorted by length inside windows, cut into batches whose rows x longest row <= budget
    pack     rows filled to seq_len by first-fit decreasing inside windows of the epoch's permutation
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PLAN_WINDOW = 256  # dynamic batching sorts by length inside windows of this many batches' worth of docs
# (plan_epoch on 20,000 log-normal lengths, median seq/6, micro 4, seq 4096: 2.8% padding with 256, 8.3% with 64)
PACK_WINDOW = 256  # packing runs first-fit decreasing inside windows of this many pieces
# (1M log-normal lengths, median seq/6, seq 4096: 1.0% padding in 0.4 s; the greedy look-back-8 first fit it
# replaces: 1.6% in 2.2 s, one Python step per document)


@dataclass(frozen=True)
class EpochPlan:
    """Batch b is rows [batch_bounds[order[b]], batch_bounds[order[b] + 1]); row r holds the pieces
    members[row_bounds[q]:row_bounds[q + 1]] with q = row_order[r] (row_bounds None: one piece per row)."""

    members: np.ndarray
    row_bounds: np.ndarray | None
    batch_bounds: np.ndarray
    order: np.ndarray
    row_order: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.order)

    def rows(self, b: int) -> list[np.ndarray]:
        """The rows of batch b in training order, each an array of piece ids."""
        k = int(self.order[b])
        r0, r1 = int(self.batch_bounds[k]), int(self.batch_bounds[k + 1])
        if self.row_bounds is None:
            return [self.members[r:r + 1] for r in range(r0, r1)]
        rb = self.row_bounds
        qs = range(r0, r1) if self.row_order is None else (int(q) for q in self.row_order[r0:r1])
        return [self.members[int(rb[q]):int(rb[q + 1])] for q in qs]

    def pieces(self, b: int) -> np.ndarray:
        """Every piece id of batch b (rows concatenated)."""
        k = int(self.order[b])
        r0, r1 = int(self.batch_bounds[k]), int(self.batch_bounds[k + 1])
        if self.row_bounds is None:
            return self.members[r0:r1]
        return np.concatenate(self.rows(b)) if r1 > r0 else self.members[:0]

    def __getitem__(self, b: int) -> list[int]:
        return [int(i) for i in self.pieces(b)]


def plan_epoch(lengths: np.ndarray, mode: str, micro: int, seq_len: int, budget: int, seed: int,
               epoch: int) -> EpochPlan:
    """The batches of one epoch, in training order (pure in its inputs)."""
    rng = np.random.default_rng([seed, epoch])
    n = len(lengths)
    # rng.permutation(n) is arange + shuffle: the same order, without its int64 copy of every index
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    rng.shuffle(order)
    if mode == "padded":
        bounds = np.minimum(np.arange(0, n + micro, micro, dtype=np.int64), n)
        bounds = bounds[:int(np.searchsorted(bounds, n)) + 1]
        return EpochPlan(order, None, bounds, rng.permutation(len(bounds) - 1))
    if mode == "dynamic":
        members, bounds = _bucket(order, lengths, budget, micro * PLAN_WINDOW)
        return EpochPlan(members, None, bounds, rng.permutation(len(bounds) - 1))
    if mode == "pack":
        members, row_bounds = _pack(order, lengths, seq_len, PACK_WINDOW)
        rows = len(row_bounds) - 1
        # Rows come out grouped by window and by size; shuffling them spreads both through the epoch.
        row_order = rng.permutation(rows).astype(np.int32 if rows < 2**31 else np.int64)
        bounds = np.minimum(np.arange(0, rows + micro, micro, dtype=np.int64), rows)
        bounds = bounds[:int(np.searchsorted(bounds, rows)) + 1]
        return EpochPlan(members, row_bounds, bounds, rng.permutation(len(bounds) - 1), row_order)
    raise ValueError(f"unknown batching mode {mode!r}")


def _windows(n: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    starts = np.arange(0, n, window, dtype=np.int64)
    return starts, np.minimum(starts + window, n)


def _bucket(order: np.ndarray, lengths: np.ndarray, budget: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Sort by length inside each window, then cut greedily: a batch [p, q) keeps (q - p) * longest <= budget
    (longest rounded up to 8); at least one piece per batch. Batches in window order, ascending length."""
    n = len(order)
    win = np.arange(n) // window
    sorted_order = order[np.lexsort((lengths[order], win))]  # stable: ties keep the permutation's order
    rounded = (lengths[sorted_order] + 7) // 8 * 8
    starts, ends = _windows(n, window)
    p = starts.copy()
    cuts: list[np.ndarray] = []
    active = np.nonzero(p < ends)[0]
    while len(active):
        pa, ea = p[active], ends[active]
        lo, hi = pa + 1, ea.copy()  # the largest q in [lo, hi] that fits; lo always does
        while True:
            open_ = lo < hi
            if not open_.any():
                break
            mid = (lo + hi + 1) // 2
            ok = (mid - pa) * rounded[np.maximum(mid - 1, 0)] <= budget
            lo = np.where(open_ & ok, mid, lo)
            hi = np.where(open_ & ~ok, mid - 1, hi)
        cuts.append(lo)
        p[active] = lo
        active = active[lo < ea]
    ends_all = np.sort(np.concatenate(cuts)) if cuts else np.zeros(0, dtype=np.int64)
    return sorted_order, np.concatenate([[0], ends_all]).astype(np.int64)


PACK_CHUNK = 256  # windows packed together: bounds the sort buffers to a few MB whatever the corpus


def _pack(order: np.ndarray, lengths: np.ndarray, seq_len: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit decreasing inside each window of the epoch's order, PACK_CHUNK windows at a time (windows are
    independent, so the result is the same as packing all at once). Returns (members, row_bounds)."""
    step = window * PACK_CHUNK
    parts = [_pack_windows(order[i:i + step], lengths, seq_len, window) for i in range(0, len(order), step)]
    if len(parts) <= 1:
        return parts[0] if parts else (np.zeros(0, dtype=order.dtype), np.zeros(1, dtype=np.int64))
    members = np.concatenate([m for m, _ in parts])
    shifts = np.cumsum([0] + [int(rb[-1]) for _, rb in parts[:-1]])
    row_bounds = np.concatenate([[0], *(rb[1:] + s for (_, rb), s in zip(parts, shifts, strict=True))])
    return members, row_bounds.astype(np.int64)


def _pack_windows(order: np.ndarray, lengths: np.ndarray, seq_len: int,
                  window: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit decreasing inside each window of `order`: a piece goes into the first row of its window with
    room for it. The loop runs over the window's positions, vectorised across the windows (the
    (windows x rows) room matrix is the whole state)."""
    n = len(order)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    nwin = (n + window - 1) // window
    ln = np.zeros(nwin * window, dtype=np.int32)  # the last window is padded with empty pieces, dropped below
    ln[:n] = lengths[order]
    srt = np.argsort(-ln.reshape(nwin, window), axis=1, kind="stable").astype(np.int32)
    sl = np.take_along_axis(ln.reshape(nwin, window), srt, 1)
    del ln
    room = np.full((nwin, window + 1), seq_len, dtype=np.int32)
    flat, base = room.reshape(-1), np.arange(nwin) * (window + 1)
    row = np.empty((nwin, window), dtype=np.int32)
    opened = 1  # columns in use; the last one is always an empty row, so every piece fits somewhere
    for j in range(window):
        lj = sl[:, j]
        r = np.argmax(room[:, :opened] >= lj[:, None], axis=1)
        flat[base + r] -= lj
        row[:, j] = r
        opened = min(max(opened, int(r.max()) + 2), window + 1)
    del room, sl
    small: type[np.signedinteger[Any]] = np.int32 if nwin * (window + 1) < 2**31 else np.int64
    first: np.ndarray = np.arange(nwin, dtype=small)[:, None]
    pos = (first * window + srt).reshape(-1)  # where each sorted piece sits in `order`
    del srt
    key = (first * (window + 1) + row).reshape(-1)
    del row
    keep = pos < n
    key, pos = key[keep], pos[keep]
    by_row = np.argsort(key, kind="stable")
    counts = np.bincount(key, minlength=nwin * (window + 1))
    del key
    counts = counts[counts > 0]
    return order[pos[by_row]], np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
