"""Pretrained folders of every common family load exactly, under ZeRO-3 (2 CPU ranks) and ZeRO 0-2.

One torchrun launch loads every folder through hpctrain's own `build_model` under ZeRO-3 (familykit's
script); the digests it writes are compared here with the safetensors on disk, tensor by tensor, and the
buffers with transformers' from_pretrained (what ZeRO 0-2 use, checked against the files too). The same
launch also builds every case the node's way for ZeRO-1 and for ZeRO-2 and runs `deepspeed.initialize` with the
ds_config such a run renders: what each rank trains with afterwards (engine.module after DeepSpeed's bf16 cast
and rank-0 broadcast, and its partition of the fp32 master weights) is checked against the files too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from familykit import FAMILIES, OWN_ARANGE, family_config, file_digests, make_folder, model_digests
from runkit import free_port_pair, node_env

pytestmark = pytest.mark.deepspeed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (folder, training precision): every family in fp32; bf16 weights on disk loaded in bf16 and in fp32; one
# family trained in bf16 from fp32 weights (zero.Init in bf16: RoPE buffers must stay as from_pretrained's)
CASES = [*((n, "fp32") for n in FAMILIES), ("llama3-bf16", "bf16"), ("llama3-bf16", "fp32"), ("gemma2", "bf16"),
         ("mixtral", "bf16")]
SHARDED = ("mistral", "mixtral")  # saved in 40 KB shards: read through the index (an expert group spans shards)
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")  # a tied head, as saved
STAGES = (1, 2)  # through a DeepSpeed engine, every case at both (ZeRO-0 is build_model alone, below)
STAGE_CASES = [(n, p, z) for n, p in CASES for z in STAGES]
STAGE_IDS = [f"{n}-{p}-zero{z}" for n, p, z in STAGE_CASES]


def _save_without(src: Path, dst: Path, drop: set[str]) -> Path:
    """A copy of a single-file folder whose weights lack `drop`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in drop}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {n: make_folder(root, n, max_shard_size="40KB" if n in SHARDED else None) for n in FAMILIES}
    out["llama3-bf16"] = make_folder(root / "bf16", "llama3", dtype="bfloat16")
    out["phi3-incomplete"] = _save_without(out["phi3"], root / "phi3-incomplete",
                                           {"lm_head.weight", "model.layers.1.mlp.down_proj.weight"})
    return out


def _item(folders: dict[str, Path], name: str, precision: str) -> str:
    return f"{folders[name]}:{precision}"


def _engine_item(folders: dict[str, Path], name: str, precision: str, stage: int) -> str:
    return f"zero{stage}={_item(folders, name, precision)}"


