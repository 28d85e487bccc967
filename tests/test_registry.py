"""Registry: records survive many writers at once; prefix lookup; secrets never stored."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpctrain.runs.registry import Attempt, Registry, RunNotFound, state_dir


def _add(reg: Registry, run_id: str, job: str = "1") -> None:
    reg.add_submitted({"run_id": run_id, "name": run_id.split("-")[0], "folder": f"/runs/{run_id}",
                       "executor": "slurm", "spec": {"nodes": 2}},
                      Attempt(run_id=run_id, attempt=0, job_id=job))


def test_add_get_update_list(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    _add(reg, "tiny-20261129-120000-abcd", "17")
    _add(reg, "big-20261129-120001-0001", "18")
    run = reg.get_run("tiny")  # unique prefix
    assert run.run_id == "tiny-20261129-120000-abcd"
    assert run.latest and run.latest.job_id == "17" and run.state == "PENDING"
    reg.update_attempt(run.run_id, 0, state="FAILED", exit_code="1:0")
    reg.add_attempt(Attempt(run_id=run.run_id, attempt=1, job_id="19", state="RUNNING"))
    run = reg.get_run(run.run_id)
    assert [a.state for a in run.attempts] == ["FAILED", "RUNNING"] and run.state == "RUNNING"
    assert reg.list_runs()[0].run_id == "big-20261129-120001-0001"  # newest first
    assert reg.integrity_check() == "ok"


def test_unknown_and_ambiguous(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    _add(reg, "tiny-a")
    _add(reg, "tiny-b")
    with pytest.raises(RunNotFound) as e:
        reg.get_run("tiny-")
    assert e.value.ambiguous and set(e.value.close) == {"tiny-a", "tiny-b"}
    with pytest.raises(RunNotFound) as e:
        reg.get_run("tiyn-a")
    assert not e.value.ambiguous and "tiny-a" in e.value.close


def test_unknown_update_field_rejected(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    _add(reg, "x-1")
    with pytest.raises(ValueError, match="valid"):
        reg.update_attempt("x-1", 0, stat="RUNNING")


def test_secret_keys_never_stored(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    reg.add_submitted({"run_id": "s-1", "name": "s", "folder": "/f", "executor": "local",
                       "spec": {"env": {"HF_TOKEN": "hf_canary", "WANDB_API_KEY": "k", "OK": "1"}}},
                      Attempt(run_id="s-1", attempt=0, job_id="1"))
    raw = (tmp_path / "r.db").read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("r.db-*"))
    assert b"hf_canary" not in raw and b"WANDB_API_KEY" not in raw
    assert reg.get_run("s-1").spec == {"env": {"OK": "1"}}


def test_wal_and_private(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "state" / "r.db")
    _add(reg, "a-1")
    mode = sqlite3.connect(reg.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    assert (reg.path.stat().st_mode & 0o077) == 0


def test_state_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "s"))
    assert state_dir() == tmp_path / "s"
    monkeypatch.delenv("HPCTRAIN_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "x"))
    assert state_dir() == tmp_path / "x" / "hpctrain"


WRITER = textwrap.dedent("""
    import sys
    from hpctrain.runs.registry import Attempt, Registry
    db, k = sys.argv[1], int(sys.argv[2])
    reg = Registry(db)
    for i in range(5):
        rid = f"w{k}-{i}"
        reg.add_submitted({"run_id": rid, "name": "w", "folder": "/f", "executor": "slurm",
                           "spec": {"k": k}}, Attempt(run_id=rid, attempt=0, job_id=str(k * 100 + i)))
        reg.update_attempt(rid, 0, state="RUNNING")
        reg.add_attempt(Attempt(run_id=rid, attempt=1, job_id=str(k * 100 + i + 50), state="PENDING"))
        reg.list_runs(limit=5)
