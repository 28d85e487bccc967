"""Property: whatever run file and flags a user gives, `plan` and `submit --dry-run` either work or
refuse with one message that names the field; no exception escapes, nothing hangs (issue 14).

Run files are TOML tables built from the spec's own fields (so a new field is generated without
being listed here), with hostile strings (control characters, shell syntax, leading dashes, `%`,
backslashes), out-of-range and wrongly typed values, unknown keys, `[model.overrides]` and `[env]`
entries; flags are the CLI's own options, `--set` of any spec key, and `--sweep`.

The budget is fixed and derandomized so that CI is reproducible: 300 examples. For a longer local
hunt, raise it through the environment, e.g.

    HPCTRAIN_HYPOTHESIS_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/test_property.py
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpctrain.cli.main import cli
from hpctrain.spec import model as S
from hpctrain.spec import rules

EXAMPLES = int(os.environ.get("HPCTRAIN_HYPOTHESIS_EXAMPLES", "300"))
BUDGET = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                         HealthCheck.data_too_large])

# -- values -------------------------------------------------------------------------------------------

SECRET = "hf_" + "A" * 30
HOSTILE = ["", " ", "\n", "\r\n", "\r", "\x00", "\t", "\x1b[31m", "\x7f", "$(touch /tmp/pwned)", "`id`",
           "'; rm -rf ~;'", "-x", "--privileged", "%a", "%j", "a\\b", "${SLURM_ARRAY_TASK_ID}", "ü", "x" * 300,
           "9" * 400,
           "node[1-100000000]", SECRET, "auto", "llama-tiny", "/dev/zero", "..", "a,b", "a:b:c:d"]
text = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=12),
                 st.lists(st.sampled_from(HOSTILE), min_size=2, max_size=3).map("".join))
ints = st.one_of(st.integers(-3, 9), st.sampled_from([0, 7, 64, 1024, 2**24, 10**9, 10**12, 2**63, 10**400]),
                 st.integers(-(2**70), 2**70))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, -1.0, 1e308]))
scalars = st.one_of(text, ints, floats, st.booleans())
anything = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(text, scalars, max_size=2))


def for_hint(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a field's own type (mostly), or of any type (a type error the spec must name)."""
    origin = typing.get_origin(hint)
    own: st.SearchStrategy[Any]
    if hint is bool:
        own = st.booleans()
    elif hint is int:
        own = ints
    elif hint is float:
        own = floats
    elif hint is str:
        own = text
    elif origin is typing.Literal:
        own = st.sampled_from(typing.get_args(hint))
    elif origin in (typing.Union, types.UnionType):
        own = st.one_of(*(for_hint(h) for h in typing.get_args(hint)))
    elif origin is tuple:
        own = st.lists(text, max_size=3)
    elif origin is dict:
        keys = st.one_of(st.sampled_from(sorted(rules.MODEL_SHAPE_KEYS | rules.MODEL_BOOL_KEYS)), text)
        own = st.dictionaries(keys, st.one_of(ints, scalars, st.lists(ints, max_size=2)), max_size=3)
    else:
        own = anything
    return st.one_of(own, own, own, anything)


@st.composite
def sections(draw: st.DrawFn) -> dict[str, Any]:
    """A run file as a dict: sections and fields drawn from the spec's dataclasses."""
    data: dict[str, Any] = {}
    for name, cls in S.SECTIONS.items():
        if not draw(st.booleans()):
            continue
        hints = rules.field_types(cls)
        chosen = draw(st.lists(st.sampled_from([f.name for f in fields(cls)]), max_size=3, unique=True))
        data[name] = {f: draw(for_hint(hints[f])) for f in chosen}
        if draw(st.integers(0, 20)) == 0:
            data[name][draw(text) or "typo"] = 1
    model = data.setdefault("model", {})
    if draw(st.integers(0, 3)):  # mostly a model the planner can size, so that the plan gets far
        model.pop("path", None)
        model.setdefault("config", "llama-tiny")
    if draw(st.booleans()):
        data["env"] = draw(st.dictionaries(st.one_of(st.sampled_from(["HF_TOKEN", "NCCL_DEBUG", "A"]), text),
                                           st.one_of(text, anything), max_size=3))
    for key, hint in (("name", str), ("secret_env", tuple[str, ...]), ("site", str)):
        if draw(st.integers(0, 3)) == 0:
            data[key] = draw(for_hint(hint))
    return data


