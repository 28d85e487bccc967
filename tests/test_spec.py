"""Spec: layering (defaults < site < run file < flags), validation messages, spec.toml round trip,
secrets, sweeps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpctrain.errors import HpcUsageError
from hpctrain.spec import model as S


@pytest.fixture(autouse=True)
def _config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cfg = tmp_path / "config"
    (cfg / "sites").mkdir(parents=True)
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(cfg))
    monkeypatch.chdir(tmp_path)
    return cfg


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


RUN = """
name = "r"
site = "filesite"
[resources]
nodes = 2
partition = "from-run"
[model]
config = "llama-tiny"
[train]
lr = 1e-3
[env]
A = "run"
"""


def test_layers_merge_in_order(tmp_path: Path, _config_dir: Path) -> None:
    write(_config_dir / "sites" / "filesite.toml",
          'partition = "site"\naccount = "acct"\nmodules = ["cuda/12"]\nsecret_env = ["S1"]\n'
          '[env]\nA = "site"\nB = "site"\n[container]\nruntime = "apptainer"\nimage = "/i.sif"\n')
    run = write(tmp_path / "run.toml", RUN)
    spec = S.resolve(run, {"resources.nodes": 3, "env.B": "flag", "train.seed": "7"})
    assert spec.resources.nodes == 3  # flag > run file
    assert spec.resources.partition == "from-run"  # run file > site
    assert spec.resources.account == "acct"  # site > default
    assert spec.launch.modules == ("cuda/12",)
    assert spec.env == {"A": "run", "B": "flag"}
    assert spec.train.lr == 1e-3 and spec.train.seed == 7
    assert spec.container.image == "/i.sif" and spec.site == "filesite"
    assert spec.secret_env == ("S1",)


def test_inline_site_wins_over_config_dir(tmp_path: Path, _config_dir: Path) -> None:
    write(_config_dir / "sites" / "filesite.toml", 'partition = "file"\n')
    run = write(tmp_path / "run.toml", RUN.replace('partition = "from-run"\n', "") +
                '[sites.filesite]\npartition = "inline"\n')
    assert S.resolve(run, {}).resources.partition == "inline"


def test_unknown_site_lists_known(tmp_path: Path, _config_dir: Path) -> None:
    write(_config_dir / "sites" / "mycluster.toml", 'partition = "gpu"\n')
    with pytest.raises(HpcUsageError) as exc:
        S.resolve(None, {"model.config": "llama-tiny"}, site="myclustr")
    msg = str(exc.value)
    assert "site = 'myclustr'" in msg and "did you mean 'mycluster'" in msg and "Fix:" in msg


def test_unknown_keys_list_valid_ones(tmp_path: Path) -> None:
    run = write(tmp_path / "run.toml", "[train]\nwarmup_step = 1\n")
    with pytest.raises(HpcUsageError) as exc:
        S.resolve(run, {})
    msg = str(exc.value)
    assert "'warmup_step'" in msg and "did you mean 'warmup_steps'" in msg and "weight_decay" in msg
    with pytest.raises(HpcUsageError, match="unknown key 'bogus'"):
        S.resolve(write(tmp_path / "r2.toml", "bogus = 1\n"), {})
    with pytest.raises(HpcUsageError, match="unknown key 'nodez'"):
        S.resolve(None, {"resources.nodez": 1})
    with pytest.raises(HpcUsageError, match="unknown key 'partitoin'"):
        from hpctrain.spec.site import site_to_overrides

        site_to_overrides("x", {"partitoin": "gpu"})


def test_invalid_toml_names_file(tmp_path: Path) -> None:
    with pytest.raises(HpcUsageError, match="invalid TOML"):
        S.resolve(write(tmp_path / "bad.toml", "[train\n"), {})


@pytest.mark.parametrize("flags, field, fix", [
    ({"parallel.zero": 5}, "parallel.zero = 5", "--zero"),
    ({"resources.nodes": 0}, "resources.nodes = 0", "--nodes 1"),
    ({"resources.time": "forever"}, "resources.time = 'forever'", "--time"),
    ({"resources.mem": "lots"}, "resources.mem = 'lots'", "--mem"),
    ({"resources.partition": "gpu; rm -rf /"}, "resources.partition", "plain name"),
    ({"parallel.offload": "param", "parallel.zero": 2}, "parallel.offload = 'param'", "--zero 3"),
    ({"parallel.offload": "all", "parallel.offload_device": "nvme"}, "parallel.nvme_path", "--nvme-path"),
    ({"parallel.pp": 2, "parallel.zero": 3}, "parallel.zero = 3", "--zero 1"),
    ({"train.steps": "ten"}, "train.steps = 'ten'", "--steps"),
    ({"container.runtime": "apptainer"}, "container.image", "--container apptainer:IMAGE"),
    ({"model.path": "/nonexistent/model"}, "model.path = '/nonexistent/model'", "--model"),
    ({"data.source": "/nonexistent.jsonl"}, "data.source", "--data"),
])
def test_bad_values_name_field_value_and_fix(flags: dict[str, object], field: str, fix: str) -> None:
    flags = {"model.config": "" if "model.path" in flags else "llama-tiny", **flags}
    with pytest.raises(HpcUsageError) as exc:
        S.resolve(None, flags)
    msg = str(exc.value)
    assert field in msg and "Fix:" in msg and fix in msg, msg


def test_missing_model_is_refused() -> None:
    with pytest.raises(HpcUsageError, match="model.path.*no model given.*Fix"):
        S.resolve(None, {})


def test_both_model_path_and_config_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(HpcUsageError, match="both model.path and model.config"):
        S.resolve(None, {"model.path": str(tmp_path / "m"), "model.config": "llama-tiny"})


def test_relative_paths_become_absolute(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    spec = S.resolve(None, {"model.config": "llama-tiny", "data.source": "data.jsonl"})
    assert spec.data.source == str(tmp_path / "data.jsonl")


@pytest.mark.parametrize("env", [
    {"HF_TOKEN": "x"}, {"WANDB_API_KEY": "abc"}, {"MY_PASSWORD": "p"}, {"X": "hf_" + "a" * 34},
    {"KEY": "0123456789abcdef0123456789abcdef01234567"}, {"GH": "ghp_" + "b" * 36},
])
def test_secrets_refused_in_env(env: dict[str, str]) -> None:
    with pytest.raises(HpcUsageError) as exc:
        S.Spec(env=env)
    msg = str(exc.value)
    assert "secret_env" in msg and "<redacted>" in msg
    value = next(iter(env.values()))
    assert value not in msg or value in ("x", "p", "abc")  # long secret values are never echoed


def test_site_marked_secret_refused_in_env() -> None:
    with pytest.raises(HpcUsageError, match="env.DB_PASS"):
        S.Spec(env={"DB_PASS": "hunter2"}, secret_env=("DB_PASS",))


def test_benign_env_allowed() -> None:
    spec = S.Spec(env={"TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "WARN", "V": "it's $(x) `y`"})
    assert spec.env["TOKENIZERS_PARALLELISM"] == "false"


def test_env_names_must_be_identifiers() -> None:
    with pytest.raises(HpcUsageError, match="not an environment variable name"):
        S.Spec(env={"A;rm": "x"})


def full_spec() -> S.Spec:
    return S.Spec(
        name="weird \"name\" 'q' \\ \n".strip(), site="s",
        resources=S.Resources(nodes=4, gpus_per_node=8, exclude=("n1", "n2"), gpu_mem_gb=40),
        launch=S.Launch(modules=("a/1", "b c")),
        model=S.Model(config="llama-8b", overrides={"rope_theta": 1e4, "x": [1, 2], "y": {"z": "w"}}),
        data=S.Data(source="/d/x.jsonl", seq_len=4096, pack=True),
        train=S.Train(lr=3e-05, min_lr=0.0, global_batch=256, micro_batch=2),
        parallel=S.Parallel(zero="auto", offload="optimizer"), checkpoint=S.Checkpoint(every_minutes=12.5),
        container=S.Container(runtime="apptainer", image="/i.sif", mounts=("/a:/b",)),
        env={"A": "x y\"z'", "BC": "ünïcode"}, secret_env=("S1", "S2"))


def test_toml_round_trip_exact() -> None:
    for spec in (S.Spec(), full_spec()):
        text = S.to_toml(spec)
        assert S.from_toml_text(text) == spec
        assert S.to_toml(S.from_toml_text(text)) == text


HOSTILE = ['say "hi"', "back\\slash\\", "new\nline\r\n", "tab\tend", "ünïcødé ✓ 日本", "ctl\x01\x7f",
           "'single'", '\"""triple\"""', "# not a comment", "[not.a.table]", "a = b", ""]


def hostile_spec() -> S.Spec:
    """Every field type a spec holds (str, int, float, bool, "auto" unions, tuples, nested tables)
    with strings TOML must escape."""
    overrides: dict[str, object] = {f"k{i}": text for i, text in enumerate(HOSTILE)}  # config.json text: may hold LF
    # What reaches a script may not hold a control character (spec.rules.check_strings): those go to overrides only.
    printable = [text for text in HOSTILE if not any(ord(c) < 32 or ord(c) == 127 for c in text)]
    overrides |= {"a.b": 1, 'q"k': -2, "ключ": 1.5e-300, "": True, "list": [1, 2.5, "x\n", False],
                  "nested": {"deep er": {"x": ["\\", "\""]}, "n": 0}, "empty": {}, "empty_list": []}
    return dataclasses.replace(
        full_spec(), name="\\ \"n\" ü", env={f"V{i}": text for i, text in enumerate(printable)},
        model=S.Model(config="llama-8b", overrides=overrides), secret_env=("S_1",),
        launch=S.Launch(modules=tuple(printable[:4]), template_dir="/t 'x'/\"y\""),
        parallel=S.Parallel(zero=3, offload="optimizer", offload_ratio=0.25),
        checkpoint=S.Checkpoint(every_minutes=12.5, export_hf=False, async_save=True))


def test_toml_round_trip_hostile_strings_and_every_type() -> None:
    spec = hostile_spec()
    text = S.to_toml(spec)
    back = S.from_toml_text(text)
    assert back == spec
    assert back.env == spec.env and back.model.overrides == spec.model.overrides
    assert S.to_toml(back) == text
    kinds = {type(getattr(getattr(spec, sec), f.name)) for sec in S.SECTIONS
             for f in dataclasses.fields(getattr(spec, sec))}
    assert {bool, int, float, str, tuple, dict} <= kinds


def test_read_resolved(tmp_path: Path) -> None:
    (tmp_path / "spec.toml").write_text(S.to_toml(full_spec()))
    assert S.read_resolved(tmp_path) == full_spec()


def test_from_toml_text_is_strict() -> None:
    with pytest.raises(HpcUsageError, match="unknown key 'extra'"):
        S.from_toml_text(S.to_toml(S.Spec()).replace("[train]", "[train]\nextra = 1"))


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        S.Spec().name = "x"  # type: ignore[misc]


def test_int_for_float_field_normalised() -> None:
    assert S.Train(lr=1).lr == 1.0 and isinstance(S.Train(lr=1).lr, float)


def test_parse_sweep_grid() -> None:
    grid = S.parse_sweep(["train.lr=1e-4,3e-4", "train.seed=1,2"])
    assert grid == [{"train.lr": "1e-4", "train.seed": "1"}, {"train.lr": "1e-4", "train.seed": "2"},
                    {"train.lr": "3e-4", "train.seed": "1"}, {"train.lr": "3e-4", "train.seed": "2"}]
    spec = S.resolve(None, {"model.config": "llama-tiny", **grid[3]})
    assert spec.train.lr == 3e-4 and spec.train.seed == 2


@pytest.mark.parametrize("item, match", [
    ("resources.nodes=1,2", "one allocation shape"),
    ("launch.launcher=srun,deepspeed", "one allocation shape"),
    ("container.image=a,b", "one allocation shape"),
    ("train.lr", "KEY=V1,V2"),
    ("train.lr=1e-4,", "empty value"),
    ("train.steps=1,x", "train.steps = 'x'"),
    ("train.nope=1", "unknown key 'nope'"),
])
def test_parse_sweep_refusals(item: str, match: str) -> None:
    with pytest.raises(HpcUsageError, match=match):
        S.parse_sweep([item])


def test_coerce_types() -> None:
    assert S.coerce("parallel.zero", "auto") == "auto" and S.coerce("parallel.zero", "2") == 2
    assert S.coerce("train.activation_checkpointing", "yes") is True
    assert S.coerce("launch.modules", "a, b") == ("a", "b")
    assert S.coerce("model.overrides.rope_theta", "1e4") == 1e4
    assert S.coerce("model.overrides.name", "plain words") == "plain words"


def test_config_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hpctrain.spec import site as config

    monkeypatch.delenv("HPCTRAIN_RUNS_DIR", raising=False)
    monkeypatch.delenv("HPCTRAIN_STATE_DIR", raising=False)
    monkeypatch.delenv("HPCTRAIN_CONFIG_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xs"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xc"))
    assert config.runs_dir() == Path("runs")
    assert config.state_dir() == tmp_path / "xs" / "hpctrain"
    assert config.config_dir() == tmp_path / "xc" / "hpctrain"
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "st"))
    assert config.state_dir() == tmp_path / "st"


def test_site_profile_tables_are_checked() -> None:
    from hpctrain.spec.site import site_to_overrides

    with pytest.raises(HpcUsageError, match="unknown key 'imgae'.*did you mean 'image'"):
        site_to_overrides("s", {"container": {"imgae": "x"}})
    with pytest.raises(HpcUsageError, match="must be a table"):
        site_to_overrides("s", {"env": "NCCL_DEBUG=INFO"})
    assert site_to_overrides("s", {"template_dir": "/t", "env": {"A": "1"}}) == {
        "launch.template_dir": "/t", "env.A": "1"}


# --------------------------------------------------------------------------------------------------
# Option injection: every value that becomes a command argument of its own

@pytest.mark.parametrize(("key", "value"), [
    ("launch.modules", ["-purge"]), ("launch.template_dir", "--x"), ("model.path", "-r"),
    ("model.config", "--help.json"), ("data.source", "-"), ("data.tokenizer", "--tok"),
    ("parallel.nvme_path", "-nvme"), ("container.image", "--privileged"),
    ("container.mounts", ["--privileged"]), ("container.mounts", ["/scratch:--privileged"]),
])
def test_leading_dash_refused_in_command_arguments(key: str, value: object) -> None:
    flags: dict[str, object] = {"model.config": "llama-tiny", key: value}
    if key.startswith("container.") and key != "container.image":
        flags |= {"container.runtime": "podman", "container.image": "localhost/x"}
    if key == "container.image":
        flags["container.runtime"] = "podman"
    if key == "model.path":
        flags["model.config"] = ""
    with pytest.raises(HpcUsageError) as exc:
        S.resolve(None, flags, check=False)
    msg = str(exc.value)
    assert msg.startswith(f"{key} = ") and "starts with '-'" in msg and "option" in msg and "Fix: " in msg, msg


def test_dash_inside_or_after_a_path_start_is_fine(tmp_path: Path) -> None:
    (tmp_path / "-data.jsonl").write_text('{"text": "hi"}\n')
    spec = S.resolve(None, {"model.config": "llama-tiny", "data.source": "./-data.jsonl",
                            "launch.modules": "gcc/12-x,cuda-12", "container.runtime": "podman",
                            "container.image": "localhost/my-image:1", "container.mounts": "/a-b:/c-d"})
    assert spec.data.source == str(tmp_path / "-data.jsonl") and spec.launch.modules == ("gcc/12-x", "cuda-12")


def test_a_table_field_given_a_scalar_is_a_usage_error(tmp_path: Path) -> None:
    """[model] overrides = '' (a string where a table belongs), then --set model.overrides.KEY=V: the field is
    named, not a TypeError traceback (found by the property test)."""
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import resolve

    run_file = tmp_path / "run.toml"
    run_file.write_text("[model]\nconfig = 'llama-tiny'\noverrides = ''\n")
    with pytest.raises(HpcUsageError, match="model.overrides"):
        resolve(run_file, {}, check=False)
    run_file.write_text("[model]\nconfig = 'llama-tiny'\n")
    with pytest.raises(HpcUsageError, match="model.overrides"):
        resolve(run_file, {"model.overrides": "3", "model.overrides.hidden_size": "64"}, check=False)
