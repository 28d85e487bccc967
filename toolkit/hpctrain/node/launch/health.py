"""The health check of one node before training: its GPUs (or CPU) and its network to the job's other nodes.

Run by the in-job driver (hpctrain.fault.injob, `[fault] health_check`) as an srun step of its own, one task per
node on every node of the job, spares too, before the first training step: `python -m hpctrain.node RUN` with
HPCTRAIN_NODE_MODE=health, inside the run's container when it has one. Each task measures and writes
RUN/metrics/health/<job>-<attempt>/<host>.json (the local part first, so a node whose network test hangs still
says what it found); the driver judges the figures of all nodes together (hpctrain.fault.health) and trains on
nodes that passed. Measured:

* compute, in short windows (WINDOWS: some before the network test, some after, so that a burst of load on the
  machine hits only some of them), every sample reported with the best and the spread; the judge uses the best
  window (a healthy node reaches its true rate at least once, a sick one never does):
  - GPUs (torch.cuda): each local GPU's bf16 matmul rate (8192^3 products, GPU_WINDOW_S per window, all GPUs at
    once), and through NVML (nvidia-ml-py, when installed), read while each window runs: the SM clock and the
    clock-event reasons (hardware slowdown, thermal, power brake; the software power cap, application clocks);
    then the SM clock's maximum, the enforced and default power limits, uncorrected ECC errors since boot,
    memory rows pending remap or a failed remap, retired pages pending;
  - CPU ranks: the fp32 matmul rate of one thread per CPU-second of that thread (time.thread_time), and per
    wall second: what the CPU can do, not what the scheduler gave it (the in-job driver on the batch host, other
    jobs' processes on the node read as contention, not as a slow CPU).
* Network, torch.distributed across the nodes (NCCL on GPUs, gloo on CPUs): an all-reduce's bus bandwidth, then
  each node against its ring neighbours (ping-pong of one buffer, two or three rounds of disjoint pairs): the
  pairs tell which node is slow when the all-reduce is.

With HPCTRAIN_HEALTH_ROUND=2 (the driver's second step, on borderline nodes only) the check measures the compute
again (REMEASURE_WINDOWS windows) and skips the network.

HPCTRAIN_HEALTH_INJECT (tests): "matmul:host=H,f=F" makes host H's matmul F times as fast, every time: each
counted product costs 1/F products of real work (extra products, uncounted), so the GPU or CPU is measured as
slow per wall second and per CPU-second alike; "fail:rank=R" makes the check of the step's rank R raise, once
per run (a marker in metrics/faults/, so the resubmitted job passes); "borderline:host=H" is read by the in-job
driver, not here: it measures H again as if its first round had been borderline (fault.health). A slow link is made for
real in the tests (tc on the node's interface).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpctrain.node.faultinject import fire_once
from hpctrain.runs.folder import RunFolder
from hpctrain.states import HEALTH_DIR_ENV, HEALTH_INJECT_ENV, HEALTH_ROUND_ENV

# Compute windows before and after the network test (interleaved: a burst of load on the machine, another
# node's start-up, the driver on the batch host, hits only some of them); the judge uses the best one.
WINDOWS = (3, 3)
REMEASURE_WINDOWS = 4  # the driver's second step on a borderline node (HPCTRAIN_HEALTH_ROUND=2)
GPU_WINDOW_S = 0.4  # seconds of matmul per GPU window (6 windows: about the 2 s the check spent in one)
GPU_N = 8192
# CPU windows last CPU_WINDOW_CPU_S of the measuring thread's CPU time, or CPU_WINDOW_MAX_S of wall time on a
# node so busy that the thread gets less. 128^3 products: the operands stay in a core's L2, so other
# processes' memory traffic does not read as a slow core (measured on this project's 2-core VM, 6 windows beside
# 2 CPU hogs and 2 other measuring processes: the best per-CPU-second window 0.92-0.99 of the idle best at
# 128, 0.78-0.80 at 256, 0.83-0.91 at 512; the best per-wall-second window 0.2-0.36).
CPU_WINDOW_CPU_S = 0.15
CPU_WINDOW_MAX_S = 2.0
CPU_N = 128
NET_TIMEOUT_S = 60.0  # the process group's collective timeout: a node that stops answering fails the check
ALLREDUCE_BYTES = {"gpu": 256 << 20, "cpu": 4 << 20}
PAIR_BYTES = {"gpu": 64 << 20, "cpu": 2 << 20}
NET_TIME_S = 0.5  # the all-reduce is repeated for about this long (at least 3 times, the count agreed by all)
PAIR_REPS = 5  # ping-pongs per pair (a fixed count: both ends must run the same number)
INJECT_ENV = HEALTH_INJECT_ENV



def ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The ring's edges (i, i+1 mod n) in rounds of disjoint pairs: two rounds for an even ring, three for an
    odd one, one for two nodes. Pure; every rank computes the same schedule."""
    if n < 2:
        return []
    edges = sorted({(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)})
    rounds: list[list[tuple[int, int]]] = []
    for e in edges:
        for r in rounds:
            if all(not set(e) & set(x) for x in r):
                r.append(e)
                break
        else:
            rounds.append([e])
    return rounds


