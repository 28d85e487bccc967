"""Hostile and out-of-range input (issue 14, classes 2, 7 and 8): every refusal names its field, no
traceback escapes, nothing runs unbounded, and no secret leaks into a file, a message or a mode.

Each case drives the real CLI in-process (click's CliRunner) or the function that owns the rule.
"""

from __future__ import annotations

import os
import stat
import time
import typing
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hpctrain import secret
from hpctrain import slurmcommands as _slurm
from hpctrain.cli.main import cli
from hpctrain.errors import HpcUsageError
from hpctrain.nodelist import MAX_HOSTS, expand
from hpctrain.spec import model as S
from hpctrain.spec import rules
from hpctrain.spec.site import MAX_TOML_BYTES

TOKEN = "hf_" + "Q" * 30  # the shape of a Hugging Face token: never printed, never written


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))
    for name in rules.ALWAYS_SECRET:
        monkeypatch.delenv(name, raising=False)
    old = os.umask(0o022)
    yield
    os.umask(old)


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=True)


def refused(result: Result, field: str) -> str:
    """Assert a clean refusal naming FIELD: exit code 2 (usage error), no traceback; return the message."""
    out = result.output
    assert result.exit_code != 0, out
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"an exception escaped: {result.exception!r}\n{out}")
    assert "Traceback" not in out, out
    assert field in out, f"{field!r} not named in: {out}"
    return out


def run_file(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8", newline="")
    return str(p)


TINY = '[model]\nconfig = "llama-tiny"\n'


# -- class 2: full matches, and no control character in any string ----------------------------------

@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--mem", "64G\n", "resources.mem"), ("--time", "01:00:00\n", "resources.time"),
    ("--partition", "gpu\n", "resources.partition"),
    ("runfile", '[resources]\nexclude = ["n1\\n"]\n', "resources.exclude"),
    ("--set", "env.WANDB_API_KEY\n=x", "env.WANDB_API_KEY"), ("runfile", 'secret_env = ["S\\n"]\n', "secret_env"),
    ("--site", "s\n", "site"),
])
def test_a_final_newline_does_not_slip_through(flag: str, value: str, field: str, tmp_path: Path) -> None:
    """`$` matches before a final newline: every pattern is a full match now."""
    site = '\n[sites."s\\n"]\npartition = "p"\n' if flag == "--site" else ""
    if flag == "runfile":
        refused(invoke("plan", run_file(tmp_path, value + TINY)), field)
    else:
        refused(invoke("plan", run_file(tmp_path, TINY + site), flag, value), field)


def test_secret_looking_env_key_with_newline_is_refused_not_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    text = TINY + f'[env]\n"WANDB_API_KEY\\n" = "{TOKEN}"\n'
    msg = refused(invoke("submit", "--dry-run", "--out", str(out), run_file(tmp_path, text)),
                  "env.'WANDB_API_KEY\\n'")
    assert TOKEN not in msg and not out.exists()


def _string_fields() -> Iterator[tuple[str, type, str, Any]]:
    """(dotted field, dataclass, field name, hint) of every string-carrying field, from the spec itself."""
    for cls, prefix in [*((c, f"{s}.") for s, c in S.SECTIONS.items()), (S.Spec, "")]:
        hints = rules.field_types(cls)
        for f in fields(cls):
            hint, origin = hints[f.name], typing.get_origin(hints[f.name])
            if hint is str or origin in (tuple, dict):
                yield prefix + f.name, cls, f.name, hint


STRING_FIELDS = list(_string_fields())
CONTROLS = ["\n", "\r", "\r\n", "\x00", "\t", "\x1b", "\x7f"]


def test_string_fields_are_found_from_the_spec() -> None:
    names = {f for f, *_ in STRING_FIELDS}
    assert {"name", "env", "secret_env", "resources.partition", "launch.modules", "container.mounts",
            "model.overrides", "data.source", "launch.template_dir"} <= names


