"""Node trainer pieces that need no process group: env detection, data, schedule, checkpoint files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from hpctrain.node import dist
from hpctrain.node.checkpointing import checkpoint as ckpt
from hpctrain.node.data.loader import IGNORE, DataSource, iter_epoch, tokenize_docs
from hpctrain.node.data.tokenize import ByteTokenizer
from hpctrain.node.runconf import NodeInputError
from hpctrain.nodelist import rendezvous_port
from runkit import make_run, spec_only


def _docs(n: int = 300, seq_len: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    texts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, size=int(k))) for k in rng.integers(3, 150, size=n)]
    return tokenize_docs(texts, ByteTokenizer(), seq_len)


def _source(docs: list[np.ndarray], mode: str) -> DataSource:
    return DataSource(docs, mode=mode, micro=4, seq_len=64, budget=4 * 64, seed=3, pad_id=256, vocab=320)


# ------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("mode", ["dynamic", "pack"])
def test_dynamic_batching_same_tokens_less_padding(mode: str) -> None:
    docs = _docs()
    padded, other = list(iter_epoch(_source(docs, "padded"))), list(iter_epoch(_source(docs, mode)))

    def token_multiset(batches: list) -> list[tuple[int, ...]]:
        seqs = []
        for b in batches:
            rows = b.input_ids.tolist()
            for r, row in enumerate(rows):
                if b.position_ids is None:
                    seqs.append(tuple(t for t in row if t != 256))
                else:  # split a packed row at position resets
                    pos = b.position_ids[r].tolist()
                    cur: list[int] = []
                    for t, p in zip(row, pos, strict=True):
                        if p == 0 and cur:
                            seqs.append(tuple(cur))
                            cur = []
                        if t != 256:
                            cur.append(t)
                    if cur:
                        seqs.append(tuple(cur))
        return sorted(s for s in seqs if s)

    assert token_multiset(padded) == token_multiset(other)
    assert sum(b.tokens for b in padded) == sum(b.tokens for b in other)
    pad_frac = lambda bs: 1 - sum(b.tokens for b in bs) / sum(b.slots for b in bs)
    assert pad_frac(other) < 0.5 * pad_frac(padded), (pad_frac(other), pad_frac(padded))
    assert max(b.slots for b in other) <= 4 * 64  # the token budget holds


def test_batches_are_a_pure_function_of_their_index() -> None:
    docs = _docs()
    a, b = _source(docs, "dynamic"), _source(docs, "dynamic")
    for g in (0, 5, 1000, 77):  # any order, across epochs
        assert torch.equal(a.batch(g).input_ids, b.batch(g).input_ids)
    synth = DataSource(None, mode="padded", micro=2, seq_len=16, budget=32, seed=1, pad_id=256, vocab=320)
    assert torch.equal(synth.batch(9).input_ids, synth.batch(9).input_ids)
    assert not torch.equal(synth.batch(9).input_ids, synth.batch(10).input_ids)


def test_packed_rows_attend_only_within_their_document() -> None:
    """A packed row gives every document the same logits as the document alone (block-diagonal mask)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpctrain.spec.presets import preset_config

    d = preset_config("llama-tiny")
    d.pop("architectures")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d)).eval()
    src = _source(_docs(40), "pack")
    candidates = ((b, r) for b in iter_epoch(src) for r in range(b.input_ids.shape[0]))
    for b, r in candidates:  # a row that several documents share
        row, pos = b.input_ids[r:r + 1], b.position_ids[r:r + 1]
        starts = [i for i, p in enumerate(pos[0].tolist()) if p == 0]
        if len(starts) >= 3:
            break
    else:
        pytest.fail("no packed row holds three documents")
    with torch.no_grad():
        packed = model(input_ids=row, position_ids=pos).logits[0]
        s, e = starts[1], starts[2]
        alone = model(input_ids=row[:, s:e]).logits[0]
    torch.testing.assert_close(packed[s:e], alone, rtol=1e-4, atol=1e-4)
    assert b.labels[r, s].item() == IGNORE  # a document's first token is not predicted across the boundary


# ------------------------------------------------------------------------------------------ env
def test_detect_from_slurm_env() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_NODEID": "2"}
    d = dist.detect(env)
    assert (d.rank, d.local_rank, d.world_size, d.master_addr, d.source) == (5, 1, 8, "gpu07", "slurm")
    assert d.master_port == rendezvous_port("4242") == dist.detect(env).master_port
    assert set(d.exports()) == set(dist.TORCH_VARS)