def busbw_gbps(nbytes: int, seconds: float, world: int) -> float:
    """All-reduce bus bandwidth (nccl-tests' definition): bytes x 2(n-1)/n per second, in GB/s."""
    return nbytes * 2 * (world - 1) / world / seconds / 1e9 if seconds > 0 and world > 1 else 0.0


def injected(text: str | None = None) -> list[tuple[str, dict[str, str]]]:
    """HPCTRAIN_HEALTH_INJECT's entries as (kind, {key: value}); a malformed one is an error naming it."""
    text = os.environ.get(INJECT_ENV, "") if text is None else text
    out = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, args = item.partition(":")
        kw = dict(a.split("=", 1) for a in args.split(",") if "=" in a)
        if kind not in ("matmul", "fail", "borderline") or (kind == "matmul" and not {"host", "f"} <= set(kw)) or \
                (kind == "fail" and "rank" not in kw) or (kind == "borderline" and "host" not in kw):
            raise ValueError(f"{INJECT_ENV} entry {item!r}: expected matmul:host=H,f=F, fail:rank=R or "
                             "borderline:host=H")
        out.append((kind, kw))
    return out


def slow_factor(host: str, text: str | None = None) -> float:
    """The injected matmul slow-down on `host` (1.0: none)."""
    for kind, kw in injected(text):
        if kind == "matmul" and kw["host"] == host:
            return max(1e-3, min(1.0, float(kw["f"])))
    return 1.0


def _injected_failure(run_dir: Path, rank: int) -> None:
    """fail:rank=R, once per run: the first check of rank R raises."""
    for kind, kw in injected():
        if kind == "fail" and int(kw["rank"]) == rank and fire_once(run_dir, f"health-fail-rank{rank}"):
            raise RuntimeError(f"health check failed on rank {rank} (injected by {INJECT_ENV})")