@pytest.mark.parametrize("ch", CONTROLS, ids=repr)
@pytest.mark.parametrize(("field", "cls", "name", "hint"), STRING_FIELDS, ids=[f for f, *_ in STRING_FIELDS])
def test_control_characters_refused_in_every_string_field(field: str, cls: type, name: str, hint: Any,
                                                          ch: str) -> None:
    bad = f"a{ch}b"
    values: list[Any]
    if field in rules.ARGV_VALUES:  # a user script's arguments reach its argv as a list: any text but NUL
        if ch != "\x00":
            assert list(cls(script="/t.py", **{name: ("ok", bad)}).args) == ["ok", bad]
            return
        with pytest.raises(HpcUsageError, match="NUL byte"):
            cls(script="/t.py", **{name: ("ok", bad)})
        return
    if typing.get_origin(hint) is tuple:
        values = [("ok", bad)]
    elif typing.get_origin(hint) is dict:
        values = [{f"K{ch}": "v"}] if field in rules.TEXT_VALUES else [{"OK": bad}, {f"K{ch}": "v"}]
    else:
        values = [bad]
    for value in values:
        with pytest.raises(HpcUsageError, match=r"contains (a|the control)") as err:
            cls(**{name: value})
        assert str(err.value).startswith(field), err.value


def test_control_characters_refused_from_flags_sweeps_and_site_profiles(tmp_path: Path) -> None:
    rf = run_file(tmp_path, TINY + '[sites.s]\nmodules = ["gcc\\r"]\n')
    refused(invoke("plan", rf, "--site", "s"), "launch.modules")
    refused(invoke("plan", rf, "--set", "data.text_field=a\rb"), "data.text_field")
    refused(invoke("submit", "--dry-run", rf, "--sweep", "data.text_field=a,b\x1bc"), "data.text_field")
    refused(invoke("plan", rf, "--set", "env.A=x\ny"), "env.A")
    refused(invoke("plan", rf, "--set", "model.overrides.a\nb=1"), "model.overrides")


def test_model_override_values_may_hold_text(tmp_path: Path) -> None:
    """The documented exception (rules.TEXT_VALUES): config.json text never reaches a script."""
    rf = run_file(tmp_path, TINY + '[model.overrides]\nprompt = "line 1\\nline 2\\ttab"\n')
    out = tmp_path / "out"
    result = invoke("submit", "--dry-run", "--out", str(out), rf)
    assert result.exit_code == 0, result.output
    assert S.read_resolved(out).model.overrides["prompt"] == "line 1\nline 2\ttab"
    assert "line 1" not in (out / "sbatch.sh").read_text()


def test_crlf_run_file_parses_and_renders_lf(tmp_path: Path) -> None:
    """TOML allows CRLF line endings; none of it reaches the script (sbatch refuses DOS line breaks)."""
    text = ('name = "crlf"\n[model]\nconfig = "llama-tiny"\n[env]\nNOTE = """two\nlines"""\n').replace("\n", "\r\n")
    out = tmp_path / "out"
    result = invoke("submit", "--dry-run", "--out", str(out), run_file(tmp_path, text))
    msg = refused(result, "env.NOTE")  # the multi-line string's newline is refused, by name
    assert "newline" in msg
    plain = text.replace('NOTE = """two\r\nlines"""', 'NOTE = "one line"')
    result = invoke("submit", "--dry-run", "--out", str(out), run_file(tmp_path, plain))
    assert result.exit_code == 0, result.output
    assert "\r" not in (out / "sbatch.sh").read_text()


def test_template_line_endings_and_control_characters(tmp_path: Path) -> None:
    """A CRLF template renders with LF (Jinja normalises line endings); a control character that a
    template itself holds is refused naming launch.template_dir, not blamed on the resources."""
    from hpctrain.render.sbatch import template_dirs

    shipped = next(d / "sbatch.sh.j2" for d in template_dirs() if (d / "sbatch.sh.j2").is_file())
    tdir = tmp_path / "tpl"
    tdir.mkdir()
    (tdir / "sbatch.sh.j2").write_bytes(shipped.read_bytes().replace(b"\n", b"\r\n"))
    rf = run_file(tmp_path, TINY + f'[launch]\ntemplate_dir = "{tdir}"\n')
    result = invoke("submit", "--dry-run", rf)
    assert result.exit_code == 0 and "\r" not in result.output, result.output
    (tdir / "sbatch.sh.j2").write_bytes(shipped.read_bytes().replace(b"set -u\n", b"set -u\x07\n"))
    msg = refused(invoke("submit", "--dry-run", rf), "launch.template_dir")
    assert "control character" in msg and "resources" not in msg.split("Fix:")[1]


