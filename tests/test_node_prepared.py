"""The node's lazy reader of prepared folders: same batches as the in-RAM path, plans from index lengths only,
exact resume by global index, vocabulary and size checks, evaluation inputs and their summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from datakit import build_tokenizer, stdlib_texts, write_prepared
from hpctrain.data import format as fmt
from hpctrain.errors import HpcUsageError
from hpctrain.node.data.epochplan import EpochPlan, plan_epoch
from hpctrain.node.data.loader import DataSource, build_eval_source, build_source, iter_epoch, tokenize_docs
from hpctrain.node.data.tokenize import ByteTokenizer, load_tokenizer
from hpctrain.node.runconf import NodeInputError, read_spec
from hpctrain.runs.folder import RunFolder
from runkit import make_run

SEQ = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    root = tmp_path_factory.mktemp("corpus")
    texts = stdlib_texts(40)  # several are longer than SEQ tokens: they become pieces
    tok = build_tokenizer(root / "tok", vocab_size=400)
    write_prepared(root / "prep", tok, texts, val_every=5, shard_docs=16)
    return root / "prep", tok, texts


def _spec(tmp_path: Path, data: dict, train: dict | None = None) -> object:
    return read_spec(RunFolder(make_run(tmp_path / "run", data=data, train=train or {})))


@pytest.mark.parametrize("mode", ["padded", "dynamic", "pack"])
def test_prepared_batches_equal_the_in_ram_path(corpus: tuple[Path, Path, list[str]], tmp_path: Path,
                                                mode: str) -> None:
    """A memory-mapped folder gives the batches the in-RAM path makes from the same text and tokenizer."""
    prep, tok_dir, texts = corpus
    flags = {"pack": mode == "pack", "dynamic_batching": mode == "dynamic"}
    lazy = build_source(_spec(tmp_path, {"source": str(prep), "tokenizer": str(tok_dir), "seq_len": SEQ, **flags}),
                        ByteTokenizer(), micro=4, vocab=512)
    tok = load_tokenizer(str(tok_dir))
    train_texts = [t for i, t in enumerate(texts) if i % 5]
    in_ram = DataSource(tokenize_docs(train_texts, tok, SEQ), mode=mode, micro=4, seq_len=SEQ, budget=4 * SEQ,
                        seed=lazy.seed, pad_id=lazy.pad_id, vocab=512)
    assert lazy.lengths is not None and int(lazy.lengths.max()) == SEQ  # long documents were cut into pieces
    assert len(lazy.lengths) > len(train_texts)
    assert lazy.batches_per_epoch() == in_ram.batches_per_epoch()
    for g in list(range(lazy.batches_per_epoch())) + [lazy.batches_per_epoch() + 3]:  # and into epoch 1
        a, b = lazy.batch(g), in_ram.batch(g)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels), g
        assert a.tokens == b.tokens


def test_resume_at_a_new_world_size_reads_the_same_stream(corpus: tuple[Path, Path, list[str]],
                                                          tmp_path: Path) -> None:
    """The data cursor is global micro-batches consumed: 3 steps at dp 4 then, in a fresh process's source,
    dp 2 from cursor 12 read exactly what an uninterrupted dp 2 run reads from its 7th step on."""
    prep = corpus[0]
    spec = _spec(tmp_path, {"source": str(prep), "seq_len": SEQ, "pack": True})

    def consumed(src: DataSource, cursor: int, dp: int, steps: int, gas: int = 1) -> list[torch.Tensor]:
        out = []
        for s in range(steps):
            for m in range(gas):
                out += [src.batch(cursor + (s * gas + m) * dp + r).input_ids for r in range(dp)]
        return out

    first = build_source(spec, ByteTokenizer(), micro=2, vocab=512)
    first.prefetch(0)  # as the node does: planned on a thread while the engine is built
    before = consumed(first, 0, dp=4, steps=3)
    resumed = consumed(build_source(spec, ByteTokenizer(), micro=2, vocab=512), 12, dp=2, steps=20)
    straight = consumed(build_source(spec, ByteTokenizer(), micro=2, vocab=512), 0, dp=2, steps=26)
    assert all(torch.equal(x, y) for x, y in zip(before + resumed, straight, strict=True))


def test_lean_reader_reads_what_the_format_reader_reads(corpus: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    """node/data/prepared.LeanSplit (memory-mapped offsets, int32 lengths) against data/format.PreparedSplit."""
    import shutil

    from hpctrain.node.data.prepared import LeanSplit

    prep = corpus[0]
    m = fmt.read_manifest(prep)
    for split in ("train", "val"):
        lean, ref = LeanSplit(prep, split, m), fmt.PreparedSplit(prep, split, m)
        assert lean.lengths.tolist() == ref.lengths.tolist() and lean.lengths.dtype == np.int32
        assert all(np.array_equal(lean.doc(i), ref.doc(i)) for i in range(len(ref)))
    bad = tmp_path / "bad"
    shutil.copytree(prep, bad)
    (bad / "train" / "shard-00001.idx").write_bytes(np.asarray([0, 1], dtype=np.int64).tobytes())
    with pytest.raises(fmt.PreparedFormatError, match="the manifest says"):
        LeanSplit(bad, "train", m)
    (bad / "train" / "shard-00001.idx").unlink()
    with pytest.raises(fmt.PreparedFormatError, match="the manifest says"):
        LeanSplit(bad, "train", m)


def test_plan_holds_arrays_and_covers_each_piece_once() -> None:
    rng = np.random.default_rng(5)
    seq = 512
    lengths = np.minimum(seq, np.maximum(2, rng.lognormal(np.log(seq / 6), 1.0, size=50_000))).astype(np.int64)
    for mode in ("padded", "dynamic", "pack"):
        plan = plan_epoch(lengths, mode, 4, seq, 4 * seq, seed=1, epoch=2)
        assert isinstance(plan, EpochPlan) and isinstance(plan.members, np.ndarray)  # no per-document lists
        assert np.array_equal(np.sort(plan.members), np.arange(len(lengths)))
        rows = [r for b in range(len(plan)) for r in plan.rows(b)]
        if mode != "dynamic":  # dynamic batches hold as many rows as the token budget allows
            assert all(len(plan.rows(b)) <= 4 for b in range(len(plan)))
        if mode == "pack":
            assert max(int(lengths[r].sum()) for r in rows) <= seq
            assert 1 - lengths.sum() / (len(rows) * seq) < 0.03  # first-fit decreasing: little padding
        if mode == "dynamic":
            assert all(len(p) * ((int(lengths[p].max()) + 7) // 8 * 8) <= 4 * seq
                       for p in (plan.pieces(b) for b in range(len(plan))))
    a = plan_epoch(lengths, "pack", 4, seq, 4 * seq, seed=1, epoch=0)
    b = plan_epoch(lengths, "pack", 4, seq, 4 * seq, seed=1, epoch=1)
    assert a[0] != b[0]  # a new epoch, a new order


def test_vocabulary_larger_than_the_model_is_refused(corpus: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    prep, _, _ = corpus
    spec = _spec(tmp_path, {"source": str(prep)})
    with pytest.raises(NodeInputError, match=r"tokenizer of \d+ ids, but the model's vocab_size is 300"):
        build_source(spec, ByteTokenizer(), micro=2, vocab=300)


def test_prepared_format_without_manifest_names_the_prepare_command(tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    fmt.write_shard(tmp_path / "half", "train", 0, [np.arange(5)], "uint16")  # a killed prepare
    spec = _spec(tmp_path, {"source": str(tmp_path / "half"), "format": "prepared"})
    with pytest.raises(NodeInputError, match="hpctrain data prepare INPUT --tokenizer DIR --out DIR"):
        build_source(spec, ByteTokenizer(), micro=2, vocab=512)


def test_raw_text_over_the_limit_points_to_prepare(tmp_path: Path) -> None:
    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * 100}) + "\n" for _ in range(50)))
    spec = _spec(tmp_path, {"source": str(data), "max_raw_bytes": 1000})
    with pytest.raises(NodeInputError, match=r"max_raw_bytes = 1000 .*hpctrain data prepare INPUT --tokenizer DIR"):
        build_source(spec, ByteTokenizer(), micro=2, vocab=512)
    small = _spec(tmp_path / "ok", {"source": str(data), "max_raw_bytes": 0})  # 0 = no limit
    assert build_source(small, ByteTokenizer(), micro=2, vocab=512).batches_per_epoch() > 0


def test_eval_reads_the_val_split_and_needs_one(corpus: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    prep, _, _ = corpus
    src = build_eval_source(_spec(tmp_path, {"source": str(prep), "seq_len": SEQ}, {"eval_every": 2}), 2, 512)
    assert src is not None and sum(b.tokens for b in iter_epoch(src)) == fmt.read_manifest(prep).val.tokens
    assert build_eval_source(_spec(tmp_path / "off", {"source": str(prep)}), 2, 512) is None
    raw = tmp_path / "t.txt"
    raw.write_text("some text\nmore text\n")
    with pytest.raises(NodeInputError, match="validation split of a prepared folder"):
        build_eval_source(_spec(tmp_path / "raw", {"source": str(raw)}, {"eval_every": 2}), 2, 512)


def test_eval_rules_refuse_pipeline_and_synthetic(tmp_path: Path) -> None:
    from hpctrain.spec.model import from_toml_text
    from runkit import spec_toml, tiny_tables

    def spec(**sections: dict) -> object:
        return from_toml_text(spec_toml(tiny_tables(**sections)))

    with pytest.raises(HpcUsageError, match="pipeline-parallel"):
        spec(data={"source": str(tmp_path)}, train={"eval_every": 5}, parallel={"pp": 2, "zero": 1})
    with pytest.raises(HpcUsageError, match="synthetic data has no validation split"):
        spec(train={"eval_every": 5})
    assert spec(data={"source": str(tmp_path)}, train={"eval_every": 5}).train.eval_every == 5


def test_summary_and_plot_carry_the_eval_loss(tmp_path: Path) -> None:
    """metrics.jsonl lines with eval_loss -> summary totals.eval (last and best, valid against the schema)
    and an eval series on the plot's loss panel."""
    from hpctrain.collect import plot
    from hpctrain.collect import summary as collect
    from summary_schema import summary_errors

    run = make_run(tmp_path / "run")
    (run / "metrics").mkdir(exist_ok=True)
    evals = {2: 3.0, 4: 2.5, 6: 2.7}
    (run / "metrics" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 4.0 - s / 10, "tokens_per_s": 100.0, "time": 1000.0 + s,
                    **({"eval_loss": evals[s], "eval_ppl": float(np.exp(evals[s]))} if s in evals else {})}) + "\n"
        for s in range(1, 7)))
    rec = collect.build_run(collect.from_folder(run))
    e = rec["totals"]["eval"]
    assert (e["last_step"], e["last_loss"], e["best_step"], e["best_loss"]) == (6, 2.7, 4, 2.5)
    assert e["best_ppl"] == pytest.approx(np.exp(2.5))
    assert summary_errors({"schema_version": collect.SCHEMA_VERSION, "generated": 0.0, "runs": [rec], "errors": [],
                           "warnings": []}) == []
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    drawn: list[tuple[list, list]] = []
    real_plot = plt.Axes.plot

    def spy(self: object, xs: list, ys: list, *a: object, **k: object) -> object:
        if k.get("marker") == "o":
            drawn.append((list(xs), list(ys)))
        return real_plot(self, xs, ys, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Axes, "plot", spy)
        plot.plot_runs([rec], tmp_path / "p.png")
    assert drawn == [([2, 4, 6], [3.0, 2.5, 2.7])]


def test_every_epoch_index_is_readable_when_epochs_pack_differently() -> None:
    """Packing another permutation can give fewer batches than epoch 0: g still maps to a batch."""
    rng = np.random.default_rng(2)
    docs = [np.arange(int(k)) % 250 for k in rng.integers(2, 64, size=300)]
    src = DataSource(docs, mode="pack", micro=2, seq_len=64, budget=128, seed=9, pad_id=0, vocab=320)
    n = src.batches_per_epoch()
    lens = {len(plan_epoch(src.lengths, "pack", 2, 64, 128, 9, e)) for e in range(8)}  # type: ignore[arg-type]
    assert len(lens) > 1, lens  # the case is real
    assert all(src.batch(g).tokens > 0 for g in range(0, 8 * n, 7))
