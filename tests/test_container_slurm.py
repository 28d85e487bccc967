"""REAL containers on the REAL local SLURM cluster: build the CPU image from ./Dockerfile on a Debian base
made with debootstrap (containers/build.sh ci: apt installs included, so a fresh CI machine needs nothing
else), then run a 2-node ZeRO-3 job through `hpctrain submit --container ...` with every rank inside the
container — podman, then Charliecloud — and check that it trains, checkpoints, and that each rank really
ran inside the image with the job's environment.

The build is cached by podman's layer cache (seconds when nothing changed; 4–5 min from nothing on 2 cores).
Set HPCTRAIN_SKIP_CONTAINER_BUILD=1 to use an existing localhost/hpctrain:cpu as is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CH_IMAGE, IMAGE_BUILD

pytestmark = [pytest.mark.container, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[1]
TAG = "localhost/hpctrain:cpu"
HPCTRAIN = Path(sys.executable).parent / "hpctrain"
CANARY = "hf_containerCanary0123456789abcdef"
BUILD_TIMEOUT_S = 1800  # 4-5 min from nothing on 2 idle cores; it runs beside the other cluster tests
JOB_TIMEOUT_S = 600
STEPS_USR2 = 15


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """containers/build.sh ci: deps (apt), debootstrap base, the CPU image, the Charliecloud directory. Started
    in the background by the cluster fixture (conftest.ImageBuild) while the other cluster tests run."""
    if os.geteuid() != 0:
        pytest.skip("building with rootful podman and debootstrap needs root")
    if os.environ.get("HPCTRAIN_SKIP_CONTAINER_BUILD") == "1" and shutil.which("podman"):
        return TAG
    rc, out, err, took = IMAGE_BUILD.wait(tmp_path_factory.mktemp("image-build"), BUILD_TIMEOUT_S)
    if rc is None:
        pytest.fail(f"containers/build.sh ci did not finish in {BUILD_TIMEOUT_S}s:\n{err[-4000:]}")
    assert rc == 0, f"containers/build.sh ci failed:\n{out[-3000:]}\n{err[-5000:]}"
    print(f"image build (cached or not, in the background): {took:.0f} s")
    return TAG


def _rank_processes(folder: Path) -> dict[int, dict[str, Any]]:
    """Live processes running submitit's job for `folder`: pid -> {root, env} (the nodes share our PID space)."""
    found: dict[int, dict[str, Any]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            # the rank's python itself, not srun / podman / ch-run / sh, whose arguments hold the same words
            if not os.path.basename(args[0]).startswith(b"python") or b"submitit.core._submit" not in args \
                    or str(folder).encode() not in args:
                continue
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            root = os.stat(proc / "root")  # the rank's / as seen from here: (device, inode) differ in a container
            image_python = (proc / "root" / "opt" / "venv" / "bin" / "python3").exists()
            if (proc / "cmdline").read_bytes().split(b"\0") != args:
                continue  # it ended while we looked (exists() says False then): no evidence either way
            found[int(proc.name)] = {"root": (root.st_dev, root.st_ino), "exe": args[0].decode(), "env": env,
                                     "image_python": image_python}
        except (OSError, ValueError):
            continue
    return found


def _submit_and_watch(tmp_path: Path, container: str) -> tuple[Path, str, dict[int, dict[str, Any]]]:
    """Submit the 2-node ZeRO-3 job, watch its rank processes until it ends; (run dir, final state, ranks)."""
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(tmp_path / "runs"), "HPCTRAIN_STATE_DIR": str(tmp_path / "state"),
           "HF_TOKEN": CANARY, "HPCTRAIN_SKIP_IMAGE_CHECK": "0"}
    cmd = [str(HPCTRAIN), "submit", str(REPO / "examples" / "tiny.toml"), "--executor", "slurm", "--partition",
           "debug", "--nodes", "2", "--set", "resources.tasks_per_node=1", "--zero", "3", "--steps", "6",
           "--set", "checkpoint.every_steps=3", "--time", "00:10:00", "--job-name", "ctr-test",
           "--container", container, "--set", "env.NCCL_DEBUG=WARN", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    sub = json.loads(res.stdout)[0]
    run_dir, job = Path(sub["run_dir"]), str(sub["job_id"])
    ranks: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    state = ""
    try:
        while time.monotonic() < deadline:
            for pid, info in _rank_processes(run_dir / "submitit").items():
                ranks.setdefault(pid, info)
            out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True,
                                 text=True, timeout=30, check=False).stdout.split()
            state = out[0] if out else ""
            if state and state not in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING"):
                break
            time.sleep(0.5)
    finally:
        if state in ("", "PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING"):
            subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
    return run_dir, state, ranks


