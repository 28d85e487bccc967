"""Warm ranks: the driver's srun lines (hpctrain.fault.warm) and a real zygote on this machine
(hpctrain.node.launch.zygote; no SLURM, no torch: it imports `json` instead of the trainer's modules).

The zygote forks each rank with its client's stdio, environment and directory; the client exits with the rank's
status (a signal's too); a client that dies takes its rank with it; a later in-job restart's request kills the
earlier step's ranks first; no zygote means a cold start, never a failure; the stop file ends the zygote with 0.
The cluster path (a node killed under a 3 x 2 + 1 run, the restart forked warm) is tests/test_injob_slurm.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import wait_until
from hpctrain.fault import warm

LAUNCH = ["srun", "--unbuffered", "--kill-on-bad-exit=1", "--output", "/r/submitit/%j_%t_log.out", "--error",
          "/r/submitit/%j_%t_log.err", "--container-env=A", "/v/bin/python", "-u", "-m", "submitit.core._submit",
          "/r/submitit"]


def test_the_zygotes_step_keeps_the_ranks_python_and_container_and_drops_their_logs_and_kill_on_bad_exit() -> None:
    argv = warm.zygote_argv(LAUNCH, ["node1", "node4"], Path("/r"), "77")
    assert argv == ["srun", "--nodes=2", "--nodelist=node1,node4", "--ntasks=2", "--ntasks-per-node=1", "--overlap",
                    "--no-kill", "--kill-on-bad-exit=0", "--output=/r/logs/zygote/%j.%N.log",
                    "--error=/r/logs/zygote/%j.%N.log", "--container-env=A", "/v/bin/python", "-u", "-m",
                    "hpctrain.node.launch.zygote", "serve", "/r/metrics/zygote-77.stop"]
    assert warm.client_argv(LAUNCH) == [*LAUNCH[:10], "-m", "hpctrain.node.launch.zygote", "run",
                                        "submitit.core._submit", "/r/submitit"]
    other = ["srun", "python", "-m", "hpctrain.node", "/r"]  # DeepSpeed's launcher, a script: cold, unchanged
    assert warm.zygote_argv(other, ["node1"], Path("/r"), "77") is None and warm.client_argv(other) == other
    assert warm.enabled({}) and not warm.enabled({"HPCTRAIN_WARM_RANKS": "0"})


RANK = '''import os, sys, time
print("rank", os.environ.get("PROBE"), os.getcwd(), os.getppid(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
how = sys.argv[1]
if how == "sleep":
    time.sleep(120)
if how == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(how))
'''


@pytest.fixture()
def zygote(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path, subprocess.Popen[bytes]]]:
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe_rank.py").write_text(RANK)
    job = f"t{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "SLURM_JOB_ID": job,
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "mods"), os.environ.get("PYTHONPATH", "")])}
    stop = tmp_path / "zygote.stop"
    log = (tmp_path / "zygote.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain.node.launch.zygote", "serve", str(stop), "--imports",
                             "json"], env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    wait_until(lambda: b"serving" in (tmp_path / "zygote.log").read_bytes(), 60, "the zygote to serve")
    yield env, stop, proc
    stop.write_text("stop\n")
    try:
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()


def client(env: dict[str, str], *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpctrain.node.launch.zygote", "run", "probe_rank", *args],
                            env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def test_a_zygote_forks_ranks_with_the_clients_world_and_hands_back_their_status(
        zygote: tuple[dict[str, str], Path, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    env, stop, proc = zygote
    out, err = client({**env, "PROBE": "one"}, "3", cwd=tmp_path).communicate(timeout=60)
    # forked by the zygote (its parent), in the client's directory, with the client's environment and stdio
    assert out.split() == ["rank", "one", str(tmp_path), str(proc.pid)] and "to stderr" in err
    c = client({**env, "PROBE": "two"}, "3", cwd=tmp_path)
    c.communicate(timeout=60)
    assert c.returncode == 3
    killed = client(env, "kill", cwd=tmp_path)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL  # a rank's death by a signal is its task's, for srun

    # the client dies (its step cancelled): the zygote kills its rank
    sleeper = client(env, "sleep", cwd=tmp_path)
    rank_pid = int(sleeper.stdout.readline().split()[-1]) if sleeper.stdout else 0
    assert rank_pid == proc.pid  # printed its parent: the zygote; find the rank among its children

    def kids() -> list[int]:
        return [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]

    assert len(kids()) == 1
    sleeper.kill()
    wait_until(lambda: not kids(), 30, "the orphaned rank to be killed")

    # an in-job restart's rank: the earlier step's rank on this node is killed before it starts
    old = client({**env, "HPCTRAIN_INJOB_RESTART": "0"}, "sleep", cwd=tmp_path)
    assert old.stdout is not None and old.stdout.readline()
    new = client({**env, "HPCTRAIN_INJOB_RESTART": "1"}, "0", cwd=tmp_path)
    new.communicate(timeout=60)
    old.communicate(timeout=60)
    assert new.returncode == 0 and old.returncode == -signal.SIGKILL

    stop.write_text("stop\n")
    assert proc.wait(timeout=30) == 0


def test_without_a_zygote_the_rank_starts_cold(tmp_path: Path) -> None:
    (tmp_path / "probe_rank.py").write_text(RANK)
    env = {**os.environ, "SLURM_JOB_ID": f"none{uuid.uuid4().hex[:8]}", "PROBE": "cold",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    c = client(env, "5", cwd=tmp_path)
    out, _ = c.communicate(timeout=60)
    assert c.returncode == 5 and out.split()[:3] == ["rank", "cold", str(tmp_path)]
    assert out.split()[3] == str(os.getpid())  # exec'd in place: its parent is this test, not a zygote
