"""The test scheduler of conftest.py (`make test`'s `-n 2 --dist loadgroup`), driven by simulated xdist workers.

A worker runs the tests it was sent in order and holds its last one until it is sent more or told to shut down
(xdist's worker needs the next item to run a test). The simulation plays that against the scheduler with made-up
durations and checks what the cluster tests need: no shared cluster module starts before the serial lane
(nodes killed, daemons restarted) has ended, nothing is queued behind a running cluster test, every test runs once,
the run never stalls, and the two lanes overlap.
"""

from __future__ import annotations

import json
import types
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from conftest import CLUSTER_GROUP, GROUPS_ENV, SHARED_CLUSTER_PREFIX, pytest_xdist_make_scheduler

pytest.importorskip("xdist")


class _Worker:
    """What the scheduler sees of an xdist worker (WorkerController), and the worker's run loop."""

    def __init__(self, name: str, cluster: set[int]) -> None:
        self.name, self.shutting_down, self.cluster = name, False, cluster
        self.gateway = types.SimpleNamespace(id=name)
        self.torun: deque[int] = deque()
        self.running: tuple[int, float] | None = None  # (test index, when it ends)
        self.queued_behind: list[tuple[int, list[int]]] = []  # (the running test, what was sent meanwhile)

    def send_runtest_some(self, indices: list[int]) -> None:
        # a cluster test is sent only to an idle worker, and nothing to a worker while it runs one
        if self.running is not None and {self.running[0], *self.torun, *indices} & self.cluster:
            self.queued_behind.append((self.running[0], list(indices)))
        self.torun.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _simulate(tests: list[tuple[str, str, float]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              workers: int = 2) -> dict[str, tuple[str, float, float]]:
    """tests: (nodeid, group, seconds) in collection order -> nodeid: (worker, start, end)."""
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({nodeid: group for nodeid, group, _ in tests}))
    monkeypatch.setenv(GROUPS_ENV, str(groups))
    config = types.SimpleNamespace(getoption=lambda name: "loadgroup", getvalue=lambda name: [f"{workers}*popen"],
                                   option=types.SimpleNamespace(loadscopereorder=True))
    sched: Any = pytest_xdist_make_scheduler(config, None)  # type: ignore[arg-type]
    cluster = {i for i, (_, group, _) in enumerate(tests) if group == CLUSTER_GROUP
               or group.startswith(SHARED_CLUSTER_PREFIX)}
    nodes = [_Worker(f"gw{i}", cluster) for i in range(workers)]
    collection = [nodeid for nodeid, _, _ in tests]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    seconds = {i: s for i, (_, _, s) in enumerate(tests)}
    ran: dict[str, tuple[str, float, float]] = {}
    now = 0.0
    for _ in range(10 * len(tests) + 10):
        for node in nodes:  # a worker starts its next test once it knows the one after it, or is shutting down
            if node.running is None and (len(node.torun) >= 2 or (node.torun and node.shutting_down)):
                index = node.torun.popleft()
                node.running = (index, now + seconds[index])
                assert collection[index] not in ran, f"{collection[index]} sent twice"
                ran[collection[index]] = (node.name, now, now + seconds[index])
        busy = [n for n in nodes if n.running is not None]
        if not busy:
            if sched.tests_finished:  # what xdist's DSession does then
                for node in nodes:
                    node.shutdown()
                if any(n.torun for n in nodes):
                    continue
                break
            raise AssertionError(f"stalled at {now} s: {len(ran)} of {len(tests)} tests ran, queue "
                                 f"{list(sched.workqueue)}, held {[list(n.torun) for n in nodes]}")
        node = min(busy, key=lambda n: n.running[1])  # type: ignore[index]
        index, now = node.running  # type: ignore[misc]
        node.running = None
        sched.mark_test_complete(node, index)
        if sched.tests_finished:
            for each in nodes:
                each.shutdown()
    assert sorted(ran) == sorted(collection), "not every test ran"
    assert not [n.queued_behind for n in nodes if n.queued_behind], "work queued behind a running cluster test"
    return ran


