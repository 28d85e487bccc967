"""The run folder is the contract: what `hpctrain submit` writes is what DeepSpeed gets on the node.

For every examples/*.toml the run folder comes from `hpctrain submit --dry-run --out DIR` (the writer
submit uses), with the model and data paths that live on a cluster replaced by small local ones. The node
then prepares that folder and builds its engine with `deepspeed.initialize` captured: the config it passes
is ds_config.json exactly, on the planned allocation, and ds_config.json plus the logged edits on another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpctrain.cli.main import cli
from hpctrain.node.dist import DistEnv
from hpctrain.runs.folder import RunFolder

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_FILES = sorted(p.name for p in EXAMPLES.glob("*.toml"))
RUN_FILES_NODE = RUN_FILES
# A Llama-3.2-1B-shaped config.json: the planner and the node read the shape only (no weights needed).
SMALL_MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
               "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
               "tie_word_embeddings": True, "rms_norm_eps": 1e-5}


def _local_inputs(tmp: Path) -> dict[str, Path]:
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_MODEL))
    (model / "model.safetensors").write_bytes(b"")  # submit refuses a folder without weights; none is read here
    docs = "".join(json.dumps({"text": f"document {i} " + "words " * (i % 40)}) + "\n" for i in range(400))
    (tmp / "sft.jsonl").write_text(docs)
    (tmp / "pretrain").mkdir()
    (tmp / "pretrain" / "part-0.jsonl").write_text(docs)
    return {"model": model, "sft": tmp / "sft.jsonl", "pretrain": tmp / "pretrain"}


def _submit_dry_run(name: str, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example's run folder as `hpctrain submit` writes it, cluster paths replaced by local ones."""
    local = _local_inputs(tmp)
    (tmp / "config" / "sites").mkdir(parents=True)
    for site in (EXAMPLES / "sites").glob("*.toml"):
        shutil.copy(site, tmp / "config" / "sites" / site.name)
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp / "config"))
    text = (EXAMPLES / name).read_text()
    args = ["submit", str(EXAMPLES / name), "--dry-run", "--out", str(tmp / "run")]
    if 'path = "/shared/models/' in text:
        args += ["--set", f"model.path={local['model']}"]
    if 'tokenizer = "/shared/' in text:
        args += ["--set", "data.tokenizer=byte"]
    if "/shared/data/sft.jsonl" in text:
        args += ["--set", f"data.source={local['sft']}"]
    if "/shared/data/chat.jsonl" in text:  # chat records need a chat_template (the SFT tests have one); the
        # DeepSpeed config does not depend on the data's format, so plain documents stand in here
        args += ["--set", f"data.source={local['sft']}", "--set", "data.format=jsonl"]
    if "/shared/data/pretrain-prepared" in text:  # a multi-node run reads prepared data (docs/data.md)
        from hpctrain.data.prepare import prepare

        prepare([str(local["pretrain"])], "byte", tmp / "prepared", workers=1, echo=lambda _: None)
        args += ["--set", f"data.source={tmp / 'prepared'}"]
    if name == "llama-8b-h200.toml":
        args += ["--site", "h200-single"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    return tmp / "run"


class _StubModel(torch.nn.Module):
    """Stands in for the (up to 8B-parameter) model: the test is about the config, not the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.eval()  # as from_pretrained returns a model

    def gradient_checkpointing_enable(self) -> None:
        pass


def _config_given_to_deepspeed(run: Path, world: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    """prepare() + build_engine() on rank 0 of `world` ranks; returns (Prepared, the `config` argument
    that deepspeed.initialize received)."""
    import deepspeed

    from hpctrain.node import train
    from hpctrain.node.model import build as node_model
    from hpctrain.node.model import lora, pipeline, zero_offload

    seen: dict[str, Any] = {}

    def initialize(**kw: Any) -> tuple[Any, ...]:
        seen["config"] = kw["config"]
        seen["training"] = kw["model"].training
        return object(), None, None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(node_model, "build_model", lambda *a, **k: _StubModel())
    monkeypatch.setattr(pipeline, "build_pipeline", lambda *a, **k: _StubModel())
    monkeypatch.setattr(lora, "wrap", lambda model, *a, **k: model)  # [lora]: PEFT needs a real causal LM
    # A GPU plan with optimizer offload would JIT-build DeepSpeedCPUAdam (40-70 s of CPU; again whenever the venv's
    # path changes, as in a clean clone) for an initialize that is stubbed: the op is never used here.
    monkeypatch.setattr(zero_offload, "prebuild_cpu_adam", lambda *a, **k: None)
    prep = train.prepare(run, DistEnv(0, 0, world, "127.0.0.1", 29500, "torch"))
    train.build_engine(prep)
    assert seen["training"], "the engine must get the model in training mode (dropout on, Liger's fused loss)"
    return prep, seen["config"]


@pytest.mark.parametrize("name", RUN_FILES_NODE)
def test_deepspeed_gets_ds_config_json_exactly(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the allocation the plan was made for, the node edits nothing and writes no effective config."""
    run = _submit_dry_run(name, tmp_path, monkeypatch)
    plan = json.loads(RunFolder(run).plan_json.read_text())
    gpu = plan["device"] == "gpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda" if gpu else "cpu")
    for knob in ("HPCTRAIN_CPU_ADAM", "HPCTRAIN_DS_ADAM"):
        monkeypatch.delenv(knob, raising=False)
    _, given = _config_given_to_deepspeed(run, plan["world_size"], monkeypatch)
    assert given == json.loads(RunFolder(run).ds_config_json.read_text())
    assert not RunFolder(run).ds_config_effective_json.exists()