# -- class 7: no traceback on user input ------------------------------------------------------------

def test_unreadable_run_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'name = "caf\xe9"\n')
    assert "UTF-8" in refused(invoke("plan", str(bad)), "run file")
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    refused(invoke("plan", str(loop)), "run file")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_TOML_BYTES + 10))
    assert str(MAX_TOML_BYTES) in refused(invoke("plan", str(big)), "run file")
    refused(invoke("plan", str(tmp_path / ("x" * 300) / "run.toml")), "run file")
    refused(invoke("plan", str(tmp_path / ("x" * 300))), "run file")
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert "deeply" in refused(invoke("plan", str(deep)), "run file")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    assert "regular file" in refused(invoke("plan", str(fifo)), "run file")  # refused, not blocked in open()


def test_dev_zero_is_refused_without_reading_it_all() -> None:
    assert "regular file" in refused(invoke("plan", "/dev/zero"), "run file")


@pytest.mark.parametrize("flag", ["--model", "--data", "--set data.tokenizer="])
def test_unusable_input_paths_are_refused(flag: str, tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for path in (str(tmp_path / ("x" * 300)), str(loop / "x")):
        args = [flag.split()[0], flag.split()[1] + path] if " " in flag else [flag, path]
        result = invoke("submit", "--dry-run", run_file(tmp_path, TINY if flag != "--model" else ""), *args)
        refused(result, {"--model": "model.path", "--data": "data.source"}.get(flag, "data.tokenizer"))


def test_unwritable_out_and_runs_dir_are_refused(tmp_path: Path) -> None:
    rf = run_file(tmp_path, TINY)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile / "sub", tmp_path / ("o" * 300), Path("/sys/hpctrain-no")):
        refused(invoke("submit", "--dry-run", "--out", str(out), rf), "--out")
    for runs_dir in (afile, tmp_path / ("r" * 300), Path("/sys/hpctrain-no")):
        result = invoke("submit", "--executor", "local", "--preflight", rf, env={"HPCTRAIN_RUNS_DIR": str(runs_dir)})
        refused(result, "HPCTRAIN_RUNS_DIR")


@pytest.mark.parametrize(("args", "field"), [
    (["--mem", "9" * 400], "resources.mem"), (["--mem", "2000000000T"], "resources.mem"),
    (["--set", "resources.nodes=" + "9" * 400], "resources.nodes"),
    (["--set", "train.seed=" + "9" * 30], "train.seed"),
    (["--global-batch", str(10**12)], "train.global_batch"),
    (["--global-batch", str(10**9)], "train.global_batch"),
    (["--nodes", str(10**12), "--pp", "7"], "resources.nodes"),
    (["--nodes", "100000", "--set", "resources.tasks_per_node=1000", "--pp", "7", "--zero", "1"], "parallel.tp*pp"),
    (["--set", "resources.tasks_per_node=5000"], "resources.tasks_per_node"),
    (["--set", "data.seq_len=" + "9" * 20], "data.seq_len"),
    (["--set", "train.lr=1e999"], "train.lr"),
])
def test_out_of_range_numbers_are_refused_quickly(args: list[str], field: str, tmp_path: Path) -> None:
    """Bounded: a refusal names the field and its limit (no 44 s divisor walk, no overflow)."""
    refused(invoke("plan", run_file(tmp_path, TINY), *args), field)