""")


def test_twenty_concurrent_processes(tmp_path: Path) -> None:
    """20 processes x 5 runs x (insert, update, second attempt, read): nothing lost, nothing corrupt."""
    db = tmp_path / "r.db"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(k)], stderr=subprocess.PIPE,
                              text=True) for k in range(20)]
    errs = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
    assert all(rc == 0 for rc, _ in errs), [e for rc, e in errs if rc][:2]
    reg = Registry(db)
    runs = reg.list_runs(limit=None)
    assert len(runs) == 100
    assert all(len(r.attempts) == 2 and r.attempts[0].state == "RUNNING" and r.state == "PENDING"
               for r in runs)
    assert reg.integrity_check() == "ok"
    assert json.dumps(runs[0].to_dict())


def test_registry_and_spec_share_one_secret_name_rule(tmp_path: Path) -> None:
    """The registry drops exactly the keys the spec's [env] check calls secret (hpctrain.secret.is_secret_name):
    DB_PASSWD and GH_APIKEY go, tokens_per_batch (a knob, not a token) stays."""
    from hpctrain.secret import is_secret_name

    keys = {"DB_PASSWD": "x", "GH_APIKEY": "x", "MY_CREDENTIALS": "x", "tokens_per_batch": 4096, "nodes": 2}
    reg = Registry(tmp_path / "r.db")
    reg.add_submitted({"run_id": "s-2", "name": "s", "folder": "/f", "executor": "local", "spec": keys},
                      Attempt(run_id="s-2", attempt=0, job_id="2"))
    kept = reg.get_run("s-2").spec
    assert kept == {"tokens_per_batch": 4096, "nodes": 2}
    assert {k for k in keys if is_secret_name(k)} == set(keys) - set(kept)


# -- readers never wait for the write lock -----------------------------------------------------------
HOLDER = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")  # the write lock, held like a long sweep insert would
    conn.execute("UPDATE runs SET name = name")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    conn.execute("ROLLBACK")
""")
LIST = "from hpctrain.cli.main import main; main()"


def _finished(reg: Registry, run_id: str) -> None:
    _add(reg, run_id)
    reg.update_attempt(run_id, 0, state="COMPLETED", ended=1.0)  # settled long ago: list asks SLURM nothing


