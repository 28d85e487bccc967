"""Issue 27, round 2: the classes that do not touch the submit transaction.

Each section closes a class, not one reported case: the registry never takes damage for a new file and a
rebuild survives any one damaged folder; what a user can multiply is bounded before it is expanded; nothing
secret reaches the run folder; no input gives a traceback; messages echo values in bounded length.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpctrain.cli.main import cli
from hpctrain.runs.rebuild import rebuild_registry
from hpctrain.runs.registry import Attempt, Registry

EXAMPLES = int(os.environ.get("HPCTRAIN_HYPOTHESIS_EXAMPLES", "60"))
BUDGET = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state dir and a runs dir of this test's own; no SLURM on PATH (states come from the folders)."""
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'nobin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("COLUMNS", "100")
    return tmp_path


# -- 3. the registry: damage is never a new file; a rebuild survives any one damaged folder ---------------------

def _folder(runs: Path, run_id: str, lines: list[Any]) -> Path:
    d = runs / run_id
    d.mkdir(parents=True)
    (d / "spec.toml").write_text(f'name = "{run_id.split("-")[0]}"\n')
    (d / "plan.json").write_text(json.dumps({"nodes": 1, "world_size": 1}))
    (d / "attempts.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return d


def _four_runs(runs: Path) -> list[str]:
    ids = [f"r{i}-2026" for i in range(4)]
    for i, rid in enumerate(ids):
        _folder(runs, rid, [{"attempt": 0, "job_id": str(100 + i), "state": "COMPLETED", "submitted": 1000.0 + i,
                             "ended": 2000.0}])
    return ids


@pytest.mark.parametrize("content", [b"", b"SQLite format 3\x00" + b"\x00" * 84, b"SQLite"],
                         ids=["empty", "header-only", "cut-in-header"])
def test_a_young_empty_or_truncated_registry_is_damage_not_a_new_one(home: Path, content: bytes) -> None:
    """A registry file seconds old and empty (or cut short) was taken for one another process was creating:
    `list` showed nothing, without a word, and a submit then left 1 of 4 run folders listed for good."""
    ids = _four_runs(home / "runs")
    db = home / "state" / "registry.sqlite3"
    db.parent.mkdir(parents=True)
    db.write_bytes(content)  # mtime: now
    res = CliRunner().invoke(cli, ["list", "--all", "--json"])
    assert res.exit_code == 0, res.output
    assert sorted(r["run_id"] for r in json.loads(res.stdout)) == ids
    assert "unusable" in res.stderr and "rebuilt the run registry" in res.stderr
    # the submit-in-the-window case: a write to a fresh 0-byte file rebuilds first, so every folder stays listed
    db.unlink()
    db.write_bytes(b"")
    reg = Registry()
    reg.add_submitted({"run_id": "new-1", "name": "new", "folder": str(home / "runs" / "new-1"),
                       "executor": "slurm", "spec": {}}, Attempt(run_id="new-1", attempt=0, job_id="9"))
    assert any("rebuilt" in w for w in reg.warnings)
    assert sorted(r.run_id for r in Registry().list_runs(limit=None)) == sorted([*ids, "new-1"])


def test_the_registry_file_is_created_whole(home: Path) -> None:
    """Only `_create` makes the file, with its schema, before it has its name; a connection never creates one."""
    reg = Registry()
    reg.check()
    conn = sqlite3.connect(reg.path)
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")} >= {"runs", "attempts"}
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert (reg.path.stat().st_mode & 0o077) == 0
    assert [p.name for p in reg.path.parent.iterdir() if p.name.startswith(".")] == []  # no temp file left


HOSTILE_NUMBERS = [10**30, -1, 2**63, -(2**63) - 1, 1e308, float("inf"), float("nan"), True, "7", None, [1], {"a": 1}]
_json_scalar = st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.integers(), st.floats(allow_nan=True),
                         st.text(max_size=20), st.booleans(), st.none())