@pytest.fixture(scope="module")
def zero3(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank launch: every case, the incomplete folder, and a fresh model from a pad_token_id config, under
    ZeRO-3; every case through a ZeRO-1 and a ZeRO-2 engine."""
    out = tmp_path_factory.mktemp("zero3") / "digests.json"
    items = [_item(folders, n, p) for n, p in CASES] + [_item(folders, "phi3-incomplete", "fp32"),
                                                         f"fresh={folders['gemma2']}:fp32",
                                                         OWN_ARANGE + _item(folders, "mixtral", "bf16")]
    items += [_engine_item(folders, n, p, z) for n, p, z in STAGE_CASES]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()),
           str(Path(__file__).with_name("familykit.py")), str(out), *items]
    # 3 reader threads a rank (the default here is 1: 2 cores, 2 ranks): the threaded partition reads are tested
    env = {**node_env(), "HPCTRAIN_LOAD_THREADS": "3"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"rc={proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"
    return dict(json.loads(out.read_text()))


def _zero0(folder: Path, precision: str) -> Any:
    """What ZeRO 0, 1 and 2 run: build_model's from_pretrained (no process group needed)."""
    from hpctrain.node.model.build import build_model, hf_config

    spec = SimpleNamespace(path=str(folder), config="", overrides={}, freeze=())
    return build_model(spec, hf_config(spec), precision, {}, zero3=False)


def _assert_matches_files(params: dict[str, str], folder: Path, precision: str) -> None:
    files = file_digests(folder, DTYPES[precision])
    wrong = sorted(n for n in params if n in files and params[n] != files[n])
    assert not wrong, f"{folder.name}: differ from the safetensors: {wrong}"
    absent = sorted(set(params) - set(files))
    if absent:  # only a tied head, which save_pretrained leaves out: it must be the embedding, exactly
        assert absent == ["lm_head.weight"] and family_config(folder.name.removesuffix("-bf16")).tie_word_embeddings
        assert params["lm_head.weight"] == next(files[k] for k in files if k.endswith(EMBEDDINGS))
    assert set(files) <= set(params), sorted(set(files) - set(params))


@pytest.mark.parametrize(("name", "precision"), CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_zero3_loads_every_parameter_exactly(zero3: dict[str, Any], folders: dict[str, Path], name: str,
                                             precision: str) -> None:
    got = zero3[_item(folders, name, precision)]
    assert got.get("error") is None, got
    assert got["partitioned"]  # built under zero.Init: no rank holds any parameter whole afterwards
    _assert_matches_files(got["params"], folders[name], precision)


@pytest.mark.parametrize(("name", "precision"), CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_zero0_loads_exactly_and_zero3_buffers_agree(zero3: dict[str, Any], folders: dict[str, Path], name: str,
                                                     precision: str) -> None:
    ref = model_digests(_zero0(folders[name], precision), zero3=False)
    _assert_matches_files(ref["params"], folders[name], precision)
    got = zero3[_item(folders, name, precision)]
    assert got["buffers"] == ref["buffers"]  # RoPE inv_freq (llama3, yarn), Gemma's embed_scale


def test_zero3_bf16_rope_without_transformers_arange_patch(zero3: dict[str, Any], folders: dict[str, Path]) -> None:
    """A transformers without prevent_arange_dtype_change (5.17, the H200 image's: an ImportError before step 1
    until hpctrain brought its own) builds the same bf16 model under ZeRO-3. Mixtral's default RoPE makes inv_freq
    from a float arange, which zero.Init would cast to bf16 (a different buffer) without the patch."""
    got = zero3[OWN_ARANGE + _item(folders, "mixtral", "bf16")]
    assert got.get("error") is None, got
    assert got["buffers"] == zero3[_item(folders, "mixtral", "bf16")]["buffers"]
    assert got["buffers"] == model_digests(_zero0(folders["mixtral"], "bf16"), zero3=False)["buffers"]
    _assert_matches_files(got["params"], folders["mixtral"], "bf16")


@pytest.mark.parametrize(("name", "precision", "stage"), STAGE_CASES, ids=STAGE_IDS)
def test_zero12_engines_train_from_the_files_exactly(zero3: dict[str, Any], folders: dict[str, Path], name: str,
                                                     precision: str, stage: int) -> None:
    """After deepspeed.initialize at ZeRO-1/2 (the node's build_model and rendered ds_config, 2 ranks): on each
    rank engine.module equals the safetensors (in the training dtype) and its buffers the ZeRO-3 load's; the
    optimizer is DeepSpeed's ZeRO-1/2 one and holds half the fp32 master elements a rank, each of them exactly
    the module's weight, and the two halves cover every element once."""
    ranks = zero3[_engine_item(folders, name, precision, stage)]["ranks"]
    assert len(ranks) == 2
    for got in ranks:
        assert (got["optimizer"], got["stage"]) in {("DeepSpeedZeroOptimizer", stage), ("BF16_Optimizer", 1)}, got
        _assert_matches_files(got["params"], folders[name], precision)
        assert got["buffers"] == zero3[_item(folders, name, precision)]["buffers"]
        assert 0 <= 2 * got["flat"] - got["elements"] < 16, got  # a half each, padded to a multiple of 2 x 2
        assert not got["differs"], got["differs"]
    assert sum(got["mapped"] for got in ranks) == ranks[0]["elements"]


def test_the_sharded_folder_is_read_through_its_index(folders: dict[str, Path]) -> None:
    from hpctrain.node.model.build import weight_files

    files = weight_files(str(folders["mistral"]))
    assert len(files) > 2 and (folders["mistral"] / "model.safetensors.index.json").is_file()


def test_a_folder_missing_weights_names_them(zero3: dict[str, Any], folders: dict[str, Path]) -> None:
    err = zero3[_item(folders, "phi3-incomplete", "fp32")]["error"]
    assert "lm_head.weight" in err and "model.layers.1.mlp.down_proj.weight" in err and "Fix:" in err, err


def test_a_fresh_zero3_model_from_a_pad_token_config_is_initialised(zero3: dict[str, Any]) -> None:
    """No path: built under zero.Init without transformers' init (which crashed on the padding row), then
    initialised once, gathered: the padding row is zero, the rest drawn with initializer_range."""
    got = next(v for k, v in zero3.items() if k.startswith("fresh="))
    assert got.get("error") is None, got
    stats = got["stats"]
    assert stats["pad_row_abs_max"] == 0.0
    assert 0.015 < stats["embed_std"] < 0.025  # gemma2's initializer_range, 0.02
    assert 0.015 < stats["q_proj_std"] < 0.025


def test_index_naming_an_absent_shard_is_a_clear_error(folders: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from hpctrain.node.model.build import weight_files
    from hpctrain.node.runconf import NodeInputError

    copy = shutil.copytree(folders["mistral"], tmp_path / "mistral")
    next(copy.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(NodeInputError, match=r"model-00002-of-.*Fix: copy the whole folder"):
        weight_files(str(copy))


def test_the_node_trains_from_a_pad_token_folder_under_zero3(folders: dict[str, Path], tmp_path: Path) -> None:
    """The issue's failure, end to end: a folder whose config.json sets pad_token_id (Gemma 2: soft-capping,
    sliding window, tied head) trains under ZeRO-3 on 2 ranks from its pretrained weights."""
    from runkit import losses_by_step, make_run, torchrun

    run = make_run(tmp_path / "run", model={"config": "", "path": str(folders["gemma2"])},
                   train={"steps": 2, "warmup_steps": 0}, parallel={"zero": 3})
    proc = torchrun(run, 2, timeout=400)
    assert proc.returncode == 0, f"rc={proc.returncode}\nSTDERR\n{proc.stderr[-5000:]}"
    assert sorted(losses_by_step(run)) == [1, 2]
