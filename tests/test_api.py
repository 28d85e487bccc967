"""hpctrain as a Python library (hpctrain.api, docs/api.md): the same keys, checks and results as the CLI.

The end-to-end test on the real cluster (submit through the API, wait, summarize) is in tests/test_api_slurm.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny.toml")
HEAVY = ("torch", "deepspeed", "transformers", "submitit", "datasets", "jinja2", "rich", "numpy")


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(*args: str) -> Any:
    from hpctrain.cli.main import cli as group

    return CliRunner().invoke(group, list(args), catch_exceptions=False)


def test_import_is_light_and_plan_stays_callable() -> None:
    """`import hpctrain` loads nothing heavy; hpctrain.plan and hpctrain.runs are the API's functions whether or
    not their subpackages were imported first (Python binds a subpackage to its parent's attribute)."""
    code = ("import sys, hpctrain; first = [m for m in sys.modules if m.startswith('hpctrain.')]; "
            "import hpctrain.plan.planner, hpctrain.runs.folder; from hpctrain.plan import planner; "
            f"p = hpctrain.plan({TINY!r}, nodes=2); "
            f"print(sorted(first), p.world_size, type(p) is hpctrain.Plan is planner.Plan, callable(hpctrain.runs), "
            f"[m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['hpctrain.plan',", "'hpctrain.runs']", "4", "True", "True", "[]"], out.stdout


def test_plan_is_the_cli_plan() -> None:
    import hpctrain

    flags = ["--nodes", "2", "--zero", "2", "--set", "train.lr=1e-4", "--model", "llama-tiny"]
    out = cli("plan", TINY, *flags, "--json")
    assert out.exit_code == 0, out.output
    plan = hpctrain.plan(TINY, nodes=2, zero="2", model="llama-tiny", **{"train.lr": "1e-4"})
    assert plan.to_json() == out.output
    assert hpctrain.plan(TINY, nodes=2, zero=2, set={"train.lr": 1e-4}).to_json() == out.output
    # A mapping shaped like the run file, and a Spec, plan the same run.
    import tomllib

    from hpctrain.spec.model import resolve

    with open(TINY, "rb") as f:
        tables = tomllib.load(f)
    assert hpctrain.plan(tables, nodes=2, zero=2, set={"train.lr": 1e-4}).to_json() == out.output
    spec = resolve(TINY, {"resources.nodes": 2}, check=False)
    assert hpctrain.plan(spec, zero=2, set={"train.lr": 1e-4}).to_json() == out.output


def test_a_bad_keyword_or_value_is_the_flags_refusal() -> None:
    import hpctrain
    from hpctrain.errors import HpcUsageError

    with pytest.raises(HpcUsageError) as exc:
        hpctrain.plan(TINY, nodez=2)
    assert "hpctrain.plan: unknown key 'nodez' (did you mean 'nodes'?)" in str(exc.value)
    assert "gpus_per_node" in str(exc.value)  # every valid keyword listed
    with pytest.raises(HpcUsageError) as exc:
        hpctrain.plan(TINY, nodes=0)
    out = cli("plan", TINY, "--nodes", "0")
    assert out.exit_code != 0 and f"Error: {exc.value.format_message()}" in out.output
    with pytest.raises(HpcUsageError, match="--container = 'docker:x': unknown runtime 'docker'"):
        hpctrain.plan(TINY, container="docker:x")
    with pytest.raises(HpcUsageError, match=r"hpctrain.plan's run mapping \[train\]: unknown key 'stepz'"):
        hpctrain.plan({"train": {"stepz": 3}})


def test_run_handle_of_a_folder_and_of_the_registry(home: Path) -> None:
    """A run folder the registry never saw can be summarized; status needs a registered run and says so."""
    import hpctrain
    from hpctrain.errors import HpcUsageError

    out = cli("submit", TINY, "--dry-run", "--out", str(home / "dry"))
    assert out.exit_code == 0, out.output
    run = hpctrain.Run(home / "dry")
    assert run.folder == (home / "dry").absolute() and run.record is None
    with pytest.raises(HpcUsageError, match="is not in the registry"):
        run.status()
    record = run.summary()
    assert record["run_id"] == run.run_id and record["attempts"] == []
    assert run.logs() == []
    assert hpctrain.runs() == []
    with pytest.raises(HpcUsageError, match="no runs yet"):
        hpctrain.Run("last")


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_dry_run_writes_the_bytes_the_cli_writes(home: Path) -> None:
    """The same request through `hpctrain submit --dry-run --out DIR` and hpctrain.submit(dry_run=True, out=DIR):
    every file byte-identical (both write into DIR in turn: the files name their folder)."""
    import shutil

    import hpctrain

    out = home / "dry run 'x'"
    res = cli("submit", TINY, "--dry-run", "--out", str(out), "--nodes", "2", "--zero", "2", "--model", "llama-tiny",
              "--set", "train.lr=1e-4", "--sbatch-arg=--exclusive", "--executor", "slurm")
    assert res.exit_code == 0, res.output
    by_cli = _files(out)
    assert {"sbatch.sh", "spec.toml", "plan.json", "ds_config.json"} <= set(by_cli), sorted(by_cli)
    shutil.rmtree(out)
    run = hpctrain.submit(TINY, dry_run=True, out=out, nodes=2, zero=2, model="llama-tiny",
                          set={"train.lr": "1e-4"}, sbatch_args=["--exclusive"], executor="slurm")
    assert _files(out) == by_cli
    assert run.dry_run and run.folder == out.absolute() and run.sbatch.encode() == by_cli["sbatch.sh"]
    # Without a folder nothing is written; the script is the one `--dry-run` prints (but for its run id).
    bare = hpctrain.submit(TINY, dry_run=True, nodes=2)
    assert not bare.folder.exists() and "#SBATCH --nodes=2" in bare.sbatch
    from hpctrain.errors import HpcUsageError

    with pytest.raises(HpcUsageError, match="a dry run, never submitted"):
        bare.status()
    with pytest.raises(HpcUsageError, match="out = .*only a dry run writes into a chosen folder"):
        hpctrain.submit(TINY, out=out)


def test_wait_is_bounded_and_returns_the_final_status(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run.wait polls status() (sacct refreshed: faked here, the cluster test waits for real) until the job
    ended; past its bound a TimeoutError names the job and where its logs are."""
    import hpctrain
    from hpctrain.runs.registry import Attempt, Registry

    folder = home / "runs" / "tiny-1"
    folder.mkdir(parents=True)
    reg = Registry()
    reg.add_run("tiny-1", "tiny", str(folder), "slurm", {"nodes": 1})
    reg.add_attempt(Attempt("tiny-1", 0, "4242", state="RUNNING"))
    polls: list[bool] = []
    ended = {"now": False}

    def refresh(registry: Any, records: list[Any]) -> list[str]:
        polls.append(ended["now"])
        if ended["now"]:  # SLURM says the job ended
            registry.update_attempt("tiny-1", 0, state="COMPLETED", ended=1.0)
            for r in records:
                r.attempts[0].state = r.state = "COMPLETED"
        return []

    monkeypatch.setattr("hpctrain.slurm.refresh.refresh", refresh)
    monkeypatch.setattr("hpctrain.slurm.uncertain.reconcile", lambda registry, records: [])
    run = hpctrain.Run("tiny")
    with pytest.raises(TimeoutError, match=r"run tiny-1: job 4242 is still RUNNING after 0.05 s; logs: .*tiny-1/logs"):
        run.wait(timeout=0.05, poll=0.01)
    assert polls and not any(polls)
    ended["now"] = True
    done = run.wait(timeout=60, poll=0.01)
    assert done.state == "COMPLETED" and done.job_id == "4242" and done.ended and polls[-1]
