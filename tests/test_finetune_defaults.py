"""Fine-tuning defaults (hpctrain.spec.finetune): a run with a pretrained [model] path gets fine-tuning values
for every key no layer set, each printed with its reason by `plan` and `submit` and recorded in plan.json;
a key set anywhere wins, even when set to pretraining's value; without a model folder nothing changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpctrain.cli.main import cli
from hpctrain.plan.model import Plan
from hpctrain.plan.planner import make_plan
from hpctrain.spec import finetune
from hpctrain.spec.model import Data, Train, read_resolved, resolve, resolve_with_defaults
from hpctrain.spec.site import SITE_KEYS

FT_KEYS = {"train.lr", "train.min_lr", "train.warmup_steps", "data.tokenizer", "data.pack"}
CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 512}


pytestmark = pytest.mark.usefixtures("isolated_home")


def _model(tmp_path: Path, tokenizer: bool = True, name: str = "model") -> Path:
    """A pretrained-model folder as the planner and the spec see it: config.json, a weights file (submit refuses a
    folder without one; nothing here reads it) (+ tokenizer_config.json)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (folder / "tokenizer_config.json").write_text("{}")
    return folder


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(8)))
    return path


def _finetune(tmp_path: Path, **flags: Any) -> tuple[Any, list[finetune.Default]]:
    base = {"model.path": str(_model(tmp_path)), "data.source": str(_data(tmp_path))}
    return resolve_with_defaults(None, {**base, **flags})


def _applied(defaults: list[finetune.Default]) -> dict[str, Any]:
    return {d.key: d.value for d in defaults}


# ------------------------------------------------------------------------------------- each default, its reason

def test_full_finetune_gets_every_default_with_its_reason(tmp_path: Path) -> None:
    spec, applied = _finetune(tmp_path, **{"train.steps": 200})
    assert _applied(applied) == {"train.lr": 2e-5, "train.min_lr": 2e-6, "train.warmup_steps": 6,
                                 "data.tokenizer": str(tmp_path / "model"), "data.pack": True}
    t, d = spec.train, spec.data
    assert (t.lr, t.min_lr, t.warmup_steps, d.tokenizer, d.pack) == (2e-5, 2e-6, 6, str(tmp_path / "model"), True)
    assert t.weight_decay == 0.0 and d.dynamic_batching is False  # pretraining's values already fit fine-tuning
    lines = {d.key: d.line() for d in applied}
    assert lines["train.lr"] == ("train.lr = 2e-05 (fine-tuning default for a pretrained model; pretraining uses "
                                 "3e-4): set [train] lr to choose")
    assert "a tenth of train.lr" in lines["train.min_lr"] and "3% of the 200 train.steps" in lines["train.warmup_steps"]
    assert "the model folder's own tokenizer" in lines["data.tokenizer"]
    assert "packed into seq_len rows" in lines["data.pack"] and lines["data.pack"].endswith("set [data] pack to choose")


def test_lora_gets_its_own_lr(tmp_path: Path) -> None:
    spec, applied = _finetune(tmp_path, **{"lora.r": "16"})
    assert (spec.train.lr, spec.train.min_lr) == (2e-4, 2e-5)
    assert "LoRA adapters (lora.r = 16)" in next(d.reason for d in applied if d.key == "train.lr")


@pytest.mark.parametrize("steps, warmup", [(1, 0), (2, 1), (10, 1), (100, 3), (1000, 30)])
def test_warmup_is_three_percent_at_least_one(tmp_path: Path, steps: int, warmup: int) -> None:
    spec, _ = _finetune(tmp_path, **{"train.steps": steps})
    assert spec.train.warmup_steps == warmup


def test_min_lr_follows_the_users_lr(tmp_path: Path) -> None:
    """lr set, min_lr not: a tenth of the user's lr (pretraining's 3e-5 would lie above an lr of 1e-5)."""
    spec, applied = _finetune(tmp_path, **{"train.lr": "1e-5"})
    assert (spec.train.lr, spec.train.min_lr) == (1e-5, 1e-6)
    assert "train.lr" not in _applied(applied)


def test_pretraining_constant_named_for_the_reasons_is_pretrainings_default() -> None:
    assert Train().lr == finetune.PRETRAIN_LR


# ------------------------------------------------------------------------------------- a key set anywhere wins

# Each fine-tuning key set to pretraining's own default: an explicit value is kept even when it equals the
# value the layer would replace.
# (min_lr: 0, since pretraining's 3e-5 lies above the fine-tuning lr; test_min_lr_above_the_default_lr_is_refused.)
PRETRAIN_VALUES = {"train.lr": 3e-4, "train.min_lr": 0.0, "train.warmup_steps": 0, "data.tokenizer": "byte",
                   "data.pack": False}
TOML = {"train.lr": "3e-4", "train.min_lr": "0.0", "train.warmup_steps": "0", "data.tokenizer": '"byte"',
        "data.pack": "false"}


