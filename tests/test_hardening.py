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