_attempt_line = st.dictionaries(
    st.sampled_from(["attempt", "job_id", "state", "nodes", "submitted", "started", "ended", "exit_code",
                     "failure_class", "note", "tag", "executor", "mode"]), _json_scalar, max_size=8)


@BUDGET
@given(lines=st.lists(st.one_of(_attempt_line, st.sampled_from(["{", "[1,2]", "1e999", '{"attempt": 1e400}'])),
                      min_size=1, max_size=4))
def test_rebuild_survives_any_damaged_run_folder(tmp_path_factory: pytest.TempPathFactory, lines: list[Any]) -> None:
    """Whatever one folder's attempts.jsonl holds (numbers past SQLite's INTEGER, NaN, 1e400, torn lines),
    the rebuild finishes, indexes the good folder, and keeps the registry readable (before: OverflowError)."""
    root = tmp_path_factory.mktemp("rb")
    runs = root / "runs"
    _folder(runs, "good-1", [{"attempt": 0, "job_id": "5", "state": "COMPLETED", "submitted": 10.0}])
    _folder(runs, "hostile-1", [x if isinstance(x, str) else json.dumps(x, allow_nan=True) for x in lines])
    reg = Registry(root / "r.db")
    notes = rebuild_registry(reg, runs_dirs=[runs])
    got = {r.run_id: r for r in reg.list_runs(limit=None)}
    assert "good-1" in got, notes
    for run in got.values():
        for a in run.attempts:
            assert 0 <= a.attempt <= 1_000_000
            for t in (a.submitted, a.started, a.ended):
                assert t is None or (math.isfinite(t) and 0 <= t <= 1e11)


def test_rebuild_names_the_folder_it_could_not_read(home: Path) -> None:
    runs = home / "runs"
    _four_runs(runs)
    bad = _folder(runs, "bad-1", [{"attempt": 0, "job_id": "1"}])
    (bad / "plan.json").unlink()
    (bad / "attempts.jsonl").unlink()
    (bad / "attempts.jsonl").mkdir()  # reading it raises IsADirectoryError
    res = CliRunner().invoke(cli, ["registry", "rebuild"])
    assert res.exit_code == 0, res.output
    assert "4 run(s) added" in res.stdout and f"skipped the damaged run folder {bad}" in res.stdout
    oversized = _folder(runs, "big-1", [{"attempt": 10**30, "job_id": "1"}, {"attempt": 0, "job_id": "2",
                                                                            "submitted": 1e400}])
    res = CliRunner().invoke(cli, ["registry", "rebuild"])
    assert res.exit_code == 0 and "1 run(s) added" in res.stdout, res.output
    run = Registry().get_run(oversized.name)
    assert [a.attempt for a in run.attempts] == [0] and run.latest and run.latest.job_id == "2"


# -- 4. what a user can multiply is bounded before it is expanded --------------------------------------------