def _logs(run_dir: Path) -> str:
    parts = []
    for p in sorted((run_dir / "submitit").glob("*_log.*")) + sorted((run_dir / "logs").glob("*.log")):
        parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def _check_trained(run_dir: Path, state: str, ranks: dict[int, dict[str, Any]]) -> None:
    logs = _logs(run_dir)
    assert state == "COMPLETED", f"job ended {state!r}\n{logs}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-6", logs
    assert (run_dir / "checkpoints" / "step-6").is_dir() and (run_dir / "checkpoints" / "step-3").is_dir()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6, steps
    rank0 = (run_dir / "logs").glob("attempt-*.rank-0.log")
    text = "\n".join(p.read_text() for p in rank0)
    assert "rank 0/2" in text and "ZeRO 3" in text, text
    # Each rank ran inside the image: its root is not the host's, its python is the image's, and the job's
    # environment (SLURM layout, rendezvous, [env], the secret passed by name) reached it.
    assert ranks, f"no rank process seen\n{logs}"
    procids = set()
    for info in ranks.values():
        host = os.stat("/")
        assert info["root"] != (host.st_dev, host.st_ino) and info["image_python"], info
        assert info["exe"] == "python3", info["exe"]
        env = info["env"]
        assert env.get("NCCL_DEBUG") == "WARN" and env.get("HF_TOKEN") == CANARY
        assert env.get("MASTER_ADDR") == "node1" or env.get("MASTER_ADDR", "").startswith("node")
        assert env.get("HPCTRAIN_RUN_DIR") == str(run_dir) and env.get("SLURM_NTASKS") == "2"
        assert env.get("PATH", "").startswith("/opt/venv/bin"), env.get("PATH")  # the image's PATH
        procids.add(env.get("SLURM_PROCID"))
    assert procids == {"0", "1"}, procids
    assert CANARY not in (run_dir / "sbatch.sh").read_text()


def _state(job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True,
                         timeout=30, check=False).stdout.split()
    return out[0] if out else ""