def test_largest_allowed_global_batch_plans(tmp_path: Path) -> None:
    result = invoke("plan", run_file(tmp_path, TINY), "--global-batch", str(rules.MAX_BATCH), "--json")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("override", "field"), [
    ('hidden_size = "sixty-four"', "hidden_size"), ("hidden_size = [64]", "hidden_size"),
    ("hidden_size = nan", "hidden_size"),
    ("hidden_size = inf", "hidden_size"), ("hidden_size = 0", "hidden_size"), ("hidden_size = -64", "hidden_size"),
    ("hidden_size = 64.0", "hidden_size"), ("num_attention_heads = 0", "num_attention_heads"),
    ("num_attention_heads = 7", "num_attention_heads"), ("num_key_value_heads = 3", "num_key_value_heads"),
    ("vocab_size = 99999999999", "vocab_size"), ("num_hidden_layers = 1000000", "num_hidden_layers"),
    ("tie_word_embeddings = 1", "tie_word_embeddings"), ("rope_theta = nan", "rope_theta"),
    ("rope_scaling = {factor = inf}", "rope_scaling.factor"), ("model_type = 3", "model_type"),
])
def test_model_overrides_are_typed_per_key(override: str, field: str, tmp_path: Path) -> None:
    rf = run_file(tmp_path, TINY + f"[model.overrides]\n{override}\n")
    refused(invoke("plan", rf), f"model.overrides.{field}")


def test_unreadable_model_config_is_refused(tmp_path: Path) -> None:
    for config in ("/dev/zero", str(tmp_path), str(tmp_path / "missing.json")):
        refused(invoke("plan", "--model", config if config.endswith(".json") else config + "/x.json"), "model.config")
    refused(invoke("plan", run_file(tmp_path, '[model]\nconfig = "/dev/zero"\n')), "model.config")
    (tmp_path / "list.json").write_text("[1, 2]")
    refused(invoke("plan", "--model", str(tmp_path / "list.json")), "model.config")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes(b"\xff\xfe")
    refused(invoke("plan", "--model", str(tmp_path / "m")), "model.path")


def test_bad_config_json_is_refused_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": "big", "num_attention_heads": 2, "num_hidden_layers": 1,'
                                          ' "vocab_size": 10}')
    rf = run_file(tmp_path, f'[model]\nconfig = "{tmp_path / "config.json"}"\n')
    refused(invoke("plan", rf), "model config.json hidden_size")


def test_hostlist_expansion_is_bounded() -> None:
    for text in ("n[1-100000000]", "r[1-1000]n[1-1000]", ",".join(f"a[1-{MAX_HOSTS}]" for _ in range(2))):
        with pytest.raises(HpcUsageError, match=f"limit of {MAX_HOSTS}"):
            expand(text)
    assert len(expand(f"n[1-{MAX_HOSTS}]")) == MAX_HOSTS
    refused(invoke("hostfile", "--nodelist", "n[1-100000000]", "--slots", "1"), "nodelist")
    refused(invoke("hostfile", "--nodelist", "n[" + "9" * 400 + "]", "--slots", "1"), "nodelist")
    refused(invoke("hostfile", "--nodelist", "n[1-2]", "--slots", "9" * 30), "--slots")


def test_site_name_never_becomes_a_path(tmp_path: Path) -> None:
    (tmp_path / "evil.toml").write_text('partition = "x"\n')
    refused(invoke("plan", run_file(tmp_path, TINY), "--site", "../../evil"), "site")


@pytest.mark.parametrize("jid", ["12_[1-]", "12_[-3]", "12_[5-2]", "12_[0-999999999]", "12_[1--2]", "12_[,]"])
def test_malformed_sacct_array_range_stays_raw(jid: str) -> None:
    assert _slurm._expand_array_id(jid) == [jid]


def test_sacct_array_range_still_expands() -> None:
    assert _slurm._expand_array_id("12_[0-2,5%4]") == ["12_0", "12_1", "12_2", "12_5"]


# -- class 8: secrets ---------------------------------------------------------------------------------