@pytest.mark.parametrize("key", sorted(PRETRAIN_VALUES))
@pytest.mark.parametrize("layer", ["run file", "--set"])
def test_an_explicit_key_wins_even_at_pretrainings_value(tmp_path: Path, key: str, layer: str) -> None:
    section, _, name = key.partition(".")
    model, data = _model(tmp_path), _data(tmp_path)
    run = tmp_path / "run.toml"
    text = f'[model]\npath = "{model}"\n[data]\nsource = "{data}"\n'
    if layer == "run file":  # [data] is open at the end of the text
        text += ("" if section == "data" else f"[{section}]\n") + f"{name} = {TOML[key]}\n"
    run.write_text(text)
    res = CliRunner().invoke(cli, ["submit", str(run), "--dry-run", "--out", str(tmp_path / "out"),
                                   *(["--set", f"{key}={TOML[key].strip(chr(34))}"] if layer == "--set" else [])])
    assert res.exit_code == 0, res.output
    spec = read_resolved(tmp_path / "out")
    assert getattr(getattr(spec, section), name) == PRETRAIN_VALUES[key]
    plan = Plan.from_json((tmp_path / "out" / "plan.json").read_text())
    assert key not in {d["key"] for d in plan.defaults}
    assert FT_KEYS - {key} - {"train.min_lr"} <= {d["key"] for d in plan.defaults}


def test_min_lr_above_the_default_lr_is_refused_naming_the_default(tmp_path: Path) -> None:
    """min_lr = 3e-5 alone: the fine-tuning lr 2e-5 lies below it. The refusal says where 2e-5 came from."""
    from hpctrain.errors import HpcUsageError

    with pytest.raises(HpcUsageError) as info:
        _finetune(tmp_path, **{"train.min_lr": "3e-5"})
    assert "train.min_lr = 3e-05: must lie in [0, lr=2e-05]" in info.value.message
    assert "fine-tuning defaults for a pretrained [model] path applied here: train.lr = 2e-05" in info.value.message
    (tmp_path / "again").mkdir()
    spec, _ = _finetune(tmp_path / "again", **{"train.min_lr": "3e-5", "train.lr": "3e-4"})
    assert (spec.train.lr, spec.train.min_lr) == (3e-4, 3e-5)  # both of pretraining's values, both kept