@pytest.mark.parametrize("name", RUN_FILES_NODE)
def test_another_world_size_is_ds_config_json_plus_the_logged_edits(name: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Twice the planned ranks: DeepSpeed gets ds_config.effective.json, which differs from ds_config.json
    in train_batch_size alone (none under AutoTP, where DeepSpeed derives it), and each edit is logged."""
    run = _submit_dry_run(name, tmp_path, monkeypatch)
    folder = RunFolder(run)
    plan = json.loads(folder.plan_json.read_text())
    monkeypatch.setenv("DS_ACCELERATOR", "cuda" if plan["device"] == "gpu" else "cpu")
    for knob in ("HPCTRAIN_CPU_ADAM", "HPCTRAIN_DS_ADAM"):
        monkeypatch.delenv(knob, raising=False)
    caplog.set_level("INFO", logger="hpctrain")
    _, given = _config_given_to_deepspeed(run, 2 * plan["world_size"], monkeypatch)
    rendered = json.loads(folder.ds_config_json.read_text())
    assert given == json.loads(folder.ds_config_effective_json.read_text())
    changed = {k for k in {*rendered, *given} if rendered.get(k) != given.get(k)}
    assert changed == {"train_batch_size"}
    assert given["train_batch_size"] == 2 * rendered["train_batch_size"]
    assert f"ds_config: train_batch_size {rendered['train_batch_size']} -> {given['train_batch_size']}" in caplog.text


@pytest.mark.parametrize("name", RUN_FILES)
def test_deepspeeds_parser_accepts_each_examples_ds_config(name: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's own config class reads the file submit wrote, with the batch sizes the plan says."""
    cfgmod = pytest.importorskip("deepspeed.runtime.config")
    run = _submit_dry_run(name, tmp_path, monkeypatch)
    plan = json.loads(RunFolder(run).plan_json.read_text())

    class MPU:  # DeepSpeedConfig reads dp from an mpu; no process group is needed
        def get_data_parallel_world_size(self) -> int:
            return int(plan["dp"])

    monkeypatch.setattr(cfgmod.dist, "get_rank", lambda *a, **k: 0)
    cfg = cfgmod.DeepSpeedConfig(json.loads(RunFolder(run).ds_config_json.read_text()), mpu=MPU())
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        plan["global_batch"], plan["micro_batch"], plan["grad_accum"])
    assert (cfg.zero_optimization_stage, cfg.optimizer_name) == (plan["zero_stage"], "adamw")
    assert cfg.optimizer_params.get("torch_adam", False) is (plan["device"] == "cpu" or plan["offload"] == "none")
