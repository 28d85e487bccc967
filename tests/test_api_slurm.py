"""hpctrain as a library on the REAL local SLURM cluster: one tiny run submitted through hpctrain.submit, waited
for, summarized, its logs read, and seen the same way by the CLI. One job, about a minute of the cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
WAIT_S = 900  # the bound on one tiny job (queue + DeepSpeed start-up on a busy 2-core machine + 4 steps)


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Run folders must be visible from the nodes: the lab shares the filesystem, /tmp included.
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    yield tmp_path
    from hpctrain.runs.registry import Registry

    jobs = [a.job_id for r in Registry().list_runs(limit=None) for a in r.attempts]
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30, check=False)


def test_submit_wait_summarize_through_the_api(home: Path) -> None:
    import hpctrain

    run = hpctrain.submit(TINY, executor="slurm", partition="debug", nodes=1, steps=4, retries=0,
                          set={"data.seq_len": 32, "checkpoint.every_steps": 2, "checkpoint.export_hf": False})
    assert isinstance(run, hpctrain.Run) and run.record is not None and run.folder.is_dir()
    job = run.record.latest.job_id if run.record.latest else ""
    assert job and "#SBATCH --job-name" in run.sbatch  # the script sbatch got, as the run folder keeps it

    done = run.wait(timeout=WAIT_S, poll=2)
    assert done.state == "COMPLETED", (done.to_dict(), run.logs()[-20:])
    assert done.job_id == job and done.failures == {}

    record = run.summary()
    assert record["run_id"] == run.run_id and record["state"] == "COMPLETED"
    last = record["attempts"][-1]
    assert last["job_id"] == job and last["last_step"] == 4 and last["last_loss"] is not None
    assert json.loads((run.folder / "summary.json").read_text())["run_id"] == run.run_id

    lines = run.logs(rank=0)
    assert lines and all(ln.startswith("a0 r0 ") for ln in lines)
    assert [r.run_id for r in hpctrain.runs()] == [run.run_id]
    assert hpctrain.Run("last").run_id == run.run_id
    assert run.cancel().jobs == []  # ended: nothing to cancel, nothing recorded
    from hpctrain.errors import HpcUsageError

    with pytest.raises(HpcUsageError, match=f"job {job}\\) COMPLETED at step 4: training is done"):
        run.resubmit()  # a completed training is not run again (as `hpctrain resubmit` refuses it)

    # The CLI reads the same run the same way (it calls the same functions).
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "hpctrain", "status", run.run_id, "--json"], capture_output=True,
                         text=True, timeout=120, check=False, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["state"] == "COMPLETED" and [a["job_id"] for a in doc["attempts"]] == [job]