def test_dry_run_applies_the_submit_secret_check(tmp_path: Path) -> None:
    """A secret's value in a rendered file: the same refusal for dry run (with or without --out) and submit,
    naming the variable, never echoing the value, writing nothing."""
    secret = "correct-horse-battery-staple"
    rf = run_file(tmp_path, 'secret_env = ["CLUSTER_KEY"]\n' + TINY)
    env = {"CLUSTER_KEY": secret}
    out = tmp_path / "out"
    for args in (["--dry-run", "--out", str(out)], ["--dry-run"], ["--executor", "local", "--preflight"]):
        msg = refused(invoke("submit", *args, rf, "--job-name", secret, env=env), "CLUSTER_KEY")
        assert secret not in msg
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_short_secret_values_do_not_block_submits(tmp_path: Path) -> None:
    """A value shorter than MIN_SECRET_LEN is no credible secret: 'bash' is in every script."""
    assert len("bash") < secret.MIN_SECRET_LEN
    result = invoke("submit", "--dry-run", run_file(tmp_path, TINY), env={"HF_TOKEN": "bash"})
    assert result.exit_code == 0, result.output


def test_error_messages_never_echo_secret_values(tmp_path: Path) -> None:
    rf = run_file(tmp_path, TINY + f'[env]\nHF_TOKEN = ["{TOKEN}"]\n')
    assert TOKEN not in refused(invoke("plan", rf), "env.HF_TOKEN")
    rf = run_file(tmp_path, TINY + f'[env]\nMY_PASSWORD = "{TOKEN}\\n"\n')
    assert TOKEN not in refused(invoke("plan", rf), "env.MY_PASSWORD")
    rf = run_file(tmp_path, 'secret_env = ["SITE_CRED"]\n' + TINY + '[env]\nSITE_CRED = ["hunter2hunter2"]\n')
    assert "hunter2hunter2" not in refused(invoke("plan", rf), "env.SITE_CRED")
    # A message quoting a value the user typed: the environment's secret values are redacted.
    msg = refused(invoke("plan", run_file(tmp_path, TINY), "--time", TOKEN, env={"HF_TOKEN": TOKEN}), "resources.time")
    assert TOKEN not in msg and "<redacted" in msg
    msg = refused(invoke("plan", run_file(tmp_path, TINY), "--nodes", TOKEN, env={"HF_TOKEN": TOKEN}), "--nodes")
    assert TOKEN not in msg and "<redacted" in msg  # click's own refusal, redacted too


def _loose(root: Path) -> list[str]:
    return [f"{p} {stat.filemode(p.stat().st_mode)}" for p in [root, *root.rglob("*")]
            if not p.is_symlink() and p.stat().st_mode & 0o077]


def test_dry_run_files_are_private(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke("submit", "--dry-run", "--out", str(out), run_file(tmp_path, TINY), "--sweep", "train.seed=1,2")
    assert result.exit_code == 0, result.output
    assert len(list(out.rglob("sbatch.sh"))) == 2
    assert _loose(out) == []


def test_local_submit_run_folder_is_private(tmp_path: Path) -> None:
    """Everything a local submit writes (run folder, submitit logs and results, rank logs) is 0600/0700,
    though the test process runs with umask 022: the CLI, the script and the node each set 077."""
    pytest.importorskip("torch")
    rf = run_file(tmp_path, TINY + "[resources]\ntasks_per_node = 2\n[launch]\npreflight_timeout_s = 30\n")
    result = invoke("submit", "--executor", "local", "--preflight", rf)
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    deadline = time.monotonic() + 120
    while len(list((run_dir / "submitit").glob("*_result.pkl"))) < 2:
        assert time.monotonic() < deadline, sorted(str(p) for p in run_dir.rglob("*"))
        time.sleep(0.5)
    assert list((run_dir / "logs").iterdir()), "no rank log written"
    assert _loose(run_dir) == []
    assert _loose(tmp_path / "state") == []


@pytest.mark.deepspeed
def test_node_run_files_are_private(tmp_path: Path) -> None:
    """A real training run (2 ranks, a checkpoint) started with umask 022 leaves only private files."""
    pytest.importorskip("deepspeed")
    from runkit import make_run, torchrun

    run = make_run(tmp_path / "run", train={"steps": 4}, checkpoint={"every_steps": 2, "keep": 1})
    old = os.umask(0o022)
    try:
        proc = torchrun(run, 2)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((run / "checkpoints").iterdir()) and list((run / "metrics").iterdir())
    made = [p for p in (run / "logs", run / "metrics", run / "checkpoints", run / "events.jsonl") if p.exists()]
    assert [x for p in made for x in _loose(p)] == []
