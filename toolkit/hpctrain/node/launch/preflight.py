"""Pre-flight: a torch-free TCP rendezvous + sum across all ranks, before any collective can hang.

Rank 0 listens on MASTER_ADDR:(MASTER_PORT+1) (or $HPCTRAIN_PREFLIGHT_PORT); every other rank
connects (retrying until the deadline) and sends {rank, host, value}. When all WORLD_SIZE ranks
have joined, rank 0 sends the sum of the values back (a tiny all-reduce) and each rank checks it.
If someone is missing at the deadline, every rank raises `PreflightError` naming the missing ranks
and the hosts they were expected on -- in seconds, instead of a 30-minute NCCL timeout.

Torch-free: runs first on every rank, before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.node import dist
from hpctrain.nodelist import expand

DEFAULT_TIMEOUT_S = 60.0


class PreflightError(RuntimeError):
    """The rendezvous did not complete; the message names the missing ranks and hosts."""


@dataclass(frozen=True)
class PreflightResult:
    rank: int
    world_size: int
    host: str
    master: str
    port: int
    total: int
    elapsed_s: float
    hosts: list[str] = field(default_factory=list)  # host of each rank, as the ranks reported


@dataclass(frozen=True)
class Layout:
    """Who should join: rank/world size, rendezvous address, and the host each rank should run on."""

    rank: int
    world_size: int
    master: str
    port: int
    expected_hosts: list[str]  # index = rank; [] if unknown


# -- reading the environment ------------------------------------------------------------------
def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE: "2(x4)" -> [2,2,2,2]; "3(x2),1" -> [3,3,1]."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise PreflightError(f"SLURM_TASKS_PER_NODE={text!r}: cannot parse {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def hosts_by_rank(hosts: list[str], counts: list[int]) -> list[str]:
    """Block distribution (SLURM's default): ranks 0..c0-1 on hosts[0], and so on."""
    if len(counts) == 1 and len(hosts) > 1:
        counts = counts * len(hosts)
    out: list[str] = []
    for host, n in zip(hosts, counts, strict=False):  # spare hosts beyond the counts take no ranks
        out += [host] * n
    return out


def read_hostfile(path: Path) -> list[str]:
    """DeepSpeed hostfile (`host slots=N`) -> host of each rank, block-wise."""
    hosts: list[str] = []
    for line in path.read_text().splitlines():
        m = re.match(r"^(\S+)\s+slots=(\d+)", line.strip())
        if m:
            hosts += [m.group(1)] * int(m.group(2))
    return hosts


def _expected_hosts(env: Mapping[str, str], world: int) -> list[str]:
    """Host of each rank: from SLURM's task layout, else a hostfile, else an even split of the
    nodelist (DeepSpeed's launcher: one srun task per node, then WORLD_SIZE ranks from its runner)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand(nodelist) if nodelist else []
    tpn = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_STEP_TASKS_PER_NODE") or ""
    if hosts and tpn:
        placed = hosts_by_rank(hosts, expand_tasks_per_node(tpn))
        if len(placed) == world:
            return placed
    hostfile = env.get("HPCTRAIN_HOSTFILE", "")
    if hostfile and Path(hostfile).is_file():
        placed = read_hostfile(Path(hostfile))
        if len(placed) == world:
            return placed
    if hosts and world % len(hosts) == 0:
        return hosts_by_rank(hosts, [world // len(hosts)] * len(hosts))
    return []


def layout_from_env(env: Mapping[str, str] | None = None) -> Layout:
    """Rank, world size, rendezvous address/port (node.dist's reading) and expected hosts from the job's
    environment. The rendezvous listens on MASTER_PORT + 1 (MASTER_PORT is torch.distributed's), or on
    $HPCTRAIN_PREFLIGHT_PORT."""
    env = os.environ if env is None else env
    try:
        d = dist.from_env(env)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    explicit = env.get("HPCTRAIN_PREFLIGHT_PORT", "").strip()
    if explicit and not explicit.isdigit():
        raise PreflightError(f"HPCTRAIN_PREFLIGHT_PORT={explicit!r} is not an integer")
    if d is None:
        raise PreflightError("cannot tell this process's rank: set RANK and WORLD_SIZE, or run under "
                             "srun (SLURM_PROCID/SLURM_NTASKS)")
    return Layout(rank=d.rank, world_size=d.world_size, master=d.master_addr,
                  port=int(explicit) if explicit else d.master_port + 1,
                  expected_hosts=_expected_hosts(env, d.world_size))


# -- the rendezvous ---------------------------------------------------------------------------
def run_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None,
                 host: str | None = None) -> PreflightResult:
    """Run the pre-flight for this process; raises PreflightError within `timeout_s`."""
    return run(layout_from_env(env), timeout_s=timeout_s, host=host)


def run(layout: Layout, timeout_s: float = DEFAULT_TIMEOUT_S, host: str | None = None) -> PreflightResult:
    me = host or socket.gethostname()
    start = time.monotonic()
    if layout.world_size == 1:
        return PreflightResult(0, 1, me, layout.master, layout.port, 1, 0.0, [me])
    if layout.rank == 0:
        # Rank 0 gives up a little before the others, so they receive its named verdict
        # instead of each timing out with only "no answer".
        margin = min(5.0, 0.15 * timeout_s)
        total, hosts = _serve(layout, me, start + timeout_s - margin)
    else:
        total, hosts = _join(layout, me, start + timeout_s)
    expected = layout.world_size * (layout.world_size + 1) // 2
    if total != expected:
        raise PreflightError(f"pre-flight all-reduce gave {total}, expected {expected}")
    return PreflightResult(layout.rank, layout.world_size, me, layout.master, layout.port, total,
                           time.monotonic() - start, hosts)


def _send(sock: socket.socket, obj: dict[str, object]) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def _recv_line(sock: socket.socket, deadline: float) -> dict[str, object]:
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
        if len(buf) > 1 << 20:
            raise ConnectionError("oversized pre-flight message")
    obj = json.loads(buf)
    if not isinstance(obj, dict):
        raise ConnectionError("malformed pre-flight message")
    return obj


def _listen(layout: Layout) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("", layout.port))  # all interfaces: MASTER_ADDR may name any of them
    except OSError as exc:
        srv.close()
        raise PreflightError(f"rank 0 cannot listen on port {layout.port}: {exc}. Another job may use it;"
                             " set HPCTRAIN_PREFLIGHT_PORT to a free port") from exc
    srv.listen(max(16, layout.world_size))
    return srv


def _serve(layout: Layout, me: str, deadline: float) -> tuple[int, list[str]]:
    srv = _listen(layout)
    peers: dict[int, tuple[socket.socket, str, int]] = {}
    hosts = {0: me}
    total = 1  # rank 0's own value (rank + 1)
    try:
        while len(peers) < layout.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            srv.settimeout(left)
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                break
            try:
                # A peer sends its hello right after connecting; don't let one silent peer eat the budget.
                msg = _recv_line(conn, min(deadline, time.monotonic() + 5.0))
                rank, host, value = int(msg["rank"]), str(msg["host"]), int(msg["value"])  # type: ignore[call-overload]
            except (OSError, ValueError, KeyError, TypeError, ConnectionError):
                conn.close()
                continue
            if not 0 < rank < layout.world_size or rank in peers:
                _send(conn, {"error": f"rank {rank} is invalid or joined twice"})
                conn.close()
                continue
            peers[rank] = (conn, host, value)
            hosts[rank] = host
        total += sum(v for _, _, v in peers.values())
        host_list = [hosts.get(r, "?") for r in range(layout.world_size)]
        missing = [r for r in range(1, layout.world_size) if r not in peers]
        reply: dict[str, object]
        if missing:
            error = missing_message(layout, missing, hosts)
            reply = {"error": error}
        else:
            reply = {"total": total, "hosts": host_list}
        for conn, _, _ in peers.values():
            with contextlib.suppress(OSError):
                _send(conn, reply)
        if missing:
            raise PreflightError(error)
        return total, host_list
    finally:
        for conn, _, _ in peers.values():
            conn.close()
        srv.close()


def missing_message(layout: Layout, missing: list[int], joined: dict[int, str]) -> str:
    """"ranks 3, 7 did not join (expected on node2, node4)" -- the hosts are what users act on."""
    shown = ", ".join(str(r) for r in missing[:16]) + (" ..." if len(missing) > 16 else "")
    text = (f"pre-flight: {len(missing)} of {layout.world_size} ranks did not join the rendezvous at "
            f"{layout.master}:{layout.port}: rank(s) {shown}")
    if layout.expected_hosts:
        want = sorted({layout.expected_hosts[r] for r in missing})
        text += f"; expected on host(s) {', '.join(want)}"
        # Compare by where ranks were *placed*: reported hostnames may be FQDNs or aliases.
        present = {layout.expected_hosts[r] for r in joined}
        silent = [h for h in want if h not in present]
        if silent:
            text += f" (no rank at all from {', '.join(silent)}: check that node)"
    return text


def _join(layout: Layout, me: str, deadline: float) -> tuple[int, list[str]]:
    sock = _connect(layout, deadline)
    try:
        _send(sock, {"rank": layout.rank, "host": me, "value": layout.rank + 1})
        try:
            reply = _recv_line(sock, deadline)
        except TimeoutError:
            raise PreflightError(f"pre-flight: rank {layout.rank} on {me} joined {layout.master}:{layout.port}"
                                 " but rank 0 did not answer in time") from None
        except (ConnectionError, OSError, ValueError) as exc:
            raise PreflightError(f"pre-flight: rank {layout.rank} lost rank 0 at "
                                 f"{layout.master}:{layout.port}: {exc}") from None
    finally:
        sock.close()
    if "error" in reply:
        raise PreflightError(str(reply["error"]))
    return int(reply["total"]), [str(h) for h in reply.get("hosts", [])]  # type: ignore[call-overload, attr-defined]


def _connect(layout: Layout, deadline: float) -> socket.socket:
    delay, last = 0.05, ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PreflightError(f"pre-flight: rank {layout.rank} could not reach rank 0 at "
                                 f"{layout.master}:{layout.port} ({last or 'timed out'}); rank 0's host "
                                 f"{layout.expected_hosts[0] if layout.expected_hosts else layout.master}"
                                 " may be down or not started")
        try:
            return socket.create_connection((layout.master, layout.port), timeout=min(left, 5.0))
        except OSError as exc:  # not listening yet, or name not resolvable yet: retry
            last = str(exc)
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 1.0)