def test_flags_beat_the_run_file_and_both_beat_the_defaults(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(f'[model]\npath = "{_model(tmp_path)}"\n[train]\nlr = 5e-5\n')
    spec, applied = resolve_with_defaults(run, {"train.lr": "7e-5", "train.steps": 50})
    assert spec.train.lr == 7e-5 and spec.train.min_lr == 7e-6 and spec.train.warmup_steps == 2
    assert "train.lr" not in _applied(applied)


def test_no_site_key_is_a_fine_tuning_key() -> None:
    """Site profiles set allocation and launch keys only (spec.site.SITE_KEYS): none of them is one this layer
    sets, so a site never collides with it; the layer still sits below the site in resolve's order."""
    assert not FT_KEYS & set(SITE_KEYS.values())


def test_a_site_profile_does_not_disturb_the_defaults(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(f'site = "lab"\n[sites.lab]\npartition = "gpu"\nmem = "64G"\n[model]\npath = "{_model(tmp_path)}"\n')
    spec, applied = resolve_with_defaults(run, {})
    assert spec.resources.partition == "gpu" and spec.train.lr == 2e-5 and "train.lr" in _applied(applied)


def test_explicit_dynamic_batching_keeps_packing_off(tmp_path: Path) -> None:
    spec, applied = _finetune(tmp_path, **{"data.dynamic_batching": "true"})
    assert spec.data.dynamic_batching and not spec.data.pack and "data.pack" not in _applied(applied)


# ------------------------------------------------------------------------------------- no model folder: unchanged

@pytest.mark.parametrize("flags", [
    {"model.config": "llama-tiny"},
    {"model.config": "llama-tiny", "data.source": "DATA"},
    {"model.config": "llama-tiny", "train.steps": 500},
])
def test_without_a_model_folder_pretraining_defaults_stay(tmp_path: Path, flags: dict[str, Any]) -> None:
    flags = {k: (str(_data(tmp_path)) if v == "DATA" else v) for k, v in flags.items()}
    spec, applied = resolve_with_defaults(None, flags)
    assert applied == []
    assert (spec.train.lr, spec.train.min_lr, spec.train.warmup_steps) == (Train().lr, Train().min_lr, 0)
    assert (spec.data.tokenizer, spec.data.pack) == (Data().tokenizer, Data().pack)
    assert make_plan(spec, applied) == make_plan(spec)


def test_synthetic_data_is_not_packed(tmp_path: Path) -> None:
    spec, applied = resolve_with_defaults(None, {"model.path": str(_model(tmp_path))})
    assert spec.data.source == "synthetic" and not spec.data.pack and "data.pack" not in _applied(applied)
    assert spec.train.lr == 2e-5  # the optimizer's defaults apply all the same


@pytest.mark.parametrize("fmt", finetune.SFT_FORMATS)
def test_sft_formats_pack_without_a_model_folder(tmp_path: Path, fmt: str) -> None:
    spec, applied = resolve_with_defaults(None, {"model.config": "llama-tiny", "data.source": str(_data(tmp_path)),
                                                 "data.format": fmt}, check=False)
    assert spec.data.pack and [d.key for d in applied] == ["data.pack"]
    assert f"format {fmt!r} examples are short" in applied[0].reason
    assert spec.train.lr == Train().lr  # no model folder: the optimizer keeps pretraining's defaults


# ------------------------------------------------------------------------------------- no tokenizer files: a warning

def test_model_without_tokenizer_files_keeps_byte_and_the_plan_warns(tmp_path: Path) -> None:
    model = _model(tmp_path, tokenizer=False)
    spec, applied = resolve_with_defaults(None, {"model.path": str(model), "data.source": str(_data(tmp_path))})
    assert spec.data.tokenizer == "byte" and "data.tokenizer" not in _applied(applied)
    plan = make_plan(spec, applied)
    [warning] = [r for r in plan.reasons if r.startswith("WARNING: data.tokenizer")]
    assert str(model) in warning and "byte ids it was never trained on" in warning and "tokenizer.json" in warning


def test_byte_chosen_over_the_models_tokenizer_warns_too(tmp_path: Path) -> None:
    spec, applied = _finetune(tmp_path, **{"data.tokenizer": "byte"})
    warning = [r for r in make_plan(spec, applied).reasons if r.startswith("WARNING: data.tokenizer")]
    assert warning and f"set [data] tokenizer = '{tmp_path / 'model'}'" in warning[0]


def test_synthetic_data_needs_no_tokenizer_warning(tmp_path: Path) -> None:
    spec = resolve(None, {"model.path": str(_model(tmp_path, tokenizer=False))})
    assert not [r for r in make_plan(spec).reasons if r.startswith("WARNING: data.tokenizer")]


# ------------------------------------------------------------------------------------- plan.json, plan, submit

def test_plan_json_records_each_default(tmp_path: Path) -> None:
    spec, applied = _finetune(tmp_path)
    plan = Plan.from_json(make_plan(spec, applied).to_json())
    assert {d["key"]: d["value"] for d in plan.defaults} == _applied(applied)
    assert all(d.line() in plan.reasons for d in applied)


def test_plan_command_prints_each_default_and_json_records_it(tmp_path: Path) -> None:
    model, data = _model(tmp_path), _data(tmp_path)
    res = CliRunner().invoke(cli, ["plan", "--model", str(model), "--data", str(data)], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "- train.lr = 2e-05 (fine-tuning default for a pretrained model; pretraining uses 3e-4): set [train] lr " \
           "to choose" in res.output
    res = CliRunner().invoke(cli, ["plan", "--model", str(model), "--data", str(data), "--json"])
    assert {d["key"] for d in json.loads(res.output)["defaults"]} == FT_KEYS


def test_submit_dry_run_prints_defaults_apart_from_the_script(tmp_path: Path) -> None:
    model, data = _model(tmp_path), _data(tmp_path)
    res = CliRunner().invoke(cli, ["submit", "--model", str(model), "--data", str(data), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "hpctrain: train.lr = 2e-05 (fine-tuning default" in res.stderr
    assert "fine-tuning default" not in res.stdout and res.stdout.startswith("#!")
    res = CliRunner().invoke(cli, ["submit", "--model", str(model), "--data", str(data), "--dry-run", "--json"])
    assert res.exit_code == 0 and not res.stderr
    assert {d["key"] for d in json.loads(res.stdout)["plans"][0]["defaults"]} == FT_KEYS


def test_submit_prints_defaults_and_spec_toml_holds_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch

    seen: list[Path] = []

    def fake_submit(run_dirs: list[Path], *_a: Any, **_k: Any) -> list[Any]:
        seen.extend(run_dirs)
        return [dispatch.Submitted(run_id=d.name, run_dir=d, job_id="7", executor="local") for d in run_dirs]

    monkeypatch.setattr(dispatch, "submit", fake_submit)
    res = CliRunner().invoke(cli, ["submit", "--model", str(_model(tmp_path)), "--data", str(_data(tmp_path)),
                                   "--executor", "local"])
    assert res.exit_code == 0, res.output
    assert "hpctrain: data.pack = true" in res.stderr and "submitted" in res.stdout
    spec = read_resolved(seen[0])
    assert (spec.train.lr, spec.train.warmup_steps, spec.data.pack) == (2e-5, 3, True)
    assert {d["key"] for d in json.loads((seen[0] / "plan.json").read_text())["defaults"]} == FT_KEYS


def test_pretraining_submit_prints_nothing_more(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["submit", "--model", "llama-tiny", "--dry-run"])
    assert res.exit_code == 0 and not res.stderr
