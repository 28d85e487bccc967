"""Escape hatches and the repro bundle on the REAL local SLURM cluster (issue 17, items 4 and 5).

One held 1-step training job A carries every hatch (--exclusive, --nice, mail) and --snapshot; job B waits for
it with --after. The snapshot's sitecustomize.py (run by every Python of the job, since the job's folder leads
PYTHONPATH) writes a marker; the source is edited after submit, so the marker says which code ran.
Marked `slurm`; every job is cancelled at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slurm
SITE = "import os\nd = os.environ.get('HPCTRAIN_RUN_DIR')\nif d:\n" \
       "    with open(os.path.join(d, 'marker.txt'), 'a') as f:\n" \
       "        f.write('{v} ' + os.getcwd() + '\\n')\n"
TINY = ["--model", "llama-tiny", "--steps", "1", "--partition", "debug", "--time", "00:05:00", "--retries", "0",
        "--executor", "slurm", "--set", "checkpoint.export_hf=false", "--set", "data.seq_len=32"]


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    paths = {"runs": tmp_path / "runs", "state": tmp_path / "state", "code": tmp_path / "code"}
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(paths["runs"]))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(paths["state"]))
    yield paths
    from hpctrain.runs.registry import Registry

    db = paths["state"] / "registry.sqlite3"
    if db.exists():
        ids = sorted({a.job_id for r in Registry(db).list_runs(limit=None) for a in r.attempts if a.job_id})
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, timeout=30, check=False)


def _hpctrain(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=os.environ.copy(), check=False)


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    fields: dict[str, str] = {}
    for word in out.split():
        key, _, value = word.partition("=")
        fields.setdefault(key, value)
    return fields


def _sacct(job_id: str, deadline_s: float = 240) -> tuple[str, str, str]:
    """(State, Start, End) once the job is final; the wait counts only from when the job left the queue."""
    end = time.monotonic() + deadline_s
    cap = time.monotonic() + 900
    while True:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,Start,End"], capture_output=True,
                             text=True, timeout=30, check=False).stdout.strip().splitlines()
        state, start, stop = (out[-1].split("|") + ["", "", ""])[:3] if out else ("", "", "")
        if state.split(" ")[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state, start, stop
        if state == "PENDING" and time.monotonic() < cap:
            end = time.monotonic() + deadline_s
        assert time.monotonic() < end, f"job {job_id} not final: {out}"
        time.sleep(1.0)


def _repo(code: Path) -> None:
    code.mkdir()
    (code / "sitecustomize.py").write_text(SITE.format(v="v1"))
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm", "1"]):
        subprocess.run(["git", "-C", str(code), *args], check=True, capture_output=True, timeout=30)


def test_hatches_reach_the_job_after_waits_and_the_snapshot_runs(env: dict[str, Path]) -> None:
    _repo(env["code"])
    a = _hpctrain("submit", *TINY, "--snapshot", "--sbatch-arg=--hold", "--sbatch-arg=--exclusive",
                  "--sbatch-arg", "--nice=7", "--mail-type", "end,fail", "--mail-user", "me@example.org", "--json",
                  cwd=env["code"])
    assert a.returncode == 0, a.stderr
    (sub_a,) = json.loads(a.stdout)
    job_a, run_a = sub_a["job_id"], Path(sub_a["run_dir"])
    b = _hpctrain("submit", *TINY, "--preflight", "--after", f"{sub_a['run_id']}:ok", "--json", cwd=env["code"])
    assert b.returncode == 0, b.stderr
    (sub_b,) = json.loads(b.stdout)
    job_b = sub_b["job_id"]
    (env["code"] / "sitecustomize.py").write_text(SITE.format(v="v2"))  # an edit after submit

    info_a, info_b = _job(job_a), _job(job_b)
    assert (info_a["Reason"], info_a["Nice"], info_a["OverSubscribe"]) == ("JobHeldUser", "7", "NO"), info_a
    assert (info_a["MailType"], info_a["MailUser"]) == ("END,FAIL", "me@example.org"), info_a
    # The scheduler sets Reason=Dependency on its next pass; the dependency itself is there from the start.
    assert info_b["Dependency"] == f"afterok:{job_a}(unfulfilled)" and info_b["JobState"] == "PENDING", info_b

    subprocess.run(["scontrol", "release", job_a], check=True, capture_output=True, timeout=30)
    state_a, _, end_a = _sacct(job_a)
    assert state_a == "COMPLETED", (state_a, sorted(run_a.rglob("*.err")))
    state_b, start_b, _ = _sacct(job_b)
    assert state_b == "COMPLETED" and start_b >= end_a, (state_b, start_b, end_a)

    # The job ran the snapshot taken at submit, in its copy of the submit folder.
    marks = set((run_a / "marker.txt").read_text().splitlines())
    assert marks == {f"v1 {run_a / 'code'}"}, marks
    manifest = json.loads((run_a / "repro" / "manifest.json").read_text())
    sha = subprocess.run(["git", "-C", str(env["code"]), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True, timeout=30).stdout.strip()
    assert manifest["git"]["sha"] == sha and manifest["snapshot"]["workdir"] == str(run_a / "code")
    freeze = (run_a / "repro" / "pip-freeze.attempt-0.txt").read_text()
    assert f"job {job_a}" in freeze and any(ln.startswith("torch==") for ln in freeze.splitlines())


def test_a_bad_option_is_refused_in_sbatchs_words(env: dict[str, Path]) -> None:
    env["code"].mkdir()
    bad = _hpctrain("submit", *TINY, "--sbatch-arg=--exclusive", "--sbatch-arg=--bogus-opt=1", cwd=env["code"])
    assert bad.returncode == 2 and "slurm.extra = '--bogus-opt=1': sbatch --test-only refused it: unrecognized " \
        "option '--bogus-opt=1'" in bad.stderr, bad.stderr
    lic = _hpctrain("submit", *TINY, "--sbatch-arg=--exclusive", "--sbatch-arg=--licenses=nosuch", cwd=env["code"])
    assert lic.returncode == 2 and "slurm.extra = '--licenses=nosuch'" in lic.stderr, lic.stderr
    assert "Invalid license specification" in lic.stderr and "Traceback" not in lic.stderr
    assert not env["runs"].exists() or not [p for p in env["runs"].iterdir() if not p.name.startswith(".")]


def test_after_a_failed_run_is_refused(env: dict[str, Path]) -> None:
    from hpctrain.runs.registry import Registry

    env["code"].mkdir()
    a = _hpctrain("submit", *TINY, "--preflight", "--sbatch-arg=--hold", "--json", cwd=env["code"])
    assert a.returncode == 0, a.stderr
    (sub,) = json.loads(a.stdout)
    subprocess.run(["scancel", sub["job_id"]], check=True, capture_output=True, timeout=30)
    _sacct(sub["job_id"])
    assert Registry().get_run(sub["run_id"]).attempts
    refused = _hpctrain("submit", *TINY, "--after", sub["run_id"], cwd=env["code"])
    assert refused.returncode == 2 and "already ended CANCELLED" in refused.stderr, refused.stderr
    ok: Any = _hpctrain("submit", *TINY, "--preflight", "--after", f"{sub['run_id']}:any", "--dry-run",
                        cwd=env["code"])
    assert ok.returncode == 0 and "nothing to wait for" in ok.stderr and "--dependency" not in ok.stdout