# ------------------------------------------------------------------------------------------------ local
def nvml_report(indices: list[int]) -> dict[int, dict[str, Any]]:
    """NVML's view of the GPUs with these NVML indices; {} without nvidia-ml-py or a driver. Every query a
    GPU does not support is left out (NVMLError_NotSupported)."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / library: nothing to report
        return {}
    out: dict[int, dict[str, Any]] = {}
    try:
        for i in indices:
            out[i] = _nvml_one(pynvml, i)
    finally:
        with contextlib.suppress(Exception):  # shutting down a library that answered
            pynvml.nvmlShutdown()
    return out


def _nvml_one(nv: Any, index: int) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # noqa: BLE001 - a GPU NVML cannot open is a finding in itself
        return {"error": f"NVML cannot open GPU {index}: {exc}"}

    def ask(key: str, fn: str, *consts: str, scale: float = 1.0) -> None:
        """rec[key] = nv.fn(h, nv.const...) / scale; left out when this nvidia-ml-py or GPU has no answer."""
        with contextlib.suppress(Exception):  # not supported on this GPU (or an older nvidia-ml-py)
            got = getattr(nv, fn)(h, *(getattr(nv, c) for c in consts))
            rec[key] = got / scale if scale != 1.0 else got

    ask("name", "nvmlDeviceGetName")
    ask("uuid", "nvmlDeviceGetUUID")
    ask("ecc_uncorrected", "nvmlDeviceGetTotalEccErrors", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC")
    ask("remapped_rows", "nvmlDeviceGetRemappedRows")
    ask("retired_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
    ask("temp_c", "nvmlDeviceGetTemperature", "NVML_TEMPERATURE_GPU")
    # The clock the GPU runs at and the most it may, and a power limit a site set below the default: a GPU held
    # back by the site (power cap, application clocks) is judged against the clock it was allowed.
    ask("sm_mhz", "nvmlDeviceGetClockInfo", "NVML_CLOCK_SM")
    ask("sm_max_mhz", "nvmlDeviceGetMaxClockInfo", "NVML_CLOCK_SM")
    ask("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", scale=1000.0)  # NVML answers in mW
    ask("power_default_w", "nvmlDeviceGetPowerManagementDefaultLimit", scale=1000.0)
    reasons = "nvmlDeviceGetCurrentClocksEventReasons" if hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons") \
        else "nvmlDeviceGetCurrentClocksThrottleReasons"
    ask("clock_events_mask", reasons)
    for k in ("name", "uuid"):
        if isinstance(rec.get(k), bytes):
            rec[k] = rec[k].decode()
    rows = rec.pop("remapped_rows", None)
    if isinstance(rows, (tuple, list)) and len(rows) >= 4:
        rec["remap_pending"], rec["remap_failure"] = bool(rows[2]), bool(rows[3])
    if "retired_pending" in rec:
        rec["retired_pending"] = bool(rec["retired_pending"])
    return rec


def _burn(mm: Any, owed: float, factor: float) -> float:
    """The injected slow-down: 1/factor - 1 extra (uncounted) products per counted one, carried as a fraction,
    so the device is really busier per product (per wall second and per CPU-second), not idle in a sleep."""
    if factor >= 1.0:
        return 0.0
    owed += 1.0 / factor - 1.0
    while owed >= 1.0:
        mm()
        owed -= 1.0
    return owed


def gpu_matmul_tflops(device: int, seconds: float, factor: float = 1.0, n: int = GPU_N) -> float:
    """bf16 n x n x n products on one GPU for about `seconds`: TFLOPS. The NVML sample is taken by the caller
    while this runs."""
    import torch

    torch.cuda.set_device(device)
    a = torch.randn(n, n, device=f"cuda:{device}", dtype=torch.bfloat16)
    b = torch.randn(n, n, device=f"cuda:{device}", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize(device)
    done, owed, t0 = 0, 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.mm(a, b)
            owed = _burn(lambda: torch.mm(a, b), owed, factor)
        torch.cuda.synchronize(device)
        done += 10
    dt = time.perf_counter() - t0
    return 2 * n**3 * done / dt / 1e12


def cpu_matmul_window(cpu_s: float = CPU_WINDOW_CPU_S, factor: float = 1.0, n: int = CPU_N,
                      max_s: float = CPU_WINDOW_MAX_S) -> tuple[float, float]:
    """fp32 n x n x n products in this thread, with torch on one thread, until it has had `cpu_s` CPU-seconds
    (or `max_s` wall seconds went by): (GFLOPS per CPU-second of this thread, GFLOPS per wall second)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the product runs in this thread: its CPU time is the product's, no pool's spin
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        done, owed = 0, 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        while True:
            torch.mm(a, b)
            owed = _burn(lambda: torch.mm(a, b), owed, factor)
            done += 1
            cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
            if cpu >= cpu_s or wall >= max_s:
                break
    finally:
        torch.set_num_threads(threads)
    flop = 2 * n**3 * done / 1e9
    return flop / max(cpu, 1e-9), flop / max(wall, 1e-9)


def cpu_matmul_gflops(seconds: float, factor: float = 1.0, n: int = CPU_N) -> float:
    """One CPU window of `seconds` CPU-seconds: GFLOPS per CPU-second (what the CPU can do)."""
    return cpu_matmul_window(seconds, factor, n)[0]


def spread(samples: list[float]) -> float:
    """How far a node's typical window falls short of its best: (best - median) / best, 0 for one sample. A
    burst that hits one or two windows leaves it small; a node that is noisy throughout shows it."""
    if len(samples) < 2 or max(samples) <= 0:
        return 0.0
    ordered = sorted(samples)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return round((ordered[-1] - median) / ordered[-1], 4)


