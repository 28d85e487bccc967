"""Rendered scripts against the real local SLURM cluster (tests/cluster/slurm.sh up).

`sbatch --test-only` must accept every rendered script, and one real 2-node job runs a rendered
script end to end: directives with a hostile run folder (space, quotes) are parsed by sbatch, the
hostfile is written from SLURM_JOB_NODELIST, and every rank sees MASTER_ADDR/MASTER_PORT and the
exports.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PENDING_TIMEOUT_S, WAITING_STATES, sacct_state, wait_until
from hpctrain.nodelist import rendezvous_port
from hpctrain.plan.planner import make_plan
from hpctrain.render.sbatch import render_sbatch
from hpctrain.spec.model import Model, Resources, Spec

pytestmark = pytest.mark.slurm

if not shutil.which("sbatch"):
    pytest.skip("no sbatch on PATH (start the cluster: bash tests/cluster/slurm.sh up)", allow_module_level=True)


def _cluster_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "debug" in out.stdout


@pytest.fixture(scope="module", autouse=True)
def _needs_cluster() -> None:
    if not _cluster_up():
        pytest.skip("local SLURM cluster not answering (bash tests/cluster/slurm.sh up)")


def _spec(**res: object) -> Spec:
    base = {"nodes": 2, "tasks_per_node": 2, "partition": "debug", "time": "00:03:00"}
    base.update(res)
    return Spec(name="render-test", resources=Resources(**base),  # type: ignore[arg-type]
                model=Model(config="llama-tiny"), env={"HOSTILE": "a'b $(touch pwned) `x`"})


def _shared_tmp(tmp_path: Path) -> Path:
    """A folder every slurmd sees (the namespaces share the filesystem), with a hostile name: quotes, spaces,
    non-ASCII, and '%' that SLURM would expand in --output (%x is the job name) unless escaped."""
    d = tmp_path / "run dir 'q' 50%x ü"
    (d / "submitit").mkdir(parents=True)
    return d


@pytest.mark.parametrize("launcher", ["srun", "deepspeed"])
def test_sbatch_test_only_accepts_rendered_script(tmp_path: Path, launcher: str) -> None:
    spec = _spec()
    spec = dataclasses.replace(spec, launch=dataclasses.replace(spec.launch, launcher=launcher))
    run = _shared_tmp(tmp_path)
    script = render_sbatch(spec, make_plan(spec), run, "true")
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr


def test_sbatch_test_only_rejects_unknown_partition(tmp_path: Path) -> None:
    spec = _spec(partition="nosuchpartition")
    path = tmp_path / "job.sh"
    path.write_text(render_sbatch(spec, make_plan(spec), _shared_tmp(tmp_path), "true"))
    res = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode != 0 and "partition" in res.stderr.lower()


def test_rendered_script_runs_on_two_nodes(tmp_path: Path) -> None:
    spec = _spec()
    run = _shared_tmp(tmp_path)
    probe = ('printf "%s %s %s %s %s\\n" "$SLURM_PROCID" "$(hostname)" "$MASTER_ADDR" "$MASTER_PORT" "$HOSTILE" '
             '> "$HPCTRAIN_RUN_DIR/rank.$SLURM_PROCID"')
    script = render_sbatch(spec, make_plan(spec), run, "bash -c " + shlex.quote(probe))
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60,
                         check=False, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    # 150 s from the job's start: it may wait in the queue behind another module's job (bounded apart)
    wait_until(lambda: sacct_state(job) not in WAITING_STATES, PENDING_TIMEOUT_S, f"job {job} to leave the queue")
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and len(list(run.glob("rank.*"))) < 4:
        time.sleep(1)
    subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
    ranks = sorted(run.glob("rank.*"))
    logs = "\n".join(p.read_text() for p in (run / "submitit").glob("*"))
    assert len(ranks) == 4, f"job {job}: ranks {ranks}; logs:\n{logs}"
    rows = [p.read_text().split(" ", 4) for p in ranks]
    hosts = {r[1] for r in rows}
    assert len(hosts) == 2
    masters = {r[2] for r in rows}
    ports = {r[3] for r in rows}
    assert len(masters) == 1 and masters <= hosts and ports == {str(rendezvous_port(job))}
    assert {r[4].rstrip("\n") for r in rows} == {"a'b $(touch pwned) `x`"}
    assert sorted(line.split()[0] for line in (run / "hostfile").read_text().splitlines()) == sorted(hosts)
    assert all(line.endswith(" slots=2") for line in (run / "hostfile").read_text().splitlines())
    assert not (tmp_path / "pwned").exists() and not (run / "pwned").exists()
    assert (run / "submitit" / f"{job}_0_log.out").exists()  # submitit's path names, expanded by SLURM
    # srun's per-task logs too (its --output expands the same patterns): in the literal folder, one per task.
    assert sorted(p.name for p in (run / "submitit").glob(f"{job}_*_log.err")) == [
        f"{job}_{t}_log.err" for t in range(4)]
