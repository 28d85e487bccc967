"""Judging the health check: which nodes of the job may train, from every node's report (hpctrain.node.health).

Pure functions, login side (the in-job driver runs them in the batch script). A node fails when:
* it wrote no complete report (its task never started, crashed or was still running at the step's time limit);
* its report says something broke (an exception, a GPU that could not multiply, NVML errors: uncorrected ECC
  errors, rows pending remap or a failed remap, retired pages pending, clocks held back by hardware slowdown,
  thermal or power-brake events);
* a GPU's bf16 matmul rate is below `matmul_ratio` x the expected rate of its kind (MEASURED_TFLOPS, this
  project's own measurement), or, for a kind not in the table, the median of the job's GPUs of that kind; a
  CPU node's matmul rate below `matmul_ratio` x the median of the job's nodes (3 nodes or more: two cannot
  say which one is slow);
* its best ring link is below `net_ratio` x the median node's best link (3 nodes or more). A node's best link
  is the faster of its two ring pairs: a healthy node next to a slow one still has one good pair, the slow node
  has none.
The all-reduce's bus bandwidth is reported; under `min_busbw_gbps` (when set) it is a note, and with the pairs
unable to tell which node is slow, only a note: no node is blamed without evidence against it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

# bf16 dense matmul rate (8192^3, torch.mm) measured on one GPU of each kind, in TFLOPS; the name NVML/torch
# gives must contain the key. H200: 788, BENCHMARKS.md (device machine, 2026-11-29, the MFU reference).
MEASURED_TFLOPS: dict[str, float] = {"H200": 788.0}
# NVML clock-event reasons that mean the GPU is held back by something wrong (not an idle GPU, not the
# application clocks a site set, not the software power cap every busy GPU meets).
BAD_CLOCK_EVENTS = {0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                    0x80: "hw_power_brake_slowdown"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The health step's outcome: failed hosts with why, notes, and each host's figures for the summary."""

    failed: dict[str, str]
    notes: tuple[str, ...] = ()
    figures: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def healthy(self, hosts: list[str]) -> list[str]:
        return [h for h in hosts if h not in self.failed]


def read_reports(directory: Path, hosts: list[str]) -> dict[str, dict[str, Any] | None]:
    """Each host's report (None: none, or an unreadable one)."""
    out: dict[str, dict[str, Any] | None] = {}
    for h in hosts:
        try:
            rec = json.loads((directory / f"{h}.json").read_text())
            out[h] = rec if isinstance(rec, dict) else None
        except (OSError, ValueError):
            out[h] = None
    return out


def expected_tflops(name: str) -> float | None:
    return next((v for k, v in MEASURED_TFLOPS.items() if k.lower() in name.lower()), None)


def judge(reports: dict[str, dict[str, Any] | None], *, matmul_ratio: float = 0.8, net_ratio: float = 0.5,
          min_busbw_gbps: float = 0.0) -> Verdict:
    """Which hosts fail, and why (see the module docstring). Pure."""
    failed: dict[str, str] = {}
    notes: list[str] = []
    figures: dict[str, dict[str, Any]] = {}
    for host, rec in reports.items():
        if rec is None or not rec.get("done"):
            failed[host] = "no health report: the check did not finish on this node" + (
                f" (it got as far as {_stage(rec)})" if rec else "")
        elif rec.get("error"):
            failed[host] = f"the health check failed: {rec['error']}"
    ok = {h: r for h, r in reports.items() if r is not None and h not in failed}
    _judge_compute(ok, matmul_ratio, failed, figures)
    _judge_network(ok, net_ratio, min_busbw_gbps, failed, notes, figures)
    return Verdict(failed, tuple(notes), figures)


def _stage(rec: dict[str, Any]) -> str:
    return "the network test" if "device" in rec else "its start"