class Meter:
    """This node's compute, measured window by window: `measure(k)` adds k windows, `report()` says what all of
    them found (every sample, the best, the spread; per GPU the SM clock and clock-event reasons of each)."""

    def __init__(self, use_gpu: bool, host: str) -> None:
        self.use_gpu, self.factor = use_gpu, slow_factor(host)
        self.samples: dict[int, list[float]] = {}  # GPU index (CPU: -1) -> rate per window
        self.wall: list[float] = []  # CPU: the rate per wall second of each window
        self.clocks: dict[int, list[int | None]] = {}
        self.events: dict[int, list[int]] = {}
        self.errors: dict[int, str] = {}
        self.count = 0
        self.idx: list[int] = []
        self.names: list[str] = []
        if use_gpu:
            import torch

            self.count = torch.cuda.device_count()
            self.idx = _nvml_indices(self.count)
            self.names = [torch.cuda.get_device_name(i) for i in range(self.count)]

    def measure(self, windows: int) -> None:
        for _ in range(windows):
            if self.use_gpu:
                self._gpu_window()
            else:
                cpu, wall = cpu_matmul_window(factor=self.factor)
                self.samples.setdefault(-1, []).append(round(cpu, 2))
                self.wall.append(round(wall, 2))

    def _gpu_window(self) -> None:
        """One window on every GPU at once; NVML is read halfway through (clocks under load)."""
        live = [i for i in range(self.count) if i not in self.errors]

        def one(i: int) -> None:
            try:
                self.samples.setdefault(i, []).append(round(gpu_matmul_tflops(i, GPU_WINDOW_S, self.factor), 1))
            except Exception as exc:  # noqa: BLE001 - a GPU that cannot multiply fails the check
                self.errors[i] = f"{type(exc).__name__}: {exc}"[:500]

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in live]
        for t in threads:
            t.start()
        time.sleep(GPU_WINDOW_S / 2)
        during = nvml_report([self.idx[i] for i in live])
        for t in threads:
            t.join()
        for i in live:
            rec = during.get(self.idx[i], {})
            self.clocks.setdefault(i, []).append(rec.get("sm_mhz"))
            self.events.setdefault(i, []).append(int(rec.get("clock_events_mask") or 0))

    def report(self) -> dict[str, Any]:
        """The figures so far, in the report's shape (hpctrain.fault.health reads it)."""
        import torch

        if not self.use_gpu:
            rates = self.samples.get(-1, [])
            return {"device": "cpu", "cpu": {
                "gflops": max(rates, default=0.0), "samples": rates, "spread": spread(rates),
                "gflops_wall": max(self.wall, default=0.0), "wall_samples": list(self.wall), "per": "cpu_s",
                "n": CPU_N, "threads": torch.get_num_threads()}}
        after = nvml_report(self.idx)
        gpus: list[dict[str, Any]] = []
        for i, (nvi, name) in enumerate(zip(self.idx, self.names, strict=True)):
            rates = self.samples.get(i, [])
            rec = dict(after.get(nvi, {}))
            if self.events.get(i):
                rec["clock_events_during"] = _or(self.events[i])
            g: dict[str, Any] = {"index": i, "name": name, "tflops": max(rates) if rates else None,
                                 "samples": rates, "spread": spread(rates), "sm_mhz": self.clocks.get(i, []),
                                 "clock_events": self.events.get(i, []), "nvml": rec}
            if i in self.errors:
                g["error"] = self.errors[i]
            gpus.append(g)
        return {"device": "gpu", "gpus": gpus}


