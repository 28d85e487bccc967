"""The health check of one node before training: its GPUs (or CPU) and its network to the job's other nodes.

Run by the in-job driver (hpctrain.fault.injob, `[fault] health_check`) as an srun step of its own, one task per
node on every node of the job, spares too, before the first training step: `python -m hpctrain.node RUN` with
HPCTRAIN_NODE_MODE=health, inside the run's container when it has one. Each task measures and writes
RUN/metrics/health/<job>-<attempt>/<host>.json (the local part first, so a node whose network test hangs still
says what it found); the driver judges the figures of all nodes together (hpctrain.fault.health) and trains on
nodes that passed. Measured:

* GPUs (torch.cuda): each local GPU's bf16 matmul rate (8192^3 products for MATMUL_S), and through NVML
  (nvidia-ml-py, when installed): uncorrected ECC errors since boot, memory rows pending remap or a failed remap,
  retired pages pending, and the clock-event reasons read while the matmul runs (hardware slowdown, thermal,
  power brake).
* CPU ranks: the fp32 matmul rate with the threads a rank gets (its cores).
* Network, torch.distributed across the nodes (NCCL on GPUs, gloo on CPUs): an all-reduce's bus bandwidth, then
  each node against its ring neighbours (ping-pong of one buffer, two or three rounds of disjoint pairs): the
  pairs tell which node is slow when the all-reduce is.

HPCTRAIN_HEALTH_INJECT (tests): "matmul:host=H,f=F" makes host H's matmul loop take 1/F as long per product (a
slow GPU or CPU, measured as such), every time; "fail:rank=R" makes the check of the step's rank R raise, once
per run (a marker in metrics/faults/, so the resubmitted job passes). A slow link is made for real in the tests
(tc on the node's interface).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpctrain.node.faultinject import fire_once
from hpctrain.runs.folder import RunFolder
from hpctrain.states import HEALTH_DIR_ENV

MATMUL_S = 2.0  # seconds of matmul per GPU (a few seconds, as the check's budget allows)
CPU_MATMUL_S = 1.0
NET_TIMEOUT_S = 60.0  # the process group's collective timeout: a node that stops answering fails the check
ALLREDUCE_BYTES = {"gpu": 256 << 20, "cpu": 4 << 20}
PAIR_BYTES = {"gpu": 64 << 20, "cpu": 2 << 20}
NET_TIME_S = 0.5  # the all-reduce is repeated for about this long (at least 3 times, the count agreed by all)
PAIR_REPS = 5  # ping-pongs per pair (a fixed count: both ends must run the same number)
INJECT_ENV = "HPCTRAIN_HEALTH_INJECT"



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
        if kind not in ("matmul", "fail") or (kind == "matmul" and not {"host", "f"} <= set(kw)) or \
                (kind == "fail" and "rank" not in kw):
            raise ValueError(f"{INJECT_ENV} entry {item!r}: expected matmul:host=H,f=F or fail:rank=R")
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
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001,S110 - shutting down a library that answered
            pass
    return out


def _nvml_one(nv: Any, index: int) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # noqa: BLE001 - a GPU NVML cannot open is a finding in itself
        return {"error": f"NVML cannot open GPU {index}: {exc}"}

    def ask(key: str, fn: Any, *args: Any) -> None:
        try:
            rec[key] = fn(h, *args)
        except Exception:  # noqa: BLE001,S110 - not supported on this GPU
            pass

    ask("name", nv.nvmlDeviceGetName)
    ask("uuid", nv.nvmlDeviceGetUUID)
    ask("ecc_uncorrected", nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
    ask("remapped_rows", nv.nvmlDeviceGetRemappedRows)
    ask("retired_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus)
    ask("temp_c", nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    if reasons is not None:
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


def gpu_matmul_tflops(device: int, seconds: float, factor: float = 1.0, n: int = 8192) -> float:
    """bf16 n x n x n products on one GPU for about `seconds`: TFLOPS. The clock-event sample is taken by the
    caller while this runs."""
    import torch

    torch.cuda.set_device(device)
    a = torch.randn(n, n, device=f"cuda:{device}", dtype=torch.bfloat16)
    b = torch.randn(n, n, device=f"cuda:{device}", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize(device)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.mm(a, b)
        torch.cuda.synchronize(device)
        done += 10
        if factor < 1.0:
            time.sleep((time.perf_counter() - t0) / done * 10 * (1 / factor - 1))
    dt = time.perf_counter() - t0
    return 2 * n**3 * done / dt / 1e12


def cpu_matmul_gflops(seconds: float, factor: float = 1.0, n: int = 512) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t1 = time.perf_counter()
        torch.mm(a, b)
        done += 1
        if factor < 1.0:
            time.sleep((time.perf_counter() - t1) * (1 / factor - 1))
    return 2 * n**3 * done / (time.perf_counter() - t0) / 1e9


def local_report(use_gpu: bool, host: str) -> dict[str, Any]:
    """This node's own figures: per GPU (matmul rate, NVML), or the CPU's matmul rate."""
    import torch

    if not use_gpu:
        return {"device": "cpu", "cpu": {"gflops": round(cpu_matmul_gflops(CPU_MATMUL_S, slow_factor(host)), 2),
                                         "threads": torch.get_num_threads()}}
    count = torch.cuda.device_count()
    idx = _nvml_indices(count)
    gpus: list[dict[str, Any]] = [{"index": i, "name": torch.cuda.get_device_name(i)} for i in range(count)]
    rates: dict[int, float] = {}
    errors: dict[int, str] = {}

    def one(i: int) -> None:
        try:
            rates[i] = gpu_matmul_tflops(i, MATMUL_S, slow_factor(host))
        except Exception as exc:  # noqa: BLE001 - a GPU that cannot multiply fails the check
            errors[i] = f"{type(exc).__name__}: {exc}"[:500]

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    time.sleep(min(1.0, MATMUL_S / 2))
    during = nvml_report(idx)  # read while every GPU multiplies: throttling shows under load
    for t in threads:
        t.join()
    after = nvml_report(idx)
    for g, nvi in zip(gpus, idx):
        rec = dict(after.get(nvi, {}))
        if nvi in during and "clock_events_mask" in during[nvi]:
            rec["clock_events_during"] = during[nvi]["clock_events_mask"]
        g.update(tflops=round(rates[g["index"]], 1) if g["index"] in rates else None, nvml=rec)
        if g["index"] in errors:
            g["error"] = errors[g["index"]]
    return {"device": "gpu", "gpus": gpus}


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
    """One node's check: local figures, then the network; the report is rewritten after each part."""
    from hpctrain.node import dist
    from hpctrain.node.runconf import read_spec

    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    out_dir = Path(os.environ.get(HEALTH_DIR_ENV) or RunFolder(Path(run_dir)).health_dir(os.environ.get("SLURM_JOB_ID", ""), 0))
    out_dir.mkdir(parents=True, exist_ok=True)
    d = dist.detect()
    rec: dict[str, Any] = {"host": host, "rank": d.rank, "world": d.world_size, "start": time.time()}
    _write(out_dir, host, rec)
    try:
        spec = read_spec(RunFolder(Path(run_dir)))
        use_gpu = spec.resources.gpus_per_node > 0 and os.environ.get("DS_ACCELERATOR", "") != "cpu"
        dist.prepare_process_env(d, use_gpu=use_gpu, cpus_per_task=max(1, spec.resources.cpus_per_task))
        try:
            _injected_failure(Path(run_dir), d.rank)
            rec.update(local_report(use_gpu, host))
        except Exception as exc:  # noqa: BLE001 - this node fails; it still joins the network test, so that
            # the other nodes are not left waiting for it at the rendezvous (NET_TIMEOUT_S)
            rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        rec["local_s"] = round(time.time() - rec["start"], 2)
        _write(out_dir, host, rec)
        if d.world_size > 1:
            try:
                rec["net"] = network_report(use_gpu, d.rank, d.world_size, d.master_addr, d.master_port)
            except Exception as exc:  # noqa: BLE001 - a network that fails the test is a finding, not a crash
                rec["net"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    except Exception as exc:  # noqa: BLE001 - the report says what broke; the driver judges
        rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    rec["elapsed_s"] = round(time.time() - rec["start"], 2)
    rec["done"] = True
    _write(out_dir, host, rec)
    print(f"hpctrain health {host}: {json.dumps({k: v for k, v in rec.items() if k not in ('start',)})[:2000]}",
          flush=True)
    return 0


def _write(out_dir: Path, host: str, rec: dict[str, Any]) -> None:
    tmp = out_dir / f".{host}.json.tmp"
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, out_dir / f"{host}.json")
