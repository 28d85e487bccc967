"""Registry: records survive many writers at once; prefix lookup; secrets never stored."""

from __future__ import annotations

import json
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
