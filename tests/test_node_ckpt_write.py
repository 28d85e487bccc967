"""The parallel checkpoint writer: the file is the one torch.save writes, whatever the state holds."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hpctrain.node.checkpointing import checkpoint as ckpt
from hpctrain.node.checkpointing import ckpt_async, ckpt_write


def _state() -> dict[str, object]:
    flat = torch.arange(3000, dtype=torch.float32)
    return {"a": flat[:1000], "b": flat[1000:], "tied": flat[:1000], "bf": torch.randn(7).to(torch.bfloat16),
            "p": torch.nn.Parameter(torch.randn(5)), "e": torch.empty(0), "i": torch.arange(9).view(3, 3).t(),
            "nested": {"x": [torch.ones(2, dtype=torch.int8)], "n": 3, "s": "text"}}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) and a.stride() == b.stride()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_round_trip_keeps_values_views_and_sharing(tmp_path: Path) -> None:
    sd = _state()
    size = ckpt.write_file(sd, tmp_path / "f.pt")
    back = torch.load(tmp_path / "f.pt", weights_only=False)
    assert _same(sd, back) and size == (tmp_path / "f.pt").stat().st_size
    assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()  # one storage, shared
    assert isinstance(back["p"], torch.nn.Parameter)
    assert zipfile.ZipFile(tmp_path / "f.pt").namelist()  # the index check validate_files makes


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_pieces_of_large_storages_land_at_their_offsets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        threads: int) -> None:
    monkeypatch.setattr(ckpt_write, "PIECE", 4096 * 3)  # many pieces per storage, written out of order
    sd = {"m": torch.randn(100_000), "v": torch.randn(33_333), "w": torch.arange(5, dtype=torch.int64)}
    assert ckpt_write.write_parallel(sd, tmp_path / "f.pt", threads) is not None
    assert _same(sd, torch.load(tmp_path / "f.pt"))


def test_same_file_as_the_one_thread_writer(tmp_path: Path) -> None:
    sd = _state()
    ckpt.write_file(sd, tmp_path / "par.pt")
    ckpt.write_serial(sd, tmp_path / "one.pt")
    assert _same(torch.load(tmp_path / "par.pt", weights_only=False),
                 torch.load(tmp_path / "one.pt", weights_only=False))


def test_declined_layout_falls_back_to_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_write, "_layout", lambda state, path: None)
    sd = _state()
    ckpt.write_file(sd, tmp_path / "f.pt")
    assert _same(sd, torch.load(tmp_path / "f.pt", weights_only=False))


def test_global_torch_options_are_restored(tmp_path: Path) -> None:
    import torch.utils.serialization.config as scfg

    before = scfg.save.storage_alignment
    ckpt.write_file(_state(), tmp_path / "f.pt")
    assert scfg.save.storage_alignment == before


def test_writers_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTRAIN_CKPT_WRITERS", "6")
    assert ckpt_write.writers() == 6
    monkeypatch.setenv("HPCTRAIN_CKPT_WRITERS", "lots")
    assert ckpt_write.writers() == 4


def test_reserved_arena_serves_the_first_snapshot_without_allocating() -> None:
    arena = ckpt_async.Arena(pin=False)
    arena.reserve(1 << 20)
    sd = {"a": torch.randn(1000), "b": torch.randn(2000)}
    ckpt_async.snapshot(sd, arena, {})
    assert len(arena.chunks) == 1 and arena.capacity >= 1 << 20  # both fit the reserved chunk
    arena.reserve(1 << 20)  # a second reserve is a no-op once buffers exist
    assert len(arena.chunks) == 1