def _refused(res: Any, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in res.stderr, res.stderr


@pytest.mark.parametrize("sweep", [["train.lr=" + ",".join(f"{i}e-5" for i in range(1, 1002))],
                                   ["train.seed=" + ",".join(map(str, range(1000))), "train.lr=1e-4,2e-4"],
                                   [f"train.seed={','.join(map(str, range(10)))}"] * 1 +
                                   [f"train.lr={','.join(f'{i}e-6' for i in range(1, 11))}",
                                    f"train.warmup_steps={','.join(map(str, range(1, 11)))}",
                                    f"train.grad_clip={','.join(str(i) for i in range(1, 11))}"]],
                         ids=["1001-values", "2000-product", "10^4-grid"])
def test_a_sweep_beyond_the_point_limit_is_refused_before_it_is_built(home: Path, sweep: list[str]) -> None:
    from hpctrain.spec.model import MAX_SWEEP_POINTS

    args = [a for s in sweep for a in ("--sweep", s)]
    res = CliRunner().invoke(cli, ["submit", "--dry-run", *args, "examples/tiny.toml"])
    _refused(res, "--sweep = ", f"more than the limit of {MAX_SWEEP_POINTS:,}", "Fix:")
    assert "grid points" in res.stderr and len(res.stderr) < 2000  # the grid is not echoed whole


def test_a_sweep_of_huge_values_is_refused_by_its_bytes(home: Path) -> None:
    from hpctrain.spec.model import MAX_SWEEP_BYTES

    big = "/data/" + "x" * 4000
    res = CliRunner().invoke(cli, ["submit", "--dry-run", "--sweep", "data.source=" + ",".join(
        f"{big}{i}" for i in range(500)), "examples/tiny.toml"])
    _refused(res, f"more than the limit of {MAX_SWEEP_BYTES:,}")


@BUDGET
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_the_sweep_bound_is_the_grid_product(sizes: list[int]) -> None:
    """Whatever the axes, parse_sweep either returns the whole grid (<= the limit) or refuses before building it."""
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import MAX_SWEEP_POINTS, parse_sweep

    keys = ["train.seed", "train.steps", "train.warmup_steps", "train.eval_every"]
    items = [f"{k}={','.join(str(v + 1) for v in range(n))}" for k, n in zip(keys, sizes, strict=False)]
    total = math.prod(sizes)
    if total > MAX_SWEEP_POINTS:
        with pytest.raises(HpcUsageError, match=f"{total:,} grid points"):
            parse_sweep(items)
    else:
        assert len(parse_sweep(items)) == total


def test_every_list_and_table_of_the_spec_is_bounded(home: Path) -> None:
    from hpctrain.spec.rules import MAX_ITEMS

    run = home / "run.toml"
    hosts = ", ".join(f'"n{i}"' for i in range(MAX_ITEMS + 1))
    run.write_text(f'name = "x"\n[resources]\nexclude = [{hosts}]\n')
    res = CliRunner().invoke(cli, ["plan", str(run)])
    _refused(res, "resources.exclude", f"more than the limit of {MAX_ITEMS:,} entries")
    env = "\n".join(f'V{i} = "1"' for i in range(MAX_ITEMS + 1))
    run.write_text(f'name = "x"\n[env]\n{env}\n')
    _refused(CliRunner().invoke(cli, ["plan", str(run)]), "env = ", "entries")


def test_after_is_bounded(home: Path) -> None:
    from hpctrain.cli.options import MAX_AFTER

    args = [a for i in range(MAX_AFTER + 1) for a in ("--after", f"run-{i}")]
    res = CliRunner().invoke(cli, ["submit", "--dry-run", *args, "examples/tiny.toml"])
    _refused(res, "--after = ", f"{MAX_AFTER + 1} runs to wait for, more than the limit of {MAX_AFTER}")


# -- 7. messages: bounded echoes, TOML in the fix, the wrong entry named ----------------------------------------

@pytest.mark.parametrize("args", [
    ["hostfile", "--slots", "1", "--nodelist",
     "n[1-2]," + ",".join(f"node{i:05d}" for i in range(1700)) + ",,"],  # 10 KB, bad
    ["hostfile", "--slots", "1", "--nodelist", "n" * 10_000 + "[x]"],
    ["plan", "--partition", "p;" + "q" * 10_000, "examples/tiny.toml"],
    ["submit", "--dry-run", "--sweep", "train.lr=" + "1" * 10_000 + "x", "examples/tiny.toml"],
    ["status", "r" * 5_000],
], ids=["nodelist", "hostname", "partition", "sweep-value", "run-ref"])
def test_no_message_echoes_a_value_whole(home: Path, args: list[str]) -> None:
    from hpctrain.errors import MAX_WORD

    res = CliRunner().invoke(cli, args)
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    assert "Fix:" in res.stderr and len(res.stderr) < 1500, res.stderr[:3000]
    assert max(len(w) for w in res.stderr.split()) <= MAX_WORD + 40
    assert "characters)" in res.stderr  # says how long the value was


@BUDGET
@given(value=st.text(min_size=0, max_size=3000))
def test_bound_message_keeps_short_words_and_cuts_long_ones(value: str) -> None:
    from hpctrain.errors import MAX_WORD, bound_message, shorten

    msg = bound_message(f"x = {value}: why. Fix: do it")
    assert msg.endswith(": why. Fix: do it")
    assert all(len(w) <= MAX_WORD + 40 for w in msg.split())
    if max((len(w) for w in value.split()), default=0) <= MAX_WORD:
        assert msg == f"x = {value}: why. Fix: do it"
    assert len(shorten(value)) <= 220


@pytest.mark.parametrize("body", ['[launch]\nmodules = 3', '[tracking]\nbackends = 4', '[resources]\nexclude = 5',
                                  '[launch]\nmodules = ["a", 3]'])
def test_fix_hints_are_toml(home: Path, body: str) -> None:
    run = home / "run.toml"
    run.write_text(f'name = "x"\n{body}\n')
    res = CliRunner().invoke(cli, ["plan", str(run)])
    _refused(res, "Fix:", '= ["A", "B"]', "[]")
    assert "()" not in res.stderr


def test_the_wrong_secret_env_entry_is_named(home: Path) -> None:
    run = home / "run.toml"
    run.write_text('name = "x"\nsecret_env = ["GOOD", "MY_SECRET", "NOT-A-NAME", "ALSO_GOOD"]\n')
    _refused(CliRunner().invoke(cli, ["plan", str(run)]), "secret_env[2] = 'NOT-A-NAME'", "Fix:")
    run.write_text('name = "x"\nsecret_env = ["GOOD", 3]\n')
    _refused(CliRunner().invoke(cli, ["plan", str(run)]), "secret_env[1] = ")
    token = "sk-" + "A1b2C3d4" * 5  # a credential pasted where a name belongs: still not echoed
    run.write_text(f'name = "x"\nsecret_env = ["{token}"]\n')
    res = CliRunner().invoke(cli, ["plan", str(run)])
    _refused(res, "secret_env[0] = '<redacted>'")
    assert token not in res.output


# -- 6. no traceback on any input; what is accepted works on SLURM or is refused at submit -----------------------

LONG_NAME = "a" * 300
DEEP_PATH = "/tmp/" + "d/" * 2100  # every name short, the whole over PATH_MAX
REF_COMMANDS = [["status"], ["cancel"], ["resubmit"], ["stacks"], ["export"], ["logs"], ["summary"],
                ["submit", "--dry-run", "examples/tiny.toml", "--after"]]


@pytest.mark.parametrize("value", [LONG_NAME, "/tmp/" + LONG_NAME + "/x", DEEP_PATH], ids=["name", "part", "path"])
@pytest.mark.parametrize("cmd", REF_COMMANDS, ids=lambda c: c[0] if c[0] != "submit" else "after")
def test_an_impossible_run_reference_is_refused_not_a_traceback(home: Path, cmd: list[str], value: str) -> None:
    res = CliRunner().invoke(cli, [*cmd, value])
    assert res.exit_code in (1, 2) and not isinstance(res.exception, OSError), res.exception
    assert "Traceback" not in res.output and "RUN = " in res.stderr and ("NAME_MAX" in res.stderr
                                                                       or "PATH_MAX" in res.stderr), res.stderr


@pytest.mark.parametrize("args", [
    ["plan", "--site", LONG_NAME, "examples/tiny.toml"],
    ["plan", "--site", f"/tmp/{LONG_NAME}.toml", "examples/tiny.toml"],
    ["plan", "--site", DEEP_PATH + "s.toml", "examples/tiny.toml"],
    ["submit", "--dry-run", "--set", f"launch.template_dir=/tmp/{LONG_NAME}", "examples/tiny.toml"],
    ["submit", "--dry-run", "--set", f"launch.template_dir={DEEP_PATH}", "examples/tiny.toml"],
    ["submit", "--dry-run", "--data", f"/tmp/{LONG_NAME}", "examples/tiny.toml"],
    ["submit", "--dry-run", "--out", f"/tmp/{LONG_NAME}", "examples/tiny.toml"],
    ["submit", "--dry-run", "--out", DEEP_PATH[:4000], "examples/tiny.toml"],
], ids=["site-name", "site-file", "site-deep", "template-name", "template-deep", "data", "out", "out-deep"])
def test_an_impossible_path_is_refused_not_a_traceback(home: Path, args: list[str]) -> None:
    res = CliRunner().invoke(cli, args)
    _refused(res, "Fix:")
    assert "NAME_MAX" in res.stderr or "PATH_MAX" in res.stderr


def test_the_cli_turns_any_name_too_long_into_a_refusal(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop for the next path input nobody checked: ENAMETOOLONG anywhere below a command is a refusal
    naming the path (here the config dir, which no check looks at before site profiles are searched in it)."""
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(home / LONG_NAME))
    res = CliRunner().invoke(cli, ["plan", "--site", "x", "examples/tiny.toml"])
    _refused(res, "path = ", "NAME_MAX", "Fix: give a shorter path")


@pytest.mark.parametrize("extra", ["[{}]", "[[\"--x=1\"]]", "[\"--reservation=r\", {a = 1}]", "[[]]"])
def test_a_non_text_sbatch_extra_is_refused_by_its_place(home: Path, extra: str) -> None:
    run = home / "run.toml"
    run.write_text(f'name = "x"\n[slurm]\nextra = {extra}\n')
    _refused(CliRunner().invoke(cli, ["plan", str(run)]), "slurm.extra[", "must be a string", "Fix:")


def test_a_backslash_in_an_sbatch_arg_is_refused(home: Path) -> None:
    res = CliRunner().invoke(cli, ["submit", "--dry-run", "--sbatch-arg", "--comment=a\\b", "examples/tiny.toml"])
    _refused(res, "slurm.extra = ", "backslash", "Fix:")


def test_a_missing_code_dir_is_refused_at_submit(home: Path) -> None:
    res = CliRunner().invoke(cli, ["submit", "--dry-run", "--set", f"code.dir={home / 'gone'}", "examples/tiny.toml"])
    _refused(res, "code.dir = ", "not an existing folder", "--snapshot")
    (home / "here").mkdir()
    res = CliRunner().invoke(cli, ["submit", "--dry-run", "--set", f"code.dir={home / 'here'}", "examples/tiny.toml"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("args,needle", [
    (["--time", "366-00:00:00"], "more than the limit of 365 days"),
    (["--time", "9999999-00:00:00"], "more than the limit of 365 days"),
    (["--time", "00:01:00"], "before it starts"),  # signal_seconds 90 > a 60 s job
    (["--time", "02:00:00", "--set", "resources.signal_seconds=21601"], "more than the limit of 21,600 seconds"),
    (["--time", "01:00:00", "--set", "resources.signal_seconds=3600"], "before it starts"),
])
def test_time_and_signal_are_bounded(home: Path, args: list[str], needle: str) -> None:
    _refused(CliRunner().invoke(cli, ["plan", *args, "examples/tiny.toml"]), needle, "Fix:")


def test_time_and_signal_within_bounds_pass(home: Path) -> None:
    for args in (["--time", "365-00:00:00"], ["--time", "0"], ["--time", "00:02:00"],
                 ["--time", "7-00:00:00", "--set", "resources.signal_seconds=21600"]):
        res = CliRunner().invoke(cli, ["plan", *args, "examples/tiny.toml"])
        assert res.exit_code == 0, (args, res.output)


NO_NODE_EXTRA = """
import sys
for m in ("torch", "deepspeed", "transformers", "safetensors", "peft", "accelerate"):
    sys.modules[m] = None  # what the base install (no node extra) has: none of them
from hpctrain.cli.main import main
sys.argv = ["hpctrain", "export", sys.argv[1]]
main()
"""


def test_export_on_the_base_install_says_it_needs_the_node_extra(home: Path) -> None:
    import subprocess
    import sys

    run = home / "runs" / "r-1"
    run.mkdir(parents=True)
    (run / "spec.toml").write_text('name = "r"\n')
    out = subprocess.run([sys.executable, "-c", NO_NODE_EXTRA, str(run)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "export needs the node extra (torch is not installed here)" in out.stderr
    assert "pip install 'hpctrain[node]'" in out.stderr


# -- 5. nothing secret in the run folder: git.diff and --snapshot ------------------------------------------------

def _gitc(cwd: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@x", *args], check=True,
                          capture_output=True, text=True, timeout=60).stdout


TOKEN = "hf_" + "Zq7" * 10  # the value of HF_TOKEN in these tests


@pytest.fixture
def repo(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git tree with credential files tracked (as happens), then edited: every one of them a way to leak."""
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    r = home / "code"
    (r / "conf").mkdir(parents=True)
    (r / "train.py").write_text("print('v1')\n")
    (r / ".gitignore").write_text("secrets.toml\n")
    for name in (".env", "conf/server.pem", "conf/id_rsa", "credentials.json", "secrets.toml", "conf/.env.prod"):
        (r / name).write_text("placeholder\n")
    _gitc(r, "init", "-q")
    _gitc(r, "add", "-A")
    _gitc(r, "add", "-f", "secrets.toml")  # tracked, though .gitignore names it
    _gitc(r, "commit", "-qm", "one")
    for name in (".env", "conf/server.pem", "conf/id_rsa", "credentials.json", "secrets.toml", "conf/.env.prod"):
        (r / name).write_text(f"API_TOKEN=sk-live-{name}-9f8e7d6c5b4a\n")
    (r / "train.py").write_text("print('v2')\n")
    return r


def test_git_diff_leaves_out_credential_and_ignored_files(repo: Path) -> None:
    from hpctrain.runs import repro

    info, diff = repro.git_state(repo)
    assert diff is not None and b"print('v2')" in diff
    assert b"sk-live" not in diff
    assert sorted(info["diff_left_out"]) == [".env", "conf/.env.prod", "conf/id_rsa", "conf/server.pem",
                                             "credentials.json", "secrets.toml"]


def test_git_diff_holding_a_secret_value_is_not_kept(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.runs import repro

    (repo / "train.py").write_text(f"TOKEN = '{TOKEN}'\n")  # pasted into the code itself
    monkeypatch.setenv("MY_SERVICE_KEY", "k" * 20)
    info, diff = repro.git_state(repo)
    assert diff is None and "HF_TOKEN" in info["note"] and TOKEN not in json.dumps(info)
    (repo / "train.py").write_text("KEY = '" + "k" * 20 + "'\n")  # a variable listed in secret_env
    info, diff = repro.git_state(repo, ["MY_SERVICE_KEY"])
    assert diff is None and "MY_SERVICE_KEY" in info["note"]


def _all_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def test_snapshot_copies_no_credential_file_and_every_file_is_private(repo: Path) -> None:
    from hpctrain.runs import snapshot

    (repo / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(repo / "run.sh", 0o755)
    (repo / "ok.py").write_text("x = 1\n")
    os.chmod(repo / "ok.py", 0o644)
    run = repo.parent / "runs" / "r-1"
    run.mkdir(parents=True)
    where = snapshot.snapshot_code(repo, run)
    copied = sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file())
    assert copied == [".gitignore", "ok.py", "run.sh", "train.py"], copied
    assert b"sk-live" not in _all_bytes(run)
    modes = {p.name: p.stat().st_mode & 0o777 for p in where.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o600}, modes


def test_snapshot_refuses_a_file_holding_a_secret_value_and_names_it(repo: Path) -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.runs import snapshot

    (repo / "conf" / "settings.py").write_text(f"HUB = '{TOKEN}'\n")
    run = repo.parent / "runs" / "r-2"
    run.mkdir(parents=True)
    with pytest.raises(HpcUsageError) as e:
        snapshot.snapshot_code(repo, run)
    msg = e.value.format_message()
    assert "conf/settings.py" in msg and "HF_TOKEN" in msg and TOKEN not in msg
    assert not (run / "code").exists()  # refused before anything was copied


@BUDGET
@given(name=st.sampled_from([".env", ".env.local", "x.pem", "deploy.KEY", "id_ed25519", ".netrc", "credentials",
                             "credentials.yaml", ".git-credentials", "store.p12"]),
       folder=st.sampled_from(["", "a/", "a/b/"]))
def test_every_denied_name_stays_out_of_a_snapshot_in_any_folder(tmp_path_factory: pytest.TempPathFactory,
                                                                 name: str, folder: str) -> None:
    from hpctrain.runs import snapshot

    src = tmp_path_factory.mktemp("src")  # outside git: the plain walk
    (src / folder).mkdir(parents=True, exist_ok=True)
    (src / folder / name).write_text("s3cr3t-value\n")
    (src / "main.py").write_text("x = 1\n")
    run = tmp_path_factory.mktemp("run")
    where = snapshot.snapshot_code(src, run)
    assert not (where / folder / name).exists()
    assert (where / "main.py").stat().st_mode & 0o777 == 0o600


@pytest.mark.slurm
def test_submit_snapshot_on_slurm_keeps_secrets_out_of_the_run_folder(slurm_cluster: Any, repo: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `hpctrain submit --snapshot` (a held job on the local cluster, cancelled after): the run folder
    has the code without credential files, every copied file 0600, a git.diff without them, and no secret value."""
    import subprocess
    import sys

    monkeypatch.chdir(repo)
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny.toml"
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "submit", str(tiny), "--nodes", "1", "--partition",
                           "debug", "--executor", "slurm", "--snapshot", "--sbatch-arg=--hold", "--json"],
                          capture_output=True, text=True, timeout=180, check=False)
    try:
        assert proc.returncode == 0, proc.stderr
        (sub,) = json.loads(proc.stdout)
        run = Path(sub["run_dir"])
        code = run / "code"
        assert (code / "train.py").read_text() == "print('v2')\n"
        assert not any(p.name in (".env", "server.pem", "id_rsa", "credentials.json", "secrets.toml")
                       for p in code.rglob("*"))
        assert {p.stat().st_mode & 0o777 for p in code.rglob("*") if p.is_file()} == {0o600}
        diff = (run / "repro" / "git.diff").read_bytes()
        assert b"print('v2')" in diff and b"sk-live" not in diff
        assert b"sk-live" not in _all_bytes(run) and TOKEN.encode() not in _all_bytes(run)
    finally:
        subprocess.run([sys.executable, "-m", "hpctrain", "cancel", "last"], capture_output=True, timeout=120,
                       check=False)


def test_summary_lines_under_the_table_fit_the_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At COLUMNS=100 the table was fitted but the lines under it were not (119 columns): now every line is."""
    import test_collect_cli as tc

    env = tc.env.__wrapped__(tmp_path, monkeypatch)  # type: ignore[attr-defined]
    deep = tmp_path / ("long-folder-name-" * 4)
    deep.mkdir()
    env["runs"] = deep
    tc.two_attempt_run(env)
    monkeypatch.setenv("COLUMNS", "100")
    res = tc.invoke("summary", "twice-1")
    assert res.exit_code == 0, res.output
    assert "python_exception rank 1 on node1" in res.output and "attempt-0.rank-1.log" in res.output.replace("\n", "")
    assert max(len(line) for line in res.output.splitlines()) <= 100, res.output
    monkeypatch.delenv("COLUMNS")  # a pipe: every line whole
    res = tc.invoke("summary", "twice-1")
    assert any(len(line) > 100 for line in res.output.splitlines())