def _suite() -> list[tuple[str, str, float]]:
    """The shape of `make test`: a serial cluster lane, shared cluster modules, local files (collection order)."""
    tests = [(f"test_fault_slurm.py::t{i}", CLUSTER_GROUP, 100.0) for i in range(3)]
    tests += [(f"test_collect_slurm.py::t{i}", CLUSTER_GROUP, 40.0) for i in range(3)]
    for name, n, s in (("script", 2, 80.0), ("data", 1, 100.0), ("node", 2, 40.0), ("api", 1, 25.0)):
        tests += [(f"test_{name}_slurm.py::t{i}", f"{SHARED_CLUSTER_PREFIX}test_{name}_slurm.py", s) for i in range(n)]
    for f in range(12):
        tests += [(f"test_local{f}.py::t{i}", f"test_local{f}.py", 10.0) for i in range(4)]
    return tests


def test_shared_cluster_modules_wait_for_the_serial_lane_then_use_both_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tests = _suite()
    ran = _simulate(tests, tmp_path, monkeypatch)
    serial = [ran[t] for t, g, _ in tests if g == CLUSTER_GROUP]
    shared = [ran[t] for t, g, _ in tests if g.startswith(SHARED_CLUSTER_PREFIX)]
    assert len({w for w, _, _ in serial}) == 1  # one worker runs the serial lane, in collection order
    assert [start for _, start, _ in serial] == sorted(start for _, start, _ in serial)
    serial_end = max(end for _, _, end in serial)
    assert all(start >= serial_end for _, start, _ in shared), (serial_end, shared)
    assert {w for w, _, _ in shared} == {"gw0", "gw1"}  # the shared modules are spread over both workers
    makespan = max(end for _, _, end in ran.values())
    cluster = sum(s for _, g, s in tests if g == CLUSTER_GROUP or g.startswith(SHARED_CLUSTER_PREFIX))
    assert makespan < cluster  # the two lanes overlap: less than the cluster work done one module at a time


def test_a_cluster_only_run_holds_the_idle_worker_and_never_stalls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tests = [t for t in _suite() if not t[1].startswith("test_local")]
    ran = _simulate(tests, tmp_path, monkeypatch)
    serial_end = max(end for t, (_, _, end) in ran.items() if t.startswith(("test_fault", "test_collect")))
    assert all(start >= serial_end for t, (_, start, _) in ran.items() if not t.startswith(("test_fault",
                                                                                               "test_collect")))


def test_without_a_serial_lane_the_shared_modules_start_at_once_on_both_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tests = [t for t in _suite() if t[1] != CLUSTER_GROUP]
    ran = _simulate(tests, tmp_path, monkeypatch)
    first = sorted((start, w) for t, (w, start, _) in ran.items() if "slurm" in t)[:2]
    assert first == [(0.0, "gw0"), (0.0, "gw1")]


def test_the_modules_that_need_the_container_image_end_the_serial_lane(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's collection, sorted by conftest's hook: the container image's build, started with the cluster,
    overlaps every other cluster module; a module's tests stay together and in order."""
    from conftest import LANES_ENV, pytest_collection_modifyitems

    def item(module: str, name: str, *marks: str) -> Any:
        return types.SimpleNamespace(path=tmp_path / module, nodeid=f"{module}::{name}", fixturenames=[],
                                     get_closest_marker=lambda m: object() if m in marks else None)

    items = [item("test_api_slurm.py", "a", "slurm"), item("test_container_slurm.py", "build", "slurm"),
             item("test_container_slurm.py", "podman", "slurm", "container"), item("test_local.py", "x"),
             item("test_watch_slurm.py", "w", "slurm")]
    monkeypatch.setenv(GROUPS_ENV, str(tmp_path / "groups.json"))
    monkeypatch.delenv(LANES_ENV, raising=False)
    pytest_collection_modifyitems(types.SimpleNamespace(workerinput={}), items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ["test_api_slurm.py::a", "test_watch_slurm.py::w",
                                         "test_container_slurm.py::build", "test_container_slurm.py::podman",
                                         "test_local.py::x"]