def _judge_compute(ok: dict[str, dict[str, Any]], ratio: float, failed: dict[str, str],
                   figures: dict[str, dict[str, Any]]) -> None:
    gpus = [(h, g) for h, r in ok.items() for g in r.get("gpus") or ()]
    by_kind: dict[str, list[float]] = {}
    for _, g in gpus:
        if g.get("tflops"):
            by_kind.setdefault(str(g.get("name", "")), []).append(float(g["tflops"]))
    for h, g in gpus:
        why = _gpu_problems(g, ratio, by_kind)
        fig = figures.setdefault(h, {})
        fig.setdefault("gpu_tflops", []).append(g.get("tflops"))
        if why:
            failed.setdefault(h, f"GPU {g.get('index')} ({g.get('name', '?')}): {'; '.join(why)}")
    cpu = {h: float(r["cpu"]["gflops"]) for h, r in ok.items() if (r.get("cpu") or {}).get("gflops")}
    for h, v in cpu.items():
        figures.setdefault(h, {})["cpu_gflops"] = v
    if len(cpu) >= 3:
        med = statistics.median(cpu.values())
        for h, v in cpu.items():
            if v < ratio * med:
                failed.setdefault(h, f"CPU matmul {v:.1f} GFLOPS < {ratio:g} x the nodes' median {med:.1f}")


def _gpu_problems(g: dict[str, Any], ratio: float, by_kind: dict[str, list[float]]) -> list[str]:
    why = list(nvml_problems(g.get("nvml") or {}))
    if g.get("error"):
        why.append(str(g["error"]))
    rate, name = g.get("tflops"), str(g.get("name", ""))
    ref = expected_tflops(name)
    basis = "its kind's measured rate"
    if ref is None and len(by_kind.get(name, [])) >= 3:
        ref, basis = statistics.median(by_kind[name]), "the job's median"
    if rate is not None and ref is not None and float(rate) < ratio * ref:
        why.append(f"bf16 matmul {float(rate):.0f} TFLOPS < {ratio:g} x {basis} {ref:.0f}")
    elif rate is None and not g.get("error"):
        why.append("no matmul rate")
    return why


def _judge_network(ok: dict[str, dict[str, Any]], ratio: float, floor: float, failed: dict[str, str],
                   notes: list[str], figures: dict[str, dict[str, Any]]) -> None:
    host_of = {int(r["rank"]): h for h, r in ok.items() if isinstance(r.get("rank"), int)}
    best: dict[str, float] = {}
    for h, r in ok.items():
        net = r.get("net") or {}
        if net.get("error"):
            notes.append(f"{h}: network test: {net['error']}")
            continue
        pairs = {host_of.get(int(k), f"rank {k}"): float(v) for k, v in (net.get("pairs") or {}).items()}
        if pairs:
            best[h] = max(pairs.values())
            figures.setdefault(h, {}).update(pairs_gbps=pairs, best_link_gbps=best[h])
        if net.get("allreduce_busbw_gbps") is not None:
            figures.setdefault(h, {})["allreduce_busbw_gbps"] = net["allreduce_busbw_gbps"]
    busbw = min((float(f["allreduce_busbw_gbps"]) for f in figures.values() if "allreduce_busbw_gbps" in f),
                default=None)
    slow: list[str] = []
    if len(best) >= 3:
        ref = statistics.median_high(best.values())
        slow = [h for h, v in best.items() if v < ratio * ref]
        for h in slow:
            failed.setdefault(h, f"network: its best ring link {best[h]:.3g} GB/s < {ratio:g} x the median node's "
                                 f"{ref:.3g} GB/s")
    if busbw is not None and floor and busbw < floor:
        notes.append(f"all-reduce bus bandwidth {busbw:.3g} GB/s < fault.health_min_busbw_gbps {floor:g}"
                     + (f"; slow node(s): {', '.join(slow)}" if slow else
                        "; the ring pairs name no slow node (with 2 nodes they cannot)"))


def nvml_problems(rec: dict[str, Any]) -> list[str]:
    """What NVML's record of one GPU says is wrong (empty: nothing). Pure."""
    out = []
    if rec.get("error"):
        out.append(str(rec["error"]))
    if int(rec.get("ecc_uncorrected") or 0) > 0:
        out.append(f"{rec['ecc_uncorrected']} uncorrected ECC error(s) since the driver loaded")
    if rec.get("remap_failure"):
        out.append("a memory row remap failed")
    if rec.get("remap_pending"):
        out.append("memory rows pending remap (needs a GPU reset)")
    if rec.get("retired_pending"):
        out.append("retired pages pending (needs a GPU reset)")
    mask = int(rec.get("clock_events_mask") or 0) | int(rec.get("clock_events_during") or 0)
    held = [name for bit, name in BAD_CLOCK_EVENTS.items() if mask & bit]
    if held:
        out.append(f"clocks held back: {', '.join(held)}")
    return out