def _signalled_run(tmp_path: Path, image: str) -> tuple[Path, str]:
    """The 2-node podman run that gets USR2 after step 3; (run dir, job id) once the job has ended."""
    # Every step sleeps 1 s on every rank (HPCTRAIN_FAULT_INJECT slow, passed into the image with HPCTRAIN_*): no
    # CPU, and the run is still training when the USR2 sent after step 3 lands, with 15 steps instead of 40 bare ones.
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(tmp_path / "runs"), "HPCTRAIN_STATE_DIR": str(tmp_path / "state"),
           "HPCTRAIN_FAULT_INJECT": "slow:step=1,s=1"}
    res = subprocess.run([str(HPCTRAIN), "submit", str(REPO / "examples" / "tiny.toml"), "--executor", "slurm",
                          "--partition", "debug", "--nodes", "2", "--set", "resources.tasks_per_node=1",
                          "--steps", str(STEPS_USR2), "--set", "checkpoint.every_steps=0", "--time", "00:10:00",
                          "--container", f"podman:{image}",
                          "--json"], capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    sub = json.loads(res.stdout)[0]
    run_dir, job = Path(sub["run_dir"]), str(sub["job_id"])
    log0 = run_dir / "logs" / "attempt-0.rank-0.log"
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline and " step 3 " not in (log0.read_text() if log0.exists() else ""):
            assert _state(job) in ("", "PENDING", "RUNNING", "CONFIGURING"), _logs(run_dir)
            time.sleep(0.5)
        subprocess.run(["scancel", "--signal=USR2", job], capture_output=True, timeout=30, check=True)
        while time.monotonic() < deadline and _state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            time.sleep(1)
    finally:
        if _state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
    return run_dir, job


class Background(threading.Thread):
    """`fn(*args)` in a thread, started at once; `result()` waits for it (bounded: `fn`'s own waits are) and
    returns its value or raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - raised again by result(), in the test
            self.error = exc

    def result(self) -> Any:
        self.join(timeout=JOB_TIMEOUT_S + 300)
        assert not self.is_alive(), f"{self.fn.__name__}{self.args} still running"
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture(scope="module")
def jobs(image: str, tmp_path_factory: pytest.TempPathFactory,
         request: pytest.FixtureRequest) -> Iterator[dict[str, Background]]:
    """The module's 2-node runs (podman, Charliecloud, podman signalled), those the selected tests need, submitted
    at once: one rank per node, they fit the 4 nodes side by side (6 of 8 CPUs), and each test waits for its own."""
    selected = " ".join(item.name for item in request.session.items)
    out: dict[str, Background] = {}
    if "podman_two_node" in selected:
        out["podman"] = Background(_submit_and_watch, tmp_path_factory.mktemp("podman"), f"podman:{image}")
    if "charliecloud_two_node" in selected and shutil.which("ch-run") and (CH_IMAGE / "bin").is_dir():
        out["charliecloud"] = Background(_submit_and_watch, tmp_path_factory.mktemp("charliecloud"),
                                         f"charliecloud:{CH_IMAGE}")
    if "time_limit" in selected:
        out["usr2"] = Background(_signalled_run, tmp_path_factory.mktemp("usr2"), image)
    yield out
    for job in out.values():  # each cancels its job when it gives up; none outlives the module
        job.join(timeout=JOB_TIMEOUT_S + 300)


def test_podman_two_node_zero3_trains_and_checkpoints(jobs: dict[str, Background]) -> None:
    run_dir, state, ranks = jobs["podman"].result()
    script = (run_dir / "sbatch.sh").read_text()
    assert "podman --runtime runc run --rm" in script
    _check_trained(run_dir, state, ranks)


def test_charliecloud_two_node_zero3_trains_and_checkpoints(jobs: dict[str, Background]) -> None:
    if "charliecloud" not in jobs:
        pytest.fail(f"no Charliecloud image at {CH_IMAGE}: containers/build.sh ci should have made it")
    run_dir, state, ranks = jobs["charliecloud"].result()
    assert "ch-run --set-env" in (run_dir / "sbatch.sh").read_text()
    _check_trained(run_dir, state, ranks)
    image_root = os.stat(CH_IMAGE)
    assert all(info["root"] == (image_root.st_dev, image_root.st_ino) for info in ranks.values())


def test_podman_time_limit_signal_checkpoints_requeues_and_resumes(jobs: dict[str, Background]) -> None:
    """USR2 (what `--signal=USR2@90` sends before the time limit) reaches the ranks through podman; rank 0
    checkpoints and asks to requeue (no scontrol in the image: the request goes through the run folder), the
    batch script requeues the job, and the next attempt resumes from that checkpoint to the end."""
    run_dir, job = jobs["usr2"].result()
    log0 = run_dir / "logs" / "attempt-0.rank-0.log"
    logs = _logs(run_dir)
    assert _state(job) == "COMPLETED", logs
    first = log0.read_text()
    assert "signal 12: checkpointed at step" in first, logs
    step = int(first.split("signal 12: checkpointed at step ")[1].split(",")[0])
    resumed = (run_dir / "logs" / "attempt-1.rank-0.log").read_text()
    assert f"resumed from step-{step} at step {step}" in resumed, logs
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS_USR2}"
    assert "requeueing job" in logs and not (run_dir / "requeue-request").exists()


def test_image_check_runs_the_image_like_a_rank(image: str) -> None:
    """`hpctrain image check` starts the image through the same wrapping and guard as a rank."""
    for target in (f"podman:{image}", f"charliecloud:{CH_IMAGE}"):
        res = subprocess.run([str(HPCTRAIN), "image", "check", target], capture_output=True, text=True, timeout=120,
                             check=False)
        assert res.returncode == 0 and "hpctrain 0." in res.stdout and "/opt/venv/bin/python3" in res.stdout, \
            res.stdout + res.stderr
    # The Debian base has no python, let alone hpctrain: the in-image guard names the runtime and the fix.
    res = subprocess.run([str(HPCTRAIN), "image", "check", "podman:localhost/bookworm-min"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 1 and "exit 97" in res.stderr, res.stderr
    assert "hpctrain: podman container check failed" in res.stderr and "hpctrain image build" in res.stderr


def test_missing_podman_image_fails_before_any_rank(image: str, tmp_path: Path) -> None:
    """An image absent on the node: the batch script stops before srun, naming the runtime and the fix."""
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(tmp_path / "runs"), "HPCTRAIN_STATE_DIR": str(tmp_path / "state"),
           "HPCTRAIN_SKIP_IMAGE_CHECK": "1"}  # get past the submit-time check: this is about the node
    res = subprocess.run([str(HPCTRAIN), "submit", str(REPO / "examples" / "tiny.toml"), "--executor", "slurm",
                          "--partition", "debug", "--time", "00:03:00", "--container",
                          "podman:localhost/hpctrain-missing:0", "--json"],
                         capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    sub = json.loads(res.stdout)[0]
    run_dir, job = Path(sub["run_dir"]), str(sub["job_id"])
    deadline = time.monotonic() + JOB_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True,
                             timeout=30, check=False).stdout.split()
        state = out[0] if out else ""
        if state in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
    err = "\n".join(p.read_text() for p in (run_dir / "submitit").glob("*_0_log.err"))
    assert state == "FAILED", state
    assert "hpctrain: podman container check failed" in err and "not in podman's storage" in err, err
    assert not list((run_dir / "logs").glob("attempt-*.rank-*.log")), "a rank started"

    # And at submit time, with the check on: refused before anything is queued.
    env["HPCTRAIN_SKIP_IMAGE_CHECK"] = "0"
    from hpctrain.render import containers
    from hpctrain.spec.model import Container, Spec

    with pytest.raises(Exception, match="podman has no such image"):
        containers.check_submit(Spec(container=Container(runtime="podman", image="localhost/hpctrain-missing:0")))