def test_detect_prefers_launcher_vars_then_submitit() -> None:
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
                "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert dist.detect(torchrun).source == "torch"
    local = {"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
             "SUBMITIT_LOCAL_JOB_ID": "999"}
    d = dist.detect(local)
    assert (d.rank, d.world_size, d.master_addr, d.source) == (1, 2, "127.0.0.1", "submitit-local")


def test_cuda_arch_list_is_normalised() -> None:
    env = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    dist.fix_cuda_arch_list(env)
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    env = {"TORCH_CUDA_ARCH_LIST": "8.0 9.0a+PTX;9.0"}
    dist.fix_cuda_arch_list(env)
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX;9.0"


# ------------------------------------------------------------------------------------------ schedule
def test_warmup_cosine_schedule(tmp_path: Path) -> None:
    from hpctrain.node.runconf import read_spec
    from hpctrain.node.train import lr_lambda
    from hpctrain.runs.folder import RunFolder

    spec = read_spec(RunFolder(make_run(tmp_path, train={"steps": 100, "warmup_steps": 10, "lr": 1e-3,
                                                         "min_lr": 1e-4})))
    fn = lr_lambda(spec)
    assert fn(0) == pytest.approx(0.1) and fn(9) == pytest.approx(1.0)
    assert fn(10) == pytest.approx(1.0) and fn(100) == pytest.approx(0.1)
    assert fn(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("sections, needle", [
    ({"data": {"source": "/nonexistent/data.jsonl"}}, "/nonexistent/data.jsonl"),
    ({"parallel": {"tp": 2}}, "tp"),  # the plan has 2 ranks; this allocation has 1
])
def test_bad_input_is_one_clear_message(tmp_path: Path, sections: dict, needle: str) -> None:
    from hpctrain.node.train import prepare

    run = make_run(tmp_path / "run", **sections)
    with pytest.raises(NodeInputError, match=needle.replace("/", ".")):
        prepare(run, dist.detect({}))


@pytest.mark.parametrize("sections, needle", [
    ({"model": {"config": "", "path": "/nonexistent/model"}}, "/nonexistent/model"),
    ({"model": {"config": "llama-huge"}}, "llama-tiny"),
    ({"train": {"lr": 1e-4, "min_lr": 1e-3}}, "min_lr"),  # the spec's own validation, as on the login side
])
def test_a_spec_edited_after_submit_is_one_clear_message(tmp_path: Path, sections: dict, needle: str) -> None:
    """Input `hpctrain submit` refuses, in a spec.toml edited by hand: the node names it the same way."""
    from hpctrain.node.train import prepare

    run = spec_only(tmp_path / "run", **sections)
    with pytest.raises(NodeInputError, match=needle.replace("/", ".")):
        prepare(run, dist.detect({}))


@pytest.mark.parametrize("missing", ["spec.toml", "plan.json", "ds_config.json"])
def test_a_run_folder_not_written_by_submit_is_refused(tmp_path: Path, missing: str) -> None:
    """The node never plans or builds a DeepSpeed config: a missing file is named, with how to create it."""
    from hpctrain.node.train import prepare

    run = make_run(tmp_path / "run")
    (run / missing).unlink()
    with pytest.raises(NodeInputError) as err:
        prepare(run, dist.detect({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}))
    assert str(run / missing) in str(err.value) and "hpctrain submit" in str(err.value)


def test_a_ds_config_without_its_batch_sizes_is_named(tmp_path: Path) -> None:
    from hpctrain.node.train import prepare

    run = make_run(tmp_path / "run")
    cfg = json.loads((run / "ds_config.json").read_text())
    del cfg["gradient_accumulation_steps"]
    (run / "ds_config.json").write_text(json.dumps(cfg))
    with pytest.raises(NodeInputError, match="ds_config.json: gradient_accumulation_steps = None"):
        prepare(run, dist.detect({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}))


def test_dataset_without_text_field(tmp_path: Path) -> None:
    from hpctrain.node.train import prepare

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"content": "hello"}) + "\n")
    run = make_run(tmp_path / "run", data={"source": str(data)})
    with pytest.raises(NodeInputError) as err:
        prepare(run, dist.detect({}))
    assert str(data) in str(err.value) and "text_field" in str(err.value) and "content" in str(err.value)


# ------------------------------------------------------------------------------------------ checkpoint files
def _fake_ckpt(root: Path, step: int, complete: bool = True) -> Path:
    d = root / f"step-{step}"
    d.mkdir(parents=True)
    f = d / "mp_rank_00_model_states.pt"
    torch.save({"x": torch.zeros(3)}, f)
    if complete:
        (d / ckpt.MARKER).write_text(json.dumps({"step": step, "dp": 2, "zero": 3,
                                                  "files": {f.name: f.stat().st_size}}))
    return d


