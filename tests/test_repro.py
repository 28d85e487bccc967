"""Reproducibility bundle (issue 17, item 5): repro/manifest.json, git.diff (binary-safe, capped), the node's
package list, and `submit --snapshot` (the job runs the copy, not the folder submitted from)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpctrain.cli.main import cli
from hpctrain.runs import repro, snapshot
from hpctrain.runs.folder import RunFolder
from hpctrain.spec.model import read_resolved


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(var, raising=False)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@x", *args], check=True,
                          capture_output=True, text=True, timeout=30).stdout


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "code"
    (repo / "sub").mkdir(parents=True)
    (repo / "train.py").write_text("print('v1')\n")
    (repo / "sub" / "blob.bin").write_bytes(bytes(range(256)))
    (repo / ".gitignore").write_text("data/\nruns/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    return repo


def test_git_state_records_sha_and_a_binary_diff_that_applies(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "train.py").write_text("print('v2')\n")
    (repo / "sub" / "blob.bin").write_bytes(bytes(range(255, -1, -1)) + b"\0\xff")
    (repo / "new.py").write_text("x = 1\n")  # untracked: counted, not in the diff
    info, diff = repro.git_state(repo / "sub")
    assert info["repository"] == str(repo) and info["sha"] == _git(repo, "rev-parse", "HEAD").strip()
    assert info["dirty"] is True and info["untracked_files"] == 1 and info["diff"] == "git.diff"
    assert diff is not None and b"GIT binary patch" in diff
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(repo), str(clone))
    subprocess.run(["git", "-C", str(clone), "apply", "-"], input=diff, check=True, timeout=30)
    assert (clone / "sub" / "blob.bin").read_bytes() == (repo / "sub" / "blob.bin").read_bytes()
    assert (clone / "train.py").read_text() == "print('v2')\n"


def test_a_huge_diff_is_not_kept_and_the_manifest_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path)
    (repo / "train.py").write_text("print('v2')\n" * 100)
    monkeypatch.setattr(repro, "DIFF_CAP", 50)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    repro.write_bundle(run, repo, {"runtime": "none", "image": ""})
    doc = repro.read_manifest(run)
    assert doc["git"]["diff"] is None and "over the cap of 50" in doc["git"]["note"]
    assert doc["git"]["diff_bytes"] > 50 and not RunFolder(run).git_diff.exists()


def test_outside_git_the_manifest_says_so(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    repro.write_bundle(run, plain, {"runtime": "none", "image": ""})
    doc = repro.read_manifest(run)
    assert doc["git"]["repository"] is None and doc["hpctrain_version"]
    assert not RunFolder(run).git_diff.exists()


def test_freeze_reads_the_environment_in_pip_freezes_format(tmp_path: Path) -> None:
    lines = repro.freeze_lines()
    assert any(line.startswith(("click==", "Click==")) for line in lines)
    assert all("==" in line or " @ " in line or line.startswith("-e ") for line in lines)
    path = repro.write_freeze(tmp_path, 3)
    assert path == RunFolder(tmp_path).pip_freeze(3) and path.read_text().startswith("# hpctrain ")


def test_snapshot_in_git_copies_the_working_tree_minus_ignored_and_run_folders(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path)
    (repo / "train.py").write_text("print('edited')\n")
    (repo / "new.py").write_text("x = 1\n")
    (repo / "data").mkdir()
    (repo / "data" / "big.bin").write_bytes(b"0" * 1000)  # ignored
    (repo / "other").mkdir()
    (repo / "other" / "spec.toml").write_text("")  # someone's run folder, not ignored: skipped
    (repo / "other" / "x.txt").write_text("x")
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(repo / "runs"))
    run = repo / "runs" / "r1"
    run.mkdir(parents=True)
    where = snapshot.snapshot_code(repo / "sub", run)
    assert where == run / "code" / "sub"
    code = run / "code"
    assert (code / "train.py").read_text() == "print('edited')\n" and (code / "new.py").is_file()
    assert (code / "sub" / "blob.bin").read_bytes() == bytes(range(256))
    assert not (code / "data").exists() and not (code / "other").exists() and not (code / "runs").exists()
    assert RunFolder(run).snapshot_files.read_text().startswith("# git snapshot of ")


def test_snapshot_outside_git_copies_the_folder(tmp_path: Path) -> None:
    src = tmp_path / "plain"
    (src / ".venv").mkdir(parents=True)
    (src / ".venv" / "x").write_text("x")
    (src / "m.py").write_text("m = 1\n")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    assert snapshot.snapshot_code(src, run) == run / "code"
    assert (run / "code" / "m.py").is_file() and not (run / "code" / ".venv").exists()


def test_a_huge_snapshot_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    for i in range(5):
        (src / f"{i}.py").write_text("x")
    monkeypatch.setattr(snapshot, "MAX_FILES", 3)
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    from hpctrain.errors import HpcUsageError

    with pytest.raises(HpcUsageError, match="--snapshot"):
        snapshot.snapshot_code(src, run)
    assert not (run / "code").exists()


def test_submit_writes_the_bundle_and_snapshot_sets_the_jobs_folder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch

    repo = _repo(tmp_path)
    monkeypatch.chdir(repo / "sub")
    seen: list[Any] = []

    def fake_submit(run_dirs: list[Path], spec: Any, plan: Any, executor: str = "auto", mode: str = "train",
                    dependency: str = "", **_: Any) -> list[Any]:
        seen.append(spec)
        return [dispatch.Submitted(run_id=d.name, run_dir=d, job_id="7", executor="local") for d in run_dirs]
    monkeypatch.setattr(dispatch, "submit", fake_submit)
    res = CliRunner().invoke(cli, ["submit", "--model", "llama-tiny", "--executor", "local", "--snapshot", "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    run = Path(json.loads(res.output)[0]["run_dir"])
    doc = repro.read_manifest(run)
    assert doc["git"]["sha"] == _git(repo, "rev-parse", "HEAD").strip() and doc["container"]["runtime"] == "none"
    assert doc["snapshot"]["workdir"] == str(run / "code" / "sub") and doc["submitted_from"] == str(repo / "sub")
    assert seen[0].code.dir == str(run / "code" / "sub") == read_resolved(run).code.dir
    assert (run / "code" / "train.py").read_text() == "print('v1')\n"


def test_snapshot_of_a_users_script_runs_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submit --script S --snapshot: the job runs the snapshot's copy of S, not the file an edit can change."""
    from hpctrain.slurm import dispatch

    repo = _repo(tmp_path)
    monkeypatch.chdir(tmp_path)  # submitted from outside the script's repository
    seen: list[Any] = []

    def fake_submit(run_dirs: list[Path], spec: Any, plan: Any, executor: str = "auto", mode: str = "train",
                    dependency: str = "", **_: Any) -> list[Any]:
        seen.append(spec)
        return [dispatch.Submitted(run_id=d.name, run_dir=d, job_id="7", executor="local") for d in run_dirs]
    monkeypatch.setattr(dispatch, "submit", fake_submit)
    res = CliRunner().invoke(cli, ["submit", "--script", str(repo / "train.py"), "--executor", "local", "--snapshot",
                                   "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    run = Path(json.loads(res.output)[0]["run_dir"])
    assert seen[0].launch.script == str(run / "code" / "train.py") == read_resolved(run).launch.script
    (repo / "train.py").write_text("print('v2')\n")  # an edit after submit
    assert Path(seen[0].launch.script).read_text() == "print('v1')\n"
    assert repro.read_manifest(run)["git"]["sha"] == _git(repo, "rev-parse", "HEAD").strip()