def _or(masks: list[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def local_report(use_gpu: bool, host: str, windows: int = sum(WINDOWS)) -> dict[str, Any]:
    """This node's own figures in `windows` windows in a row: per GPU (matmul rate, NVML), or the CPU's."""
    meter = Meter(use_gpu, host)
    meter.measure(windows)
    return meter.report()


def _nvml_indices(count: int) -> list[int]:
    """NVML's index of each visible CUDA device: CUDA_VISIBLE_DEVICES when it lists indices (SLURM's gres
    binding does), else 0..count-1."""
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(vis) == count and all(v.isdigit() for v in vis):
        return [int(v) for v in vis]
    return list(range(count))


# ------------------------------------------------------------------------------------------------ network
def network_report(use_gpu: bool, rank: int, world: int, master: str, port: int) -> dict[str, Any]:
    """The all-reduce bus bandwidth across the nodes and this node's ring pairs (GB/s each)."""
    import torch
    import torch.distributed as tdist

    kind = "gpu" if use_gpu else "cpu"
    dev = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(dev)
    tdist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                             world_size=world, timeout=timedelta(seconds=NET_TIMEOUT_S))
    try:
        buf = torch.ones(ALLREDUCE_BYTES[kind] // 4, dtype=torch.float32, device=dev)
        tdist.all_reduce(buf)  # warm-up: connections, NCCL's rings
        t0 = time.perf_counter()
        tdist.all_reduce(buf)
        _sync(use_gpu)
        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)  # one repetition count for every rank
        reps = max(3, min(50, int(NET_TIME_S / max(float(slowest.item()), 1e-4))))
        per = _timed(lambda: tdist.all_reduce(buf), use_gpu, reps)
        out: dict[str, Any] = {"world": world, "allreduce_bytes": buf.numel() * 4,
                               "allreduce_busbw_gbps": round(busbw_gbps(buf.numel() * 4, per, world), 3), "pairs": {}}
        pair = torch.ones(PAIR_BYTES[kind] // 4, dtype=torch.float32, device=dev)
        for rnd in ring_rounds(world):
            for a, b in rnd:
                if rank in (a, b):
                    other = b if rank == a else a
                    _ping_pong(tdist, pair, rank < other, other)  # warm-up: the pair's connection
                    per = _timed(lambda o=other: _ping_pong(tdist, pair, rank < o, o), use_gpu, PAIR_REPS)
                    out["pairs"][str(other)] = round(2 * pair.numel() * 4 / per / 1e9, 3)
            tdist.barrier()
        return out
    finally:
        tdist.destroy_process_group()


def _ping_pong(tdist: Any, buf: Any, first: bool, other: int) -> None:
    if first:
        tdist.send(buf, other)
        tdist.recv(buf, other)
    else:
        tdist.recv(buf, other)
        tdist.send(buf, other)


def _sync(use_gpu: bool) -> None:
    if use_gpu:
        import torch

        torch.cuda.synchronize()


def _timed(fn: Any, use_gpu: bool, reps: int) -> float:
    """Seconds per call over `reps` calls (the same count on every rank taking part)."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(use_gpu)
    return (time.perf_counter() - t0) / reps


# ------------------------------------------------------------------------------------------------ entry
def run(run_dir: str) -> int:
    """One node's check: compute windows, the network, compute windows again; the report is rewritten after each
    part. HPCTRAIN_HEALTH_ROUND=2 (the driver's re-measurement of a borderline node): compute windows only."""
    from hpctrain.node import dist
    from hpctrain.node.runconf import read_spec

    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    out_dir = Path(os.environ.get(HEALTH_DIR_ENV)
                   or RunFolder(Path(run_dir)).health_dir(os.environ.get("SLURM_JOB_ID", ""), 0))
    out_dir.mkdir(parents=True, exist_ok=True)
    again = os.environ.get(HEALTH_ROUND_ENV, "1") not in ("", "1")
    d = dist.detect()
    rec: dict[str, Any] = {"host": host, "rank": d.rank, "world": d.world_size, "start": time.time(),
                           **({"round": 2} if again else {})}
    _write(out_dir, host, rec)
    try:
        spec = read_spec(RunFolder(Path(run_dir)))
        use_gpu = spec.resources.gpus_per_node > 0 and os.environ.get("DS_ACCELERATOR", "") != "cpu"
        dist.prepare_process_env(d, use_gpu=use_gpu, cpus_per_task=max(1, spec.resources.cpus_per_task))
        meter = _measure(rec, lambda: Meter(use_gpu, host), REMEASURE_WINDOWS if again else WINDOWS[0],
                         Path(run_dir), None if again else d.rank)
        rec["local_s"] = round(time.time() - rec["start"], 2)
        _write(out_dir, host, rec)
        if not again:
            if d.world_size > 1:
                try:
                    rec["net"] = network_report(use_gpu, d.rank, d.world_size, d.master_addr, d.master_port)
                except Exception as exc:  # noqa: BLE001 - a network that fails the test is a finding, not a crash
                    rec["net"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            if meter is not None:  # the windows after the network test: the same meter, more samples
                _measure(rec, lambda: meter, WINDOWS[1], Path(run_dir), None)
    except Exception as exc:  # noqa: BLE001 - the report says what broke; the driver judges
        rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    rec["elapsed_s"] = round(time.time() - rec["start"], 2)
    rec["done"] = True
    _write(out_dir, host, rec)
    print(f"hpctrain health {host}: {json.dumps({k: v for k, v in rec.items() if k not in ('start',)})[:2000]}",
          flush=True)
    return 0


def _measure(rec: dict[str, Any], meter_of: Callable[[], Meter], windows: int, run_dir: Path,
             fail_rank: int | None) -> Meter | None:
    """`windows` more compute windows into `rec`; an error is this node's finding (rec["error"]), and the node
    still joins the network test, so that the other nodes are not left waiting for it at the rendezvous."""
    try:
        if fail_rank is not None:
            _injected_failure(run_dir, fail_rank)
        meter: Meter = meter_of()
        meter.measure(windows)
        rec.update(meter.report())
        return meter
    except Exception as exc:  # noqa: BLE001 - see above
        rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        return None


def _write(out_dir: Path, host: str, rec: dict[str, Any]) -> None:
    tmp = out_dir / f".{host}.json.tmp"
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, out_dir / f"{host}.json")