def test_resume_picks_latest_complete_and_ignores_partial(tmp_path: Path) -> None:
    assert ckpt.find_resume(tmp_path) is None
    _fake_ckpt(tmp_path, 10)
    _fake_ckpt(tmp_path, 20, complete=False)  # a crash mid-save: no marker
    assert ckpt.find_resume(tmp_path).tag == "step-10"  # type: ignore[union-attr]
    (tmp_path / "latest").write_text("step-20\n")  # names the partial one: passed over (the rule, runs.checkpoints)
    assert ckpt.find_resume(tmp_path).tag == "step-10"  # type: ignore[union-attr]


def test_truncated_checkpoint_file_is_named(tmp_path: Path) -> None:
    d = _fake_ckpt(tmp_path, 10)
    (tmp_path / "latest").write_text("step-10\n")
    f = d / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:-20])
    with pytest.raises(NodeInputError) as err:
        ckpt.find_resume(tmp_path)
    assert str(f) in str(err.value) and "delete" in str(err.value)


def test_prune_keeps_last_k(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        _fake_ckpt(tmp_path, s)
    (tmp_path / ".tmp-step-40").mkdir()
    ckpt.prune(tmp_path, keep=2)
    assert ckpt.complete_steps(tmp_path) == [20, 30]
    assert not (tmp_path / ".tmp-step-40").exists()


def test_world_size_change_needs_universal_or_refuses() -> None:
    assert ckpt.needs_universal({"dp": 2, "zero": 3}, dp=4, pp=1, tp=1)
    assert not ckpt.needs_universal({"dp": 2, "zero": 0}, dp=4, pp=1, tp=1)
    with pytest.raises(NodeInputError, match="pp=2"):
        ckpt.needs_universal({"dp": 1, "pp": 2, "zero": 1}, dp=2, pp=1, tp=1)


def test_entry_is_torch_free() -> None:
    import subprocess
    import sys

    code = ("import sys, hpctrain.node.launch.entry; "
            "print([m for m in ('torch','deepspeed','transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_allocation_edits_are_the_only_changes_to_the_rendered_config() -> None:
    """Same allocation as planned: the config as rendered, no edits. Otherwise one line per change."""
    from hpctrain.node.runconf import effective_ds_config

    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
            "zero_optimization": {"stage": 3}}
    assert effective_ds_config(base, dp=2, universal=False, use_gpu=True, env={}) == (base, [])
    cfg, edits = effective_ds_config(base, dp=4, universal=True, use_gpu=True, env={})
    assert cfg["train_batch_size"] == 16 and cfg["checkpoint"] == {"load_universal": True}
    assert [e.split(" ")[0] for e in edits] == ["train_batch_size", "checkpoint.load_universal"]
    assert base["train_batch_size"] == 8 and "checkpoint" not in base  # the rendered dict is left alone
    cfg, edits = effective_ds_config(base, dp=2, universal=False, use_gpu=True, env={"HPCTRAIN_DS_ADAM": "1"})
    assert cfg["optimizer"]["params"] == {"lr": 1e-4} and len(edits) == 2
    cfg, edits = effective_ds_config(base, dp=2, universal=False, use_gpu=False, env={})  # DS_ACCELERATOR=cpu
    assert cfg["optimizer"]["params"] == {"lr": 1e-4, "torch_adam": True} and edits[0].startswith("optimizer")
    tp = {k: v for k, v in base.items() if k != "train_batch_size"}  # AutoTP: DeepSpeed derives it
    assert effective_ds_config(tp, dp=1, universal=False, use_gpu=True, env={}) == (tp, [])


def test_fused_adamw_steps_follow_their_parameters() -> None:
    """A universal-checkpoint load leaves `step` as an int CPU tensor; the fused kernel wants float32 on
    the parameter's device (a CUDA-only failure, so the move itself is what is checked here)."""
    import types

    import torch

    from hpctrain.node.checkpointing.checkpointer import align_optimizer_steps

    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], fused=True)
    p.grad = torch.ones(4)
    opt.step()
    opt.state[p]["step"] = torch.tensor(3, dtype=torch.int64)
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=opt))
    assert align_optimizer_steps(engine) == 1
    assert opt.state[p]["step"].dtype == torch.float32 and float(opt.state[p]["step"]) == 3.0
    opt.step()
    assert align_optimizer_steps(engine) == 0
    # ZeRO-3 empties the groups between its per-sub-group steps: the state is still found.
    opt.state[p]["step"] = torch.tensor(5, dtype=torch.int64)
    opt.param_groups[0]["params"] = []
    assert align_optimizer_steps(engine) == 1 and opt.state[p]["step"].dtype == torch.float32