def test_list_reads_past_a_writer_holding_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hpctrain list` (a fresh process) while another process holds the write lock for minutes: it
    answers with every run (before: it queued behind the writer for up to ~24 minutes)."""
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path))
    reg = Registry()
    for i in range(3):
        _finished(reg, f"r-{i}")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(reg.path), "600"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        out = subprocess.run([sys.executable, "-c", LIST, "list", "--json"], capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert sorted(r["run_id"] for r in json.loads(out.stdout)) == ["r-0", "r-1", "r-2"]
        with pytest.raises(Exception, match="registry"):  # a writer waits, boundedly, and says why
            import hpctrain.runs.registry as registry_mod

            monkeypatch.setattr(registry_mod, "_WRITE_BUDGET_S", 0.5)
            monkeypatch.setattr(registry_mod, "_BUSY_TIMEOUT_MS", 200)
            Registry().update_attempt("r-0", 0, state="FAILED")
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_read_creates_and_migrates_nothing(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    assert reg.list_runs() == [] and not reg.path.exists()
    with pytest.raises(RunNotFound):
        reg.get_run("x")
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    conn.executescript(V0_SCHEMA)
    conn.close()
    Registry(old).list_runs()
    assert sqlite3.connect(old).execute("PRAGMA user_version").fetchone()[0] == 0  # a read writes nothing


# -- schema versions ------------------------------------------------------------------------------------
# The layout before the schema had a version (git show 50c2c78:toolkit/hpctrain/runs/registry.py).
V0_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id   TEXT PRIMARY KEY,
    name     TEXT NOT NULL,
    folder   TEXT NOT NULL,
    created  REAL NOT NULL,
    executor TEXT NOT NULL,
    spec     TEXT NOT NULL DEFAULT '{}',
    state    TEXT NOT NULL DEFAULT 'PENDING'
);
CREATE TABLE IF NOT EXISTS attempts (
    run_id        TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
    attempt       INTEGER NOT NULL,
    job_id        TEXT NOT NULL,
    state         TEXT NOT NULL DEFAULT 'PENDING',
    nodes         TEXT NOT NULL DEFAULT '',
    submitted     REAL,
    started       REAL,
    ended         REAL,
    exit_code     TEXT,
    failure_class TEXT,
    PRIMARY KEY (run_id, attempt)
);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created);
"""
# What an early hand-made or partly written registry looked like: fewer columns still.
SPARSE_SCHEMA = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, name TEXT NOT NULL, folder TEXT NOT NULL, created REAL NOT NULL,
                   executor TEXT NOT NULL);
CREATE TABLE attempts (run_id TEXT NOT NULL, attempt INTEGER NOT NULL, job_id TEXT NOT NULL,
                       state TEXT NOT NULL DEFAULT 'PENDING', PRIMARY KEY (run_id, attempt));
"""


@pytest.mark.parametrize("schema", [V0_SCHEMA, SPARSE_SCHEMA], ids=["v0", "sparse"])
def test_older_registry_is_read_then_migrated_on_first_write(tmp_path: Path, schema: str) -> None:
    db = tmp_path / "r.db"
    conn = sqlite3.connect(db)
    conn.executescript(schema)
    conn.execute("INSERT INTO runs(run_id,name,folder,created,executor) VALUES ('old-1','old','/f',1.0,'slurm')")
    conn.execute("INSERT INTO attempts(run_id,attempt,job_id,state) VALUES ('old-1',0,'41','COMPLETED')")
    conn.commit()
    conn.close()
    reg = Registry(db)
    (old,) = reg.list_runs()  # before: "no such column" crashed list
    assert old.run_id == "old-1" and old.latest and old.latest.job_id == "41" and old.latest.note is None
    _add(reg, "new-1", "42")  # before: submitted, then "could not be recorded"
    reg.update_attempt("new-1", 0, note="why", tag="hpctrain:new-1")
    assert [r.run_id for r in reg.list_runs()] == ["new-1", "old-1"]
    assert reg.get_run("new-1").latest.tag == "hpctrain:new-1"  # type: ignore[union-attr]
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] >= 1
    assert reg.integrity_check() == "ok"


def test_registry_from_a_newer_hpctrain_is_refused_clearly(tmp_path: Path) -> None:
    from hpctrain.runs.registry import RegistryUnavailable

    reg = Registry(tmp_path / "r.db")
    _add(reg, "a-1")
    sqlite3.connect(reg.path).execute("PRAGMA user_version=99")
    with pytest.raises(RegistryUnavailable, match="newer hpctrain"):
        Registry(reg.path).check()
    assert [r.run_id for r in Registry(reg.path).list_runs()] == ["a-1"]  # reading still works


def test_damaged_rows_are_skipped_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path))
    reg = Registry()
    for rid in ("good-1", "badspec-1", "badtime-1", "badattempt-1"):
        _finished(reg, rid)
    conn = sqlite3.connect(reg.path)
    conn.execute("UPDATE runs SET spec='{not json' WHERE run_id='badspec-1'")
    conn.execute("UPDATE runs SET created='yesterday' WHERE run_id='badtime-1'")
    conn.execute("UPDATE attempts SET submitted='soon' WHERE run_id='badattempt-1'")
    conn.commit()
    conn.close()
    res = CliRunner().invoke(cli, ["list"])
    assert res.exit_code == 0, res.output
    assert "good-1" in res.stdout and "badattempt-1" in res.stdout
    assert "badspec-1" not in res.stdout and "badtime-1" not in res.stdout
    assert res.stderr.count("skipped a damaged") == 3


# -- a damaged file is rebuilt from the run folders ------------------------------------------------------
def _run_folder(runs_dir: Path, run_id: str, lines: list[dict[str, object]] | None, pickle_job: str = "") -> Path:
    d = runs_dir / run_id
    (d / "submitit").mkdir(parents=True)
    (d / "spec.toml").write_text(f'name = "{run_id.split("-")[0]}"\n')
    (d / "plan.json").write_text(json.dumps({"nodes": 2, "ranks_per_node": 1, "world_size": 2}))
    if lines is not None:
        (d / "attempts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if pickle_job:
        (d / "submitit" / f"{pickle_job}_submitted.pkl").write_bytes(b"")
    return d


def _runs_on_disk(tmp_path: Path) -> Path:
    runs_dir = tmp_path / "runs"
    _run_folder(runs_dir, "a-1", [{"attempt": 0, "job_id": "11", "state": "PENDING", "submitted": 100.0,
                                  "executor": "slurm", "mode": "train"},
                                 {"attempt": 0, "job_id": "11", "state": "NODE_FAIL", "ended": 150.0},
                                 {"attempt": 1, "job_id": "12", "state": "PENDING", "submitted": 160.0}])
    _run_folder(runs_dir, "b-1", None, pickle_job="21")
    _run_folder(runs_dir, "never-1", [])  # created, never queued
    return runs_dir


def _damage(path: Path, how: str) -> None:
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:1500])
    else:
        path.write_bytes(b"#!/bin/sh\necho this is not a database\n" * 20)
    for extra in path.parent.glob(path.name + "-*"):
        extra.unlink()
    os.utime(path, (1.0, 1.0))  # not a file another process is creating right now


@pytest.mark.parametrize("how", ["empty", "truncated", "garbage"])
def test_damaged_registry_is_moved_aside_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    how: str) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    runs_dir = _runs_on_disk(tmp_path)
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(runs_dir))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "1")
    monkeypatch.setenv("PATH", str(tmp_path / "nobin"))  # no SLURM: states come from the folders alone
    reg = Registry()
    for i in range(30):
        _add(reg, f"lost-{i}")
    _damage(reg.path, how)
    res = CliRunner().invoke(cli, ["list", "--json"])
    assert res.exit_code == 0, res.output
    runs = {r["run_id"]: r for r in json.loads(res.stdout)}  # before: "no runs" (or a crash)
    assert sorted(runs) == ["a-1", "b-1"]
    a = runs["a-1"]
    assert [(x["job_id"], x["state"]) for x in a["attempts"]] == [("11", "NODE_FAIL"), ("12", "PENDING")]
    assert a["spec"]["nodes"] == 2 and a["created"] == 100.0 and a["name"] == "a"
    assert runs["b-1"]["attempts"][0]["job_id"] == "21"
    assert "rebuilt the run registry" in res.stderr and "moved it to" in res.stderr
    aside = [p for p in reg.path.parent.glob("registry.sqlite3.damaged-*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(aside) == 1
    assert Registry().integrity_check() == "ok"


def test_registry_rebuild_command_adds_missing_runs_and_keeps_rows(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    runs_dir = _runs_on_disk(tmp_path)
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    _add(Registry(), "elsewhere-1", "5")  # a run whose folder is not under runs_dir: kept
    res = CliRunner().invoke(cli, ["registry", "rebuild", "--runs-dir", str(runs_dir)])
    assert res.exit_code == 0 and "2 run(s) added" in res.stdout, res.output
    assert sorted(r.run_id for r in Registry().list_runs()) == ["a-1", "b-1", "elsewhere-1"]
    res = CliRunner().invoke(cli, ["registry", "rebuild", "--runs-dir", str(runs_dir)])
    assert "0 run(s) added, 2 already known" in res.stdout
    assert CliRunner().invoke(cli, ["registry", "check"]).exit_code == 0
