"""Shared pytest wiring: the local SLURM cluster (tests/cluster/slurm.sh) and helpers to drive it.

Tests marked ``@pytest.mark.slurm`` get the session fixture ``slurm_cluster`` automatically. It brings the
cluster up once per session (``slurm.sh up``, bounded), reuses a cluster that is already healthy, and tears
it down at the end only if this session started it (others may be using a running one); under xdist the
controller does, once every worker has ended. When the cluster
cannot be started the slurm tests fail loudly; set ``HPCTRAIN_SKIP_SLURM=1`` to skip them instead.
``HPCTRAIN_KEEP_SLURM=1``, or the flag file ``$LAB/keep`` (``slurm.sh up --keep``, ``make cluster-up``),
keeps a cluster this session started running after the session.

Helper fixtures:
  run_cmd(args, timeout=60, check=True, ...)      subprocess.run with a deadline, no stdin, text output
  wait_until(cond, timeout, what, poll=1.0)        poll cond() until it is true, bounded
  wait_job_state(job_id, states, timeout=60)       poll ``sacct -X -n -P -j ID -o State`` until a state;
                                                   `timeout` excludes time queued (bounded apart)
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SLURM_SH = REPO / "tests" / "cluster" / "slurm.sh"
LAB = Path(os.environ.get("LAB", "/tmp/hpctrain-slurm"))
UP_TIMEOUT_S = float(os.environ.get("HPCTRAIN_SLURM_UP_TIMEOUT", "240"))

# sacct states after which a job never changes again (NODE_FAIL / PREEMPTED may be followed by a requeue)
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


@dataclass(frozen=True)
class SlurmCluster:
    """What tests need to know about the running cluster."""

    lab: Path
    nodes: list[str] = field(default_factory=lambda: [f"node{i}" for i in range(1, 5)])
    partition: str = "debug"
    cpus_per_node: int = 2
    started_here: bool = False
    script: Path = SLURM_SH


def wait_until(cond: Callable[[], Any], timeout: float, what: str, poll: float = 1.0) -> Any:
    """cond() until it returns something true (which is returned), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def run_cmd(
    args: Sequence[str | os.PathLike[str]] | str,
    timeout: float = 60,
    check: bool = True,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command with a deadline and no stdin; raise with its output when it fails or hangs.

    A string is run through ``bash -c``. ``env`` entries are added to the current environment.
    """
    argv: list[str] = ["bash", "-c", args] if isinstance(args, str) else [os.fspath(a) for a in args]
    full_env = {**os.environ, **env} if env else None
    try:
        proc = subprocess.run(
            argv,
            check=False,
            cwd=cwd,
            env=full_env,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(
            f"command timed out after {timeout}s: {argv}\nstdout:\n{out}\nstderr:\n{err}"
        ) from e
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed (rc {proc.returncode}): {argv}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def sacct_state(job_id: str | int) -> str:
    """The job's current state as sacct reports it ('' while sacct does not know the job yet).

    ``CANCELLED by 0`` is reduced to ``CANCELLED``.
    """
    proc = run_cmd(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State"], timeout=30, check=False)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[-1].split()[0] if lines else ""


def assert_agrees_with_sacct(rows: list[dict[str, Any]]) -> None:
    """A run's summary rows (`hpctrain summary --json`'s attempts, all ended) against SLURM's accounting: per job
    id, one row per run of the job that `sacct -D` lists (a requeue is one more; an in-job restart shares its
    job's run, so it is not), each with sacct's state, node count and hosts, and (where SLURM kept the run's start:
    it clears that of some requeued runs) its elapsed seconds, the run's in-job restarts summed. Each run of a
    requeued job is held to its own record, not the last run's (hpctrain.runs.history)."""
    by_job: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_job.setdefault(str(row["job_id"]), []).append(row)
    for job, mine in by_job.items():
        out = run_cmd(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State,ElapsedRaw,NNodes,NodeList,Start"],
                      timeout=30).stdout
        runs = [ln.split("|") for ln in out.splitlines() if ln.strip()]
        heads = [i for i, r in enumerate(mine) if r.get("how") != "in_job"]
        assert len(heads) == len(runs), (job, [(r["attempt"], r["state"], r.get("how")) for r in mine], runs)
        for n, (i, (state, elapsed, nnodes, nodelist, start)) in enumerate(zip(heads, runs, strict=True)):
            span = mine[i:heads[n + 1] if n + 1 < len(heads) else len(mine)]  # the run and its in-job restarts
            assert span[-1]["state"] == state.split()[0], (job, n, span[-1], state)  # the run's last row ends it
            assert all(r["allocated_nodes"] == int(nnodes) for r in span), (job, n, span, nnodes)
            hosts = set(run_cmd(["scontrol", "show", "hostnames", nodelist], timeout=30).stdout.split())
            assert all(set(r["hosts"]) <= hosts for r in span), (job, n, [r["hosts"] for r in span], nodelist)
            got = sum(float(r["elapsed_s"]) for r in span)
            assert start in ("None", "Unknown") or abs(got - int(elapsed)) <= 2, (job, n, got, elapsed)


# sacct states of a job that is not running (yet, or again after a requeue): time spent in them is the queue's,
# not the job's, and counts against a separate bound (the cluster is shared: another test's jobs may hold it).
WAITING_STATES = frozenset({"", "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
PENDING_TIMEOUT_S = 1800.0


def wait_job_state(
    job_id: str | int, states: str | Iterable[str], timeout: float = 60, poll_s: float = 0.5,
    pending_timeout: float = PENDING_TIMEOUT_S,
) -> str:
    """Poll sacct until the job is in one of ``states``; return that state.

    ``timeout`` bounds the time the job spends out of the queue (running, completing); the time it waits in
    the queue (sacct '' or PENDING, or REQUEUED) is bounded by ``pending_timeout`` instead, so a job held
    behind other jobs of a shared cluster does not use up the bound meant for what it does. Fails at once when
    the job reaches a different terminal state, and on either bound with the last state seen and
    ``scontrol show job`` output, so a stuck job says why.
    """
    wanted = {states} if isinstance(states, str) else set(states)
    spent = {True: 0.0, False: 0.0}  # seconds seen waiting in the queue (True) and out of it (False)
    seen, last = "", time.monotonic()
    while True:
        seen = sacct_state(job_id)
        now = time.monotonic()
        waiting = seen in WAITING_STATES
        spent[waiting] += now - last
        last = now
        if seen in wanted:
            return seen
        if seen in TERMINAL_STATES or spent[True] >= pending_timeout or spent[False] >= timeout:
            break
        time.sleep(poll_s)
    detail = run_cmd(["scontrol", "show", "job", str(job_id)], timeout=15, check=False)
    if seen in TERMINAL_STATES:
        why = "ended"
    elif waiting:
        why = f"still queued after {spent[True]:.0f}s in the queue (pending_timeout {pending_timeout:.0f}s)"
    else:
        why = f"still not there after {spent[False]:.0f}s out of the queue (timeout {timeout:.0f}s)"
    raise AssertionError(
        f"job {job_id}: wanted {sorted(wanted)}, {why}; last sacct state {seen or '(none)'}\n"
        f"{detail.stdout}{detail.stderr}"
    )


def _slurm_sh(cmd: str, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["bash", str(SLURM_SH), cmd],
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "LAB": str(LAB)},
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(e.cmd, 124, out, err + f"\n(timed out after {timeout}s)")


BUILD_SH = REPO / "containers" / "build.sh"
CH_IMAGE = Path(os.environ.get("HPCTRAIN_CH_IMAGE", "/var/tmp/hpctrain-ch/hpctrain-cpu"))


class ImageBuild:
    """`containers/build.sh ci` (the container tests' image), started once per session in the background.

    The cluster fixture starts it when container tests are selected, so the build (minutes from nothing,
    seconds when podman's cache has every layer) overlaps the cluster tests that run before them instead of
    adding to them. `wait` starts it if nobody has, and bounds it from its start."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0
        self.logs: tuple[Path, Path] | None = None

    def start(self, folder: Path) -> None:
        if self.proc is not None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.logs = (folder / "build.out", folder / "build.err")
        with self.logs[0].open("wb") as out, self.logs[1].open("wb") as err:
            self.proc = subprocess.Popen(["bash", str(BUILD_SH), "ci"], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, env={**os.environ, "HPCTRAIN_CH_IMAGE": str(CH_IMAGE)},
                                         start_new_session=True)
        self.t0 = time.monotonic()

    def wait(self, folder: Path, timeout: float) -> tuple[int | None, str, str, float]:
        """(exit code, or None when it ran past `timeout` s from its start; stdout; stderr; seconds so far)."""
        self.start(folder)
        assert self.proc is not None and self.logs is not None
        try:
            rc: int | None = self.proc.wait(timeout=max(1.0, self.t0 + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            rc = None
        out, err = (p.read_text(errors="replace") for p in self.logs)
        return rc, out, err, time.monotonic() - self.t0

    def stop(self) -> None:
        """End a build still running (the session ends before the container tests): its whole process group."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=30)


IMAGE_BUILD = ImageBuild()


@pytest.fixture(autouse=True)
def _restore_umask() -> Iterator[None]:
    """The CLI sets umask 077 for its whole process (cli.main): an in-process CliRunner test must not
    change the mode of files that later tests create."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.fixture()
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """hpctrain's config, runs and state folders under tmp_path, which is also the working directory: a test of
    the CLI sees no site profile, registry or run of the user's. Modules use it with
    `pytestmark = pytest.mark.usefixtures("isolated_home")`."""
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The local 4-node SLURM cluster, up for the whole session (see module docstring)."""
    if os.environ.get("HPCTRAIN_SKIP_SLURM") == "1":
        pytest.skip("HPCTRAIN_SKIP_SLURM=1: SLURM cluster tests skipped")
    started_here = False
    status = _slurm_sh("status", timeout=60)
    # rc 3: healthy but for nodes another session stopped on purpose (kill-node): restarting them under
    # that session's node-failure test would spoil it; they come back when it runs restart-node
    if status.returncode not in (0, 3):
        up = _slurm_sh("up", timeout=UP_TIMEOUT_S)
        if up.returncode != 0:
            pytest.fail(
                f"could not start the local SLURM cluster (`bash {SLURM_SH} up` rc {up.returncode}).\n"
                f"stdout:\n{up.stdout}\nstderr:\n{up.stderr}\n"
                "Fix the cause (install: `bash tests/cluster/slurm.sh install`, as root), "
                "or set HPCTRAIN_SKIP_SLURM=1 to skip the SLURM tests.",
                pytrace=False,
            )
        # another session may have started it while we waited on slurm.sh's lock: then it is not ours
        started_here = "cluster already up" not in up.stderr
    if (os.geteuid() == 0 and os.environ.get("HPCTRAIN_SKIP_CONTAINER_BUILD") != "1"
            and any(item.get_closest_marker("container") for item in request.session.items)
            and _claim_image_build()):
        IMAGE_BUILD.start(tmp_path_factory.mktemp("image-build"))
    worker = hasattr(request.config, "workerinput")
    if started_here and worker:
        # Another worker may still run cluster tests when this one ends: the controller stops the cluster once
        # every worker has ended (pytest_testnodedown, pytest_sessionfinish below).
        request.config.workeroutput[STARTED_KEY] = True  # type: ignore[attr-defined]
    yield SlurmCluster(lab=LAB, started_here=started_here)
    IMAGE_BUILD.stop()
    if started_here and not worker:
        _down_unless_kept()


def _down_unless_kept() -> None:
    """`slurm.sh down`, unless someone asked to keep the cluster for others: HPCTRAIN_KEEP_SLURM=1 or LAB/keep
    (`slurm.sh up --keep`, `make cluster-up`)."""
    if os.environ.get("HPCTRAIN_KEEP_SLURM") == "1" or (LAB / "keep").exists():
        return
    down = _slurm_sh("down", timeout=120)
    if down.returncode != 0:
        print(f"warning: `slurm.sh down` failed (rc {down.returncode}):\n{down.stdout}{down.stderr}")


STARTED_KEY = "hpctrain_started_slurm"  # in a worker's workeroutput: its session started the cluster
_STARTED_BY_A_WORKER: list[bool] = [False]


def _claim_image_build() -> bool:
    """Whether this process builds the image. Every xdist worker sets up its own `slurm_cluster`; the first to do
    so is the one running the serial cluster lane (the shared cluster modules wait for that lane), which holds
    the container module and so waits on IMAGE_BUILD in this process. A second build would only compete."""
    groups = os.environ.get(GROUPS_ENV)
    if not groups:
        return True
    try:
        os.close(os.open(Path(groups).with_name("image-build.claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, on the controller
def pytest_testnodedown(node: Any, error: Any) -> None:
    if getattr(node, "workeroutput", {}).get(STARTED_KEY):
        _STARTED_BY_A_WORKER[0] = True


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The controller, after every worker has ended: stop the cluster a worker's session started."""
    if not hasattr(session.config, "workerinput") and _STARTED_BY_A_WORKER[0]:
        _down_unless_kept()


# pytest-xdist (`make test` runs `-n N --dist loadgroup`). The scheduling unit is a group; every test that does not
# touch the cluster is grouped by its file, so a module-scoped fixture (a training run several tests read) is built
# once, by one worker. The tests that touch the cluster or the container image form two kinds of group:
# - the serial lane, CLUSTER_GROUP: the modules in SERIAL_CLUSTER_MODULES, run one after the other by one worker as
#   in a serial run. They kill nodes, restart daemons, drain or slow a node (any other job then would fail or wait
#   past its bounds), or need the image that worker's IMAGE_BUILD (its child process) builds.
# - with HPCTRAIN_TEST_CLUSTER_LANES=2 (LANES_ENV; else they join the serial lane), one group per other cluster
#   module ("cluster:<file>"): their jobs may share the cluster (each job's waits
#   count queued time apart, so another module's job only delays them). The scheduler holds them until the serial
#   lane has ended, then gives each to whichever worker is idle, longest first (SHARED_CLUSTER_ORDER).
# The other workers' CPU-bound tests overlap the cluster's waits (signals, time limits, requeues). xdist 3.8's own
# loadgroup cannot see groups under pytest >= 9.2 (it rewrites a nodeid attribute pytest no longer reads:
# pytest-dev/pytest-xdist#1386), so the workers write the groups to a file and the controller's scheduler below
# reads them.
CLUSTER_GROUP = "cluster"
SHARED_CLUSTER_PREFIX = "cluster:"
SERIAL_CLUSTER_MODULES = frozenset({
    "test_cluster.py",  # kill-node 4, kills and restarts the daemons (with a cluster this session started)
    "test_fault_slurm.py",  # drains and kills node3 under a 3-node run
    "test_injob_slurm.py",  # kills two nodes of a 4-node job (the whole cluster)
    "test_collect_slurm.py",  # kill-node 4 under a run (skipped when node3/node4 run other jobs)
    "test_health_slurm.py",  # slows node2's link (tc) under a run pinned to node1-node3
    "test_container_slurm.py",  # waits on the image build that this lane's worker started
})
# the shared modules in the order they are handed out: the longest first (wall s in CI, 2026-12-03), the rest after
SHARED_CLUSTER_ORDER = ("test_script_slurm.py", "test_data_slurm.py", "test_node_slurm.py", "test_submit_slurm.py",
                        "test_watch_slurm.py", "test_remote_slurm.py", "test_api_slurm.py", "test_hatches_slurm.py")
GROUPS_ENV = "HPCTRAIN_TEST_GROUPS"  # the groups file: set by the controller, inherited by its workers
# The second lane is off unless HPCTRAIN_TEST_CLUSTER_LANES=2: on this 2-core machine the cluster's jobs are
# CPU-bound, so two cluster modules side by side (beside the local DeepSpeed tests) each took up to 2.5x longer and
# `make test` got slower (pytest 1320 s, the lanes 1261/1295 s, vs 1134-1255 s with one lane; 2026-12-03). With
# more cores than the jobs use, set it to 2.
LANES_ENV = "HPCTRAIN_TEST_CLUSTER_LANES"


def _uses_cluster(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return any(item.get_closest_marker(m) for m in ("slurm", "container")) or "slurm_cluster" in names


def _group(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    if not _uses_cluster(item):
        return item.path.name
    if os.environ.get(LANES_ENV) != "2" or item.path.name in SERIAL_CLUSTER_MODULES:
        return CLUSTER_GROUP
    return SHARED_CLUSTER_PREFIX + item.path.name


def _is_cluster(group: str) -> bool:
    return group == CLUSTER_GROUP or group.startswith(SHARED_CLUSTER_PREFIX)


def _schedule_rank(item: pytest.Item, image_modules: frozenset[Path] = frozenset()) -> tuple[int, int]:
    """Longest first (the workers take eligible groups in collection order): the serial cluster lane, the shared
    cluster modules, files that train, the rest. In the cluster lane the modules that need the container image
    come last: its build (minutes on a clean machine, started with the cluster) then overlaps the other cluster
    modules instead of holding up the lane (a clean-clone CI spent 126 s waiting for it in the lane's 4th module)."""
    group = _group(item)
    if group == CLUSTER_GROUP:
        return 0, int(item.path in image_modules)
    if group.startswith(SHARED_CLUSTER_PREFIX):
        name = group.removeprefix(SHARED_CLUSTER_PREFIX)
        order = SHARED_CLUSTER_ORDER
        return 1, order.index(name) if name in order else len(order)
    return (2, 0) if item.get_closest_marker("deepspeed") else (3, 0)


TERMINAL_ENV = "HPCTRAIN_TEST_TERMINAL"  # the controller's COLUMNS and LINES, for its workers
GROUPS_DIR = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config.stash[GROUPS_DIR] = Path(tempfile.mkdtemp(prefix="hpctrain-xdist-"))
        os.environ[GROUPS_ENV] = str(config.stash[GROUPS_DIR] / "groups.json")
        os.environ[TERMINAL_ENV] = json.dumps({k: os.environ.get(k) for k in ("COLUMNS", "LINES")})
    elif hasattr(config, "workerinput") and TERMINAL_ENV in os.environ:
        # An xdist worker starts with COLUMNS=80 LINES=24: the CLI's tables would fit 80 columns there and
        # wrap what a test reads (summary's culprit line), unlike in a serial run. The controller's values win.
        for name, value in json.loads(os.environ[TERMINAL_ENV]).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def pytest_unconfigure(config: pytest.Config) -> None:
    if GROUPS_DIR in config.stash:  # the controller that made it (a pytest run by a test inherits the variable)
        shutil.rmtree(config.stash[GROUPS_DIR], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slurm`` use the cluster fixture without naming it; an xdist worker writes the groups.

    The fixture is added to the item's fixture closure (not requested from an autouse fixture) so that, being
    session-scoped, it is set up before any module- or class-scoped fixture of the test that may already
    talk to the cluster.
    """
    for item in items:
        names = getattr(item, "fixturenames", None)
        if item.get_closest_marker("slurm") is not None and names is not None and "slurm_cluster" not in names:
            names.insert(0, "slurm_cluster")
    groups_file = os.environ.get(GROUPS_ENV)
    if hasattr(config, "workerinput") and groups_file:
        image_modules = frozenset(item.path for item in items if item.get_closest_marker("container"))
        items.sort(key=lambda item: _schedule_rank(item, image_modules))  # stable: a file's tests stay in order
        # every worker collects the same tests and writes the same file; os.replace keeps each write whole
        tmp = Path(f"{groups_file}.{os.getpid()}")
        tmp.write_text(json.dumps({item.nodeid: _group(item) for item in items}))
        os.replace(tmp, groups_file)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N [--dist loadgroup]`: xdist's scope scheduler with this file's groups, taken in collection order (the
    first eligible one), the shared cluster groups held until the serial lane has ended, and no other work queued
    behind a running cluster group (what waits behind one ends the run last)."""
    if config.getoption("dist") not in ("load", "loadgroup"):  # load: what a bare `-n N` means
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep _schedule_rank's order, not xdist's largest-count-first

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                path = Path(os.environ[GROUPS_ENV])
                if not path.is_file():
                    raise RuntimeError(f"no test groups in {path}: the workers' collection did not write them")
                self.groups = json.loads(path.read_text())
            return self.groups[nodeid]

        def _eligible(self, node: Any, scope: str) -> bool:
            """A shared cluster group once the serial lane has ended, or behind it on the worker running it."""
            if not scope.startswith(SHARED_CLUSTER_PREFIX):
                return True
            if CLUSTER_GROUP in self.workqueue:
                return False
            for holder, work in self.assigned_work.items():
                if CLUSTER_GROUP in work:
                    return holder is node or all(work[CLUSTER_GROUP].values())
            return True  # no serial lane in this run (or its worker died: its tests went back to the queue)

        def _assign_work_unit(self, node: Any) -> None:
            scope = next((s for s in self.workqueue if self._eligible(node, s)), None)
            if scope is None:
                return  # every group left is held: the node idles until the serial lane's end reschedules it
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down or not self.workqueue:
                super()._reschedule(node)
                return
            work = self.assigned_work.get(node, {})
            pending = self._pending_of(work)
            # A worker holds its last test until it gets the next one (it needs `nextitem`) or shuts down: 1 pending
            # means idle. Nothing is queued behind a cluster group's running tests, and a cluster group is given
            # only to an idle worker; other work as xdist does (up to 2 pending).
            on_cluster = any(_is_cluster(s) and not all(w.values()) for s, w in work.items())
            nxt = next((s for s in self.workqueue if self._eligible(node, s)), None)
            if nxt is None or pending > (1 if on_cluster or _is_cluster(nxt) else 2):
                return
            self._assign_work_unit(node)

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # the serial lane's end releases held groups to the idle workers
                if other is not node:
                    self._reschedule(other)

    return GroupScheduling(config, log)


# The time table printed at the end of every run (CI's log keeps it): per module, the wall seconds of its tests'
# setup, call and teardown (what --durations adds up), the CPU seconds of the test process and the children it
# waited for (a cluster job's CPU is slurmd's and not in it), and the worker that ran it. Under xdist the worker
# with the largest sum is the critical path: the table says whether it is the cluster's chain or the rest.
TIME_TABLE_MIN_S = 5.0


@dataclass
class _ModuleTime:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    tests: int = 0
    workers: set[str] = field(default_factory=set)
    group: str = ""


_MODULE_TIMES: dict[str, _ModuleTime] = {}
_CPU_MARK: list[float] = [0.0]  # the process's CPU seconds when the current test phase began
_SESSION_T0: list[float] = [time.monotonic()]


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSION_T0[0] = time.monotonic()


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _CPU_MARK[0] = _cpu_s()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Each phase's report carries its CPU seconds and the test's group: attributes of a report travel from an
    xdist worker to the controller, which prints the table."""
    report = yield
    now = _cpu_s()
    report.hpctrain_cpu_s, report.hpctrain_group = now - _CPU_MARK[0], _group(item)
    _CPU_MARK[0] = now
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = _MODULE_TIMES.setdefault(report.nodeid.split("::")[0], _ModuleTime())
    module.wall_s += report.duration
    module.cpu_s += float(getattr(report, "hpctrain_cpu_s", 0.0))
    module.group = str(getattr(report, "hpctrain_group", ""))
    module.tests += report.when == "call" or (report.when == "setup" and not report.passed)
    node = getattr(report, "node", None)  # the xdist worker it came from (set on the controller)
    module.workers.add(str(getattr(getattr(node, "gateway", None), "id", "main")))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _MODULE_TIMES:
        return
    tr = terminalreporter
    tr.section("time per module (wall s: setup+call+teardown; cpu s: the test process and its children)")
    rows = sorted(_MODULE_TIMES.items(), key=lambda kv: -kv[1].wall_s)
    tr.write_line(f"{'wall':>8} {'cpu':>8} {'tests':>5}  {'worker':<14} module")
    for name, m in rows:
        if m.wall_s >= TIME_TABLE_MIN_S:
            lane = " cluster" if m.group == CLUSTER_GROUP else " shared" if _is_cluster(m.group) else ""
            where = ",".join(sorted(m.workers)) + lane
            tr.write_line(f"{m.wall_s:8.1f} {m.cpu_s:8.1f} {m.tests:5d}  {where:<14} {name}")
    per_worker: dict[str, float] = {}
    for m in _MODULE_TIMES.values():
        for w in m.workers:  # a module split over workers (rare: only a group of its own is) counts in each
            per_worker[w] = per_worker.get(w, 0.0) + m.wall_s / len(m.workers)
    serial = sum(m.wall_s for m in _MODULE_TIMES.values() if m.group == CLUSTER_GROUP)
    shared = sum(m.wall_s for m in _MODULE_TIMES.values() if m.group.startswith(SHARED_CLUSTER_PREFIX))
    rest = sum(m.wall_s for m in _MODULE_TIMES.values() if not _is_cluster(m.group))
    tr.write_line(
        f"sums: cluster serial lane {serial:.0f} s, shared cluster modules {shared:.0f} s, the rest {rest:.0f} s;"
        " per worker "
        + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(per_worker.items()))
        + f"; session {time.monotonic() - _SESSION_T0[0]:.0f} s ({len(rows)} modules, the ones over"
        f" {TIME_TABLE_MIN_S:.0f} s shown)"
    )


@pytest.fixture(name="run_cmd")
def run_cmd_fixture() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_cmd(args, timeout=60, check=True, cwd=None, env=None, input=None)``: see :func:`run_cmd`."""
    return run_cmd


@pytest.fixture(name="wait_job_state")
def wait_job_state_fixture() -> Callable[..., str]:
    """``wait_job_state(job_id, states, timeout=60)``: see :func:`wait_job_state`."""
    return wait_job_state


@pytest.fixture()
def sbatch(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``sbatch(*args, wrap=None, script=None)`` -> job id.

    Output goes to tmp_path; the jobs are scancel'd after the test.
    """
    jobs: list[str] = []

    def submit(*args: str, wrap: str | None = None, script: str | None = None, timeout: float = 60) -> str:
        argv = ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", f"--chdir={tmp_path}", *args]
        if wrap is not None:
            argv += ["--wrap", wrap]
        elif script is not None:
            path = tmp_path / f"job-{len(jobs)}.sh"
            path.write_text(script)
            argv.append(str(path))
        job_id = run_cmd(argv, timeout=timeout).stdout.strip().split(";")[0]
        jobs.append(job_id)
        return job_id

    yield submit
    if jobs:
        run_cmd(["scancel", *jobs], timeout=30, check=False)


def pytest_report_header(config: Any) -> str:
    return f"hpctrain SLURM lab: {LAB} (script {SLURM_SH.relative_to(REPO)})"
