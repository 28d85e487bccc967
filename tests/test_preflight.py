"""Pre-flight rendezvous: all ranks join fast; a missing rank is named (with its host) within the timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpctrain.node.launch.preflight import (
    Layout,
    PreflightError,
    expand_tasks_per_node,
    hosts_by_rank,
    layout_from_env,
    read_hostfile,
    run,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(rank: int, world: int, port: int, nodes: str = "node[1-4]", tpn: str = "2(x4)") -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "HPCTRAIN_PREFLIGHT_PORT": str(port), "SLURM_JOB_NODELIST": nodes, "SLURM_TASKS_PER_NODE": tpn}


def _threads(world: int, skip: set[int], timeout: float) -> dict[int, object]:
    port, out = _free_port(), {}

    def go(rank: int) -> None:
        try:
            out[rank] = run(layout_from_env(_env(rank, world, port)), timeout_s=timeout, host=f"h{rank}")
        except PreflightError as exc:
            out[rank] = exc

    ts = [threading.Thread(target=go, args=(r,)) for r in range(world) if r not in skip]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout + 5)
    return out


def test_all_ranks_join_and_sum() -> None:
    out = _threads(8, set(), 10)
    assert len(out) == 8
    for res in out.values():
        assert not isinstance(res, Exception), res
        assert res.total == 36 and res.hosts == [f"h{r}" for r in range(8)]  # type: ignore[attr-defined]


def test_missing_rank_named_with_host_within_timeout() -> None:
    t0 = time.monotonic()
    out = _threads(8, {5}, 3)
    elapsed = time.monotonic() - t0
    assert elapsed < 3 * 1.5 + 0.5  # bounded by the 3 s timeout (slack for a busy machine), not a hang
    assert len(out) == 7 and all(isinstance(e, PreflightError) for e in out.values())
    for e in out.values():
        assert "rank(s) 5" in str(e) and "node3" in str(e), e


def test_rank0_missing_every_rank_fails_in_time() -> None:
    t0 = time.monotonic()
    out = _threads(3, {0}, 2)
    assert time.monotonic() - t0 < 2 * 1.5 + 0.5  # the 2 s timeout with a busy machine's slack
    assert all(isinstance(e, PreflightError) and "could not reach rank 0" in str(e) for e in out.values())


def test_subprocesses_one_missing_exit_nonzero() -> None:
    """Real processes (like srun tasks): every one exits non-zero within the timeout, naming rank 2."""
    port, world = _free_port(), 3
    code = ("import sys; from hpctrain.node.launch.preflight import run_from_env, PreflightError\n"
            "try:\n    run_from_env(3)\nexcept PreflightError as e:\n    print(e); sys.exit(3)\n")
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", code],
                              env={**os.environ, **_env(r, world, port, "node[1-2]", "2,1")},
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=10)[0] for p in procs]
    assert time.monotonic() - t0 < 8  # 3 s timeout + two interpreters' start-up on a busy machine
    assert [p.returncode for p in procs] == [3, 3]
    assert all("rank(s) 2" in o and "node2" in o for o in outs), outs


def test_env_fallbacks() -> None:
    lay = layout_from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[1-2]",
                           "SLURM_TASKS_PER_NODE": "2(x2)", "MASTER_PORT": "29500"})
    assert (lay.rank, lay.world_size, lay.master, lay.port) == (3, 4, "node1", 29501)
    assert lay.expected_hosts == ["node1", "node1", "node2", "node2"]
    local = layout_from_env({"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
                             "SUBMITIT_LOCAL_JOB_ID": "4242"})
    assert local.master == "127.0.0.1" and local.world_size == 2 and local.port > 20000
    with pytest.raises(PreflightError, match="rank"):
        layout_from_env({})


def test_tasks_per_node_and_hostfile(tmp_path: Path) -> None:
    assert expand_tasks_per_node("2(x4)") == [2, 2, 2, 2]
    assert expand_tasks_per_node("3(x2),1") == [3, 3, 1]
    assert hosts_by_rank(["a", "b", "c"], [3, 3, 1]) == ["a"] * 3 + ["b"] * 3 + ["c"]
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=2\nnode2 slots=1\n")
    assert read_hostfile(hf) == ["node1", "node1", "node2"]
    lay = layout_from_env({"RANK": "0", "WORLD_SIZE": "3", "HPCTRAIN_HOSTFILE": str(hf)})
    assert lay.expected_hosts == ["node1", "node1", "node2"]


def test_single_rank_is_instant() -> None:
    res = run(Layout(rank=0, world_size=1, master="127.0.0.1", port=1, expected_hosts=[]), timeout_s=1)
    assert res.total == 1


def test_deepspeed_launcher_layout_splits_nodelist_evenly() -> None:
    """One srun task per node (SLURM_TASKS_PER_NODE=1(x2)) but 4 ranks from DeepSpeed's runner."""
    lay = layout_from_env({"RANK": "3", "WORLD_SIZE": "4", "SLURM_JOB_NODELIST": "node[1-2]",
                           "SLURM_TASKS_PER_NODE": "1(x2)", "MASTER_PORT": "29500"})
    assert lay.expected_hosts == ["node1", "node1", "node2", "node2"]


def test_node_without_the_preflight_module_fails_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken install (hpctrain.node.launch.preflight missing) stops the node with an error naming the module;
    it used to log "skipped" and train without the rendezvous."""
    import hpctrain.node.launch

    for name in ("main", "preflight"):
        monkeypatch.delitem(sys.modules, f"hpctrain.node.launch.{name}", raising=False)
        monkeypatch.delattr(hpctrain.node.launch, name, raising=False)
    monkeypatch.setitem(sys.modules, "hpctrain.node.launch.preflight", None)  # what an import of it then raises
    with pytest.raises(ImportError, match=r"hpctrain\.node\.launch\.preflight"):
        from hpctrain.node.launch.main import run as node_run

        node_run(str(tmp_path), "preflight")


@pytest.mark.parametrize("env", [
    {"RANK": "3", "WORLD_SIZE": "4", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "77"},
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
     "SLURM_JOB_ID": "123456789"},
    {"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
     "SUBMITIT_LOCAL_JOB_ID": "4242", "MASTER_ADDR": "ignored-for-local"},
])
def test_preflight_reads_ranks_like_the_trainer(env: dict[str, str]) -> None:
    """One reading of rank/world/master/port (node.dist): the rendezvous meets where torch will."""
    from hpctrain.node import dist

    d, lay = dist.detect(env), layout_from_env(env)
    assert (lay.rank, lay.world_size, lay.master, lay.port) == (d.rank, d.world_size, d.master_addr, d.master_port + 1)


def test_bad_rank_variables_are_named() -> None:
    with pytest.raises(PreflightError, match="RANK='x'"):
        layout_from_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(PreflightError, match="outside world size"):
        layout_from_env({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"})