# -- TOML (written here so that hostile values reach the parser exactly) -----------------------------

def _toml_str(text: str) -> str:
    """A TOML basic string for any text: JSON's escapes are TOML's, plus DEL, which JSON leaves raw."""
    return json.dumps(text).replace("\x7f", "\\u007f")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_str(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def to_toml(data: dict[str, Any]) -> str:
    lines = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, body in data.items():
        if isinstance(body, dict):
            lines.append(f"[{section}]")
            lines += [f"{_toml_str(str(k))} = {toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


# -- flags --------------------------------------------------------------------------------------------

DOTTED = [*S.TOP_SCALARS, *(f"{s}.{f.name}" for s, c in S.SECTIONS.items() for f in fields(c)),
          "env.NCCL_DEBUG", "env.HF_TOKEN", "model.overrides.hidden_size", "model.overrides.num_attention_heads"]


# The options `plan` and `submit` share, read from the command itself (a new flag is covered by itself).
OPTIONS = sorted(p.opts[0] for p in cli.commands["plan"].params
                 if isinstance(p, click.Option) and not p.is_flag and p.opts[0] not in ("--set", "--container"))


@st.composite
def flags(draw: st.DrawFn) -> list[str]:
    args: list[str] = []
    for flag in draw(st.lists(st.sampled_from(OPTIONS), max_size=3, unique=True)):
        args += [flag, str(draw(st.one_of(text, ints.map(str), st.sampled_from(["auto", "1", "0", "3"]))))]
    for _ in range(draw(st.integers(0, 2))):
        args += ["--set", f"{draw(st.sampled_from(DOTTED))}={draw(st.one_of(text, ints.map(str)))}"]
    if draw(st.integers(0, 4)) == 0:
        args += ["--container", draw(st.sampled_from(["apptainer:", "podman:-x", "pyxis:img", "none:", "x:y"]))]
    return args


@st.composite
def sweeps(draw: st.DrawFn) -> list[str]:
    out: list[str] = []
    for _ in range(draw(st.integers(0, 1))):
        key = draw(st.sampled_from(["train.seed", "train.lr", "data.text_field", "parallel.zero", "resources.nodes"]))
        out += ["--sweep", f"{key}={draw(text)},{draw(ints.map(str))}"]
    return out


# -- the property ---------------------------------------------------------------------------------------

# What a refusal may name: a field of the spec, a flag, or the thing that could not be read.
NAMES = [*DOTTED, "env", "model.overrides", "model config", "run file", "override key", "sites", "site profile",
         "--", "parallel.tp*pp", "nodelist", "spec.toml", "sbatch.sh", "RUNFILE", "HPCTRAIN_RUNS_DIR"]


def check(result: Any) -> None:
    out = result.output
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), f"{exc!r} escaped; output:\n{out}"
    assert "Traceback" not in out, out
    if result.exit_code != 0:
        first = next((line for line in out.splitlines() if line.startswith("Error:")), "")
        assert first, f"a refusal without an Error: line:\n{out}"
        assert any(n in first for n in NAMES), f"the refusal names no field: {first}"
        assert SECRET not in out, "the value of a secret variable was echoed"


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Path:
    base = Path(tempfile.mkdtemp(prefix="hpctrain-prop-"))
    for var, sub in (("HPCTRAIN_RUNS_DIR", "runs"), ("HPCTRAIN_STATE_DIR", "state"), ("HPCTRAIN_CONFIG_DIR", "cfg")):
        monkeypatch.setenv(var, str(base / sub))
    for name in rules.ALWAYS_SECRET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN", SECRET)  # one of the hostile values: it must never be echoed
    return base


@BUDGET
@given(data=sections(), args=flags(), sweep=sweeps(), use_out=st.booleans())
def test_plan_and_dry_run_never_escape(isolated: Path, data: dict[str, Any], args: list[str], sweep: list[str],
                                       use_out: bool) -> None:
    old = os.umask(0o022)
    try:
        with tempfile.TemporaryDirectory(dir=isolated) as tmp:
            run_file = Path(tmp) / "run.toml"
            run_file.write_text(to_toml(data), encoding="utf-8")
            runner = CliRunner()
            check(runner.invoke(cli, ["plan", "--json", str(run_file), *args]))
            out = ["--out", str(Path(tmp) / "out")] if use_out else []
            check(runner.invoke(cli, ["submit", "--dry-run", *out, str(run_file), *args, *sweep]))
    finally:
        os.umask(old)
