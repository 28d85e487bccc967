"""The prepared-corpus format: what the writer puts on disk is what every rank's memory map reads back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpctrain.data import format as fmt


def _write(folder: Path, docs: list[list[int]], vocab: int = 100) -> fmt.Manifest:
    dtype = fmt.dtype_for(vocab)
    arrays = [np.asarray(d) for d in docs]
    shards = (fmt.write_shard(folder, "train", 0, arrays[:2], dtype),
              fmt.write_shard(folder, "train", 1, arrays[2:], dtype))
    m = fmt.Manifest(vocab_size=vocab, dtype=dtype, train=fmt.Split(
        tokens=sum(s.tokens for s in shards), documents=len(docs), shards=shards))
    fmt.write_manifest(folder, m)
    return m


def test_round_trip_across_shards(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    m = _write(tmp_path, docs)
    assert fmt.is_prepared(tmp_path) and fmt.read_manifest(tmp_path) == m
    split = fmt.PreparedSplit(tmp_path)
    assert split.lengths.tolist() == [3, 5, 1, 2]
    assert [split.doc(i).tolist() for i in range(len(split))] == docs
    assert split.doc(0).dtype == np.uint16


def test_dtype_by_vocabulary() -> None:
    assert fmt.dtype_for(50_000) == "uint16" and fmt.dtype_for(65_536) == "uint16"
    assert fmt.dtype_for(65_537) == "uint32" and fmt.dtype_for(128_256) == "uint32"


def test_no_manifest_is_not_prepared(tmp_path: Path) -> None:
    fmt.write_shard(tmp_path, "train", 0, [np.arange(4)], "uint16")  # a killed prepare: shards, no manifest
    assert not fmt.is_prepared(tmp_path)


def test_index_that_disagrees_with_the_manifest_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, [[1, 2], [3], [4, 5, 6]])
    (tmp_path / "train" / "shard-00001.idx").write_bytes(np.asarray([0, 1], dtype=np.int64).tobytes())
    with pytest.raises(fmt.PreparedFormatError, match="the manifest says"):
        fmt.PreparedSplit(tmp_path)


def test_other_format_version_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, [[1], [2], [3]])
    raw = (tmp_path / fmt.MANIFEST).read_text().replace(f'"version": {fmt.VERSION}', '"version": 99')
    (tmp_path / fmt.MANIFEST).write_text(raw)
    with pytest.raises(fmt.PreparedFormatError, match="prepare` again"):
        fmt.read_manifest(tmp_path)


@pytest.mark.parametrize("named", ["auto", "jsonl", "text", "prepared"])
def test_a_prepared_folder_is_read_as_one_whatever_raw_format_is_named(tmp_path: Path, named: str) -> None:
    from hpctrain.node.data.prepared import is_prepared_source

    _write(tmp_path, [[1, 2], [3], [4, 5, 6]])
    assert is_prepared_source(str(tmp_path), named)  # never its manifest.json read as a jsonl document
    assert not is_prepared_source(str(tmp_path), "arrow")
