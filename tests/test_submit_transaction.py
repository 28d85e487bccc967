"""A submission is a transaction (issue 27, item 1), against the REAL local SLURM cluster.

`hpctrain submit` runs as a child process and stops at one point of its sequence (HPCTRAIN_SUBMIT_PAUSE_AT:
after the intent is recorded, after sbatch answered, after the job id is recorded; hpctrain.slurm.transaction);
the test then delivers a real signal there: Ctrl-C (SIGINT to the process group, as a terminal sends it),
SIGTERM through an outer `timeout`, SIGTERM, SIGKILL. Whatever arrives, no queued job is lost: it is recorded,
or found again by its --comment tag by `list`, `status` and `registry rebuild`; a signal before sbatch leaves
nothing. cancel and resubmit of a run whose outcome is still unknown refuse plainly (issue 27, item 2).
Jobs are submitted held (--hold: they never take a node) and cancelled at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slurm
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
PAUSE_WAIT_S = 180.0  # the child reaching its pause point on a busy machine (imports, sinfo, sbatch)


@pytest.fixture()
def lab(slurm_cluster: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(tmp_path / "runs"), "HPCTRAIN_STATE_DIR": str(tmp_path / "state"),
           "HPCTRAIN_SUBMIT_PAUSE_FILE": str(tmp_path / "paused")}
    tags: list[str] = []
    yield {"env": env, "tmp": tmp_path, "tags": tags}
    ids = [j for j, c in _squeue().items() if c in tags or c.startswith(tuple(t + ":" for t in tags))]
    for f in (tmp_path / "runs").glob("*/attempts.jsonl"):  # supervisor jobs
        ids += [str(r["supervisor_job"]) for r in map(json.loads, f.read_text().splitlines()) if "supervisor_job" in r]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30, check=False)


def _squeue() -> dict[str, str]:
    """job id -> comment, for every job of ours SLURM lists."""
    out = subprocess.run(["squeue", "-h", "--me", "-t", "all", "-o", "%i|%k"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def _paused_submit(lab: dict[str, Any], point: str, *, retries: int = 0,
                   outer_timeout: bool = False) -> tuple[subprocess.Popen[str], str]:
    """Start `hpctrain submit` (its own process group, like a shell job) and wait until it is paused at
    `point`; returns the process and the tag its job carries (or will carry)."""
    argv = [sys.executable, "-m", "hpctrain", "submit", TINY, "--executor", "slurm", "--partition", "debug",
            "--nodes", "1", "--time", "00:05:00", "--retries", str(retries), "--sbatch-arg=--hold", "--json"]
    if outer_timeout:
        argv = ["timeout", "600", *argv]
    paused = Path(lab["env"]["HPCTRAIN_SUBMIT_PAUSE_FILE"])
    paused.unlink(missing_ok=True)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**lab["env"], "HPCTRAIN_SUBMIT_PAUSE_AT": point})
    deadline = time.monotonic() + PAUSE_WAIT_S
    while not paused.exists() or not paused.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"submit never reached {point!r} (rc {proc.returncode}): {out}\n{err}")
        time.sleep(0.1)
    tag = paused.read_text().split()[1]
    lab["tags"].append(tag)
    return proc, tag


def _deliver(proc: subprocess.Popen[str], how: str) -> tuple[int, str, str]:
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    else:
        proc.send_signal({"term": signal.SIGTERM, "kill": signal.SIGKILL, "timeout": signal.SIGTERM}[how])
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err


def _hpctrain(lab: dict[str, Any], *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True, timeout=180,
                          env={**lab["env"], **env}, check=False)


def _runs(lab: dict[str, Any]) -> list[Path]:
    base = lab["tmp"] / "runs"
    return sorted(p for p in base.iterdir() if not p.name.startswith(".")) if base.is_dir() else []


def _status(lab: dict[str, Any], run: str, **env: str) -> dict[str, Any]:
    res = _hpctrain(lab, "status", run, "--json", **env)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def _job_of(tag: str) -> str:
    jobs = [j for j, c in _squeue().items() if c == tag]
    assert len(jobs) == 1, (tag, _squeue())
    return jobs[0]


@pytest.mark.parametrize("how", ["ctrl-c", "term"])
def test_a_signal_before_sbatch_leaves_nothing(lab: dict[str, Any], how: str) -> None:
    proc, tag = _paused_submit(lab, "intent")
    assert len(_runs(lab)) == 1  # the intent: the folder and its record exist before sbatch runs
    rc, _, _ = _deliver(proc, how)
    assert rc != 0
    assert _runs(lab) == [] and tag not in _squeue().values()
    listed = _hpctrain(lab, "list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stdout


@pytest.mark.parametrize("how", ["ctrl-c", "timeout"])
def test_a_signal_after_sbatch_waits_until_the_job_is_recorded(lab: dict[str, Any], how: str) -> None:
    retries = 1 if how == "timeout" else 0  # the supervisor is armed inside the transaction too
    proc, tag = _paused_submit(lab, "sbatch", retries=retries, outer_timeout=how == "timeout")
    job = _job_of(tag)  # sbatch has queued it; nothing has recorded its id yet
    rc, _, err = _deliver(proc, how)
    assert rc != 0 and f"job {job} is queued and recorded" in err, err
    (run,) = _runs(lab)
    att = _status(lab, run.name)["attempts"][0]
    assert (att["job_id"], att["state"], att["tag"]) == (job, "PENDING", tag)
    assert (run / "submitit" / f"{job}_submitted.pkl").is_file()  # the job's pickle, where submitit looks
    lines = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
    assert [x["state"] for x in lines if "state" in x][:2] == ["SUBMIT_UNKNOWN", "PENDING"]
    assert any(x.get("supervises") == job for x in lines) == bool(retries)


def test_sigkill_after_sbatch_is_found_by_its_tag_even_after_a_rebuild(lab: dict[str, Any]) -> None:
    proc, tag = _paused_submit(lab, "sbatch")
    job = _job_of(tag)
    rc, _, _ = _deliver(proc, "kill")
    assert rc == -signal.SIGKILL
    (run,) = _runs(lab)
    # the registry file is lost too: the rebuild finds the run from its folder (the intent line)
    (lab["tmp"] / "state" / "registry.sqlite3").unlink()
    rebuilt = _hpctrain(lab, "registry", "rebuild")
    assert rebuilt.returncode == 0 and "1 run(s) added" in rebuilt.stdout, rebuilt
    assert f"run {run.name}, attempt 0: PENDING (job {job}): found by its comment {tag}" in rebuilt.stdout
    listed = _hpctrain(lab, "list", "--json")  # asks SLURM by tag
    (rec,) = json.loads(listed.stdout)
    att = rec["attempts"][0]
    assert (rec["run_id"], att["job_id"], att["state"]) == (run.name, job, "PENDING"), rec
    assert (run / "submitit" / f"{job}_submitted.pkl").is_file()  # the kept pickle got the job's name


def test_sigkill_before_sbatch_is_unknown_then_failed_and_never_acted_on(lab: dict[str, Any]) -> None:
    proc, tag = _paused_submit(lab, "intent")
    rc, _, _ = _deliver(proc, "kill")
    assert rc == -signal.SIGKILL
    (run,) = _runs(lab)
    assert _status(lab, run.name)["state"] == "SUBMIT_UNKNOWN"  # within the grace period: it may still come
    for cmd, verb in (("cancel", "cancels nothing"), ("resubmit", "resubmits nothing")):
        res = _hpctrain(lab, cmd, run.name)
        assert res.returncode == 75 and verb in res.stderr and tag in res.stderr, res
        assert "(job )" not in res.stdout + res.stderr
    assert _status(lab, run.name)["state"] == "SUBMIT_UNKNOWN"  # not CANCELLED: nothing was cancelled
    assert tag not in _squeue().values()  # and no second job was started
    done = _status(lab, run.name, HPCTRAIN_SUBMIT_GRACE_S="0")  # SLURM says no job carries the tag
    assert done["state"] == "SUBMIT_FAILED" and tag in done["attempts"][0]["note"], done


def test_sigkill_after_the_record_keeps_the_run(lab: dict[str, Any]) -> None:
    proc, tag = _paused_submit(lab, "settled")
    rc, _, _ = _deliver(proc, "kill")
    assert rc == -signal.SIGKILL
    (run,) = _runs(lab)
    att = _status(lab, run.name)["attempts"][0]
    assert (att["job_id"], att["state"]) == (_job_of(tag), "PENDING")


def test_a_registry_damaged_mid_submit_still_records_the_job(lab: dict[str, Any]) -> None:
    """The registry file is truncated between sbatch and the record: the submission repairs it (rebuilt from the
    run folders, where the intent is) and records the job; it never says "could not be recorded, scancel it"."""
    proc, tag = _paused_submit(lab, "sbatch")
    job = _job_of(tag)
    db = lab["tmp"] / "state" / "registry.sqlite3"
    db.write_bytes(db.read_bytes()[:100])  # truncated mid-submit
    Path(lab["env"]["HPCTRAIN_SUBMIT_PAUSE_FILE"]).unlink()  # go on
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0 and "scancel" not in err, err
    (sub,) = json.loads(out)
    assert sub["job_id"] == job
    att = _status(lab, sub["run_id"])["attempts"][0]
    assert (att["job_id"], att["state"]) == (job, "PENDING")


def test_an_outer_timeout_while_sbatch_hangs_is_obeyed_and_the_job_found(lab: dict[str, Any]) -> None:
    """sbatch is slow (a wrapper that waits before the real sbatch): SIGTERM from an outer `timeout` stops
    hpctrain's wait at once, sbatch (in its own session) still queues the job, and `status` finds it by its tag."""
    import shutil

    bin_dir = lab["tmp"] / "bin"
    bin_dir.mkdir()
    started, go = lab["tmp"] / "sbatch-started", lab["tmp"] / "sbatch-go"
    real = shutil.which("sbatch")
    (bin_dir / "sbatch").write_text(  # --test-only (the --hold hatch's check) passes; the submission waits
        f"#!/bin/sh\ncase \"$*\" in *--test-only*) exec {real} \"$@\";; esac\ntouch {started}\n"
        f"for i in $(seq 600); do [ -e {go} ] && break; sleep 0.1; done\nexec {real} \"$@\"\n")
    (bin_dir / "sbatch").chmod(0o755)
    lab["env"]["PATH"] = f"{bin_dir}:{lab['env']['PATH']}"
    proc, tag = _paused_submit(lab, "intent", outer_timeout=True)
    Path(lab["env"]["HPCTRAIN_SUBMIT_PAUSE_FILE"]).unlink()  # on to sbatch
    deadline = time.monotonic() + PAUSE_WAIT_S
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    rc, _, err = _deliver(proc, "timeout")  # sbatch still waits for `go`: hpctrain must not
    assert rc != 0 and "kept as SUBMIT_UNKNOWN" in err and tag in err, err
    (run,) = _runs(lab)
    assert _status(lab, run.name)["state"] == "SUBMIT_UNKNOWN"
    go.touch()  # sbatch goes on, on its own, and queues the job
    deadline = time.monotonic() + PAUSE_WAIT_S
    while tag not in _squeue().values():
        assert time.monotonic() < deadline, "the abandoned sbatch never queued its job"
        time.sleep(0.5)
    att = _status(lab, run.name)["attempts"][0]
    assert (att["job_id"], att["state"]) == (_job_of(tag), "PENDING"), att
    assert (run / "submitit" / f"{att['job_id']}_submitted.pkl").is_file()
