"""Judging the health check: which nodes of the job may train, from every node's report (hpctrain.node.launch.health).

Pure functions, login side (the in-job driver runs them in the batch script). A node fails when:
* it wrote no complete report (its task never started, crashed or was still running at the step's time limit);
* its report says something broke (an exception, a GPU that could not multiply, NVML errors: uncorrected ECC
  errors, rows pending remap or a failed remap, retired pages pending, clocks held back by hardware slowdown,
  thermal or power-brake events);
* its compute is slow: the best of its windows (a healthy node reaches its true rate at least once; a sick one
  never does) below the line `min(matmul_ratio, 1 - noise)` x its reference, where the noise is the spread the
  windows themselves show (so a node is condemned only when it is below the reference by more than the noise)
  and the reference is
  - for a GPU, the expected bf16 rate of its kind (MEASURED_TFLOPS, this project's own measurement), or, for a
    kind not in the table, the median of the job's GPUs of that kind (3 or more); a GPU that NVML says was held
    back by the site (the software power cap, application clocks, an enforced power limit below the default) is
    judged against that rate scaled to the SM clock it was allowed in that window, and noted, not condemned for
    the site's choice; a GPU slow at full clock is still condemned;
  - for a CPU node, the median of the job's nodes (3 nodes or more: two cannot say which one is slow), rates per
    CPU-second of the measuring thread; the batch host's noise also counts the in-job driver's own share of
    that host's CPUs (`batch_load`);
  a node below CLEAR x that line is clearly slow; one between is borderline: with `retest` it is not failed but
  listed in `HealthVerdict.retest`, the driver measures it again, and the merged samples (`merge_remeasured`) are
  judged once more, where only a node that is slow again fails;
* its best ring link is below `net_ratio` x the median node's best link (3 nodes or more). A node's best link
  is the faster of its two ring pairs: a healthy node next to a slow one still has one good pair, the slow node
  has none.
The all-reduce's bus bandwidth is reported; under `min_busbw_gbps` (when set) it is a note, and with the pairs
unable to tell which node is slow, only a note: no node is blamed without evidence against it.
"""

from __future__ import annotations

import copy
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
# Reasons that mean the site held the clock (a choice, not a fault): the GPU is judged at the clock it had.
HELD_CLOCK_EVENTS = {0x2: "application clocks", 0x4: "software power cap"}
MAX_NOISE = 0.5  # the line never drops below half the reference: a node at a quarter of it is slow, however noisy
CLEAR = 0.75  # below CLEAR x the line a node is clearly slow (no second measurement); between, borderline


@dataclasses.dataclass(frozen=True)
class HealthVerdict:
    """The health step's outcome: failed hosts with why, notes, each host's figures for the summary, and the
    borderline hosts to measure again (only with judge(retest=True)), with why."""

    failed: dict[str, str]
    notes: tuple[str, ...] = ()
    figures: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    retest: dict[str, str] = dataclasses.field(default_factory=dict)

    def healthy(self, hosts: list[str]) -> list[str]:
        return [h for h in hosts if h not in self.failed]


@dataclasses.dataclass(frozen=True)
class Score:
    """One device's compute against its reference: `rate` in its best window, `expected` the reference at that
    window (clock-scaled for a GPU the site held back), `noise` the windows' spread that lowers the line."""

    host: str
    what: str  # "CPU" | "GPU 0 (NVIDIA H200)"
    label: str  # "CPU matmul" | "bf16 matmul"
    unit: str
    rate: float
    expected: float
    basis: str  # what `expected` is, for the message
    noise: float
    held: str = ""  # why the GPU's clock was below its maximum in the best window, when the site held it
    full: float = 0.0  # the reference at full clock (a held GPU's `expected` is below it)

    def factor(self, ratio: float) -> float:
        return round(min(ratio, 1.0 - self.noise), 3)

    def zone(self, ratio: float) -> str:
        """"ok", "borderline" or "slow"."""
        line = self.factor(ratio) * self.expected
        return "ok" if self.rate >= line else "slow" if self.rate < CLEAR * line else "borderline"

    def message(self, ratio: float) -> str:
        digits = 1 if self.unit == "GFLOPS" else 0
        f = self.factor(ratio)
        out = f"{self.label} {self.rate:.{digits}f} {self.unit} < {f:g} x {self.basis}"
        return out + (f" ({ratio:g} less the windows' noise {self.noise:.2f})" if f < ratio else "")


def with_injected_borderline(verdict: HealthVerdict, inject: str) -> HealthVerdict:
    """Tests: the hosts that HPCTRAIN_HEALTH_INJECT names in "borderline:host=H" entries are measured again as if
    their first round had been borderline (a failed host stays failed). A real borderline needs a rate between
    two lines that move with each node's noise; this makes the driver's second step run on the cluster at will."""
    hosts = [kw.get("host", "") for kind, kw in (_entry(p) for p in inject.split(";") if p.strip())
             if kind == "borderline"]
    extra = {h: "injected (HPCTRAIN_HEALTH_INJECT)" for h in hosts if h and h not in verdict.failed}
    return dataclasses.replace(verdict, retest={**extra, **verdict.retest}) if extra else verdict


def _entry(item: str) -> tuple[str, dict[str, str]]:
    """One HPCTRAIN_HEALTH_INJECT entry, "kind:k=v,k=v", as (kind, {k: v}) (the node parses the same form)."""
    kind, _, args = item.strip().partition(":")
    return kind, dict(a.split("=", 1) for a in args.split(",") if "=" in a)


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


def spread(samples: list[float]) -> float:
    """(best - median) / best of a node's windows, 0 for one (hpctrain.node.launch.health reports the same figure; the
    judge computes it again from the samples, so that a merged re-measurement counts)."""
    if len(samples) < 2 or max(samples) <= 0:
        return 0.0
    return (max(samples) - statistics.median(samples)) / max(samples)


def judge(reports: dict[str, dict[str, Any] | None], *, matmul_ratio: float = 0.8, net_ratio: float = 0.5,
          min_busbw_gbps: float = 0.0, retest: bool = False, batch_host: str | None = None,
          batch_load: float = 0.0) -> HealthVerdict:
    """Which hosts fail, and why (see the module docstring). Pure. With `retest`, a borderline host that was
    not measured again yet is listed in `retest` instead of failed; `batch_load` is the in-job driver's share
    of `batch_host`'s CPUs during the check."""
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
    again: dict[str, str] = {}
    scores = _gpu_scores(ok, failed, figures) + _cpu_scores(ok, figures, batch_host, batch_load)
    for s in scores:
        _decide(s, ok[s.host], matmul_ratio, retest, failed, again, notes)
    _remeasured_notes(ok, failed, figures, notes)
    _judge_network(ok, net_ratio, min_busbw_gbps, failed, notes, figures)
    return HealthVerdict(failed, tuple(notes), figures, {h: w for h, w in again.items() if h not in failed})


def _decide(s: Score, rec: dict[str, Any], ratio: float, retest: bool, failed: dict[str, str],
            again: dict[str, str], notes: list[str]) -> None:
    """One score's outcome: pass (noted when only the clock the site allowed made it pass), borderline (to
    measure again, with `retest`, once) or failed (slow, or borderline again after its second measurement)."""
    zone, prefix = s.zone(ratio), "" if s.what == "CPU" else f"{s.what}: "
    second = rec.get("remeasured")
    if zone == "ok":
        if s.held and s.rate < s.factor(ratio) * s.full:
            notes.append(f"{s.host}: {prefix}{s.rate:.0f} {s.unit}, below {s.factor(ratio):g} x {s.full:.0f} at full "
                         f"clock, but the clock was held back ({s.held}): judged against {s.basis}, passed")
        return
    if zone == "borderline" and retest and second is None:
        again[s.host] = f"{prefix}{s.message(ratio)}"
        return
    if isinstance(second, dict):
        failed.setdefault(s.host, f"{prefix}{s.message(ratio)}; slow again when measured again" + (
            f" (the second measurement failed: {second['error']})" if second.get("error") else ""))
        return
    failed.setdefault(s.host, f"{prefix}{s.message(ratio)}")


def _remeasured_notes(ok: dict[str, dict[str, Any]], failed: dict[str, str], figures: dict[str, dict[str, Any]],
                      notes: list[str]) -> None:
    """One note per host measured again (a borderline first round): what it was, and that it passed now."""
    for h, rec in ok.items():
        second = rec.get("remeasured")
        if not isinstance(second, dict):
            continue
        figures.setdefault(h, {})["remeasured"] = {k: v for k, v in second.items() if k in ("why", "windows", "error")}
        if h not in failed:
            best = figures[h].get("cpu_gflops") or figures[h].get("gpu_tflops")
            notes.append(f"{h}: borderline at first ({second.get('why', '')}); measured again "
                         f"({second.get('windows', 0)} more windows): passed, best {best}")


def _stage(rec: dict[str, Any]) -> str:
    return "the network test" if "device" in rec else "its start"


def _rates(part: dict[str, Any], key: str) -> list[float]:
    """A device's window rates: its samples, or the one rate of a report without them."""
    samples = [float(x) for x in part.get("samples") or () if x is not None]
    if samples:
        return samples
    return [float(part[key])] if part.get(key) is not None else []


def _cpu_scores(ok: dict[str, dict[str, Any]], figures: dict[str, dict[str, Any]], batch_host: str | None,
                batch_load: float) -> list[Score]:
    rates = {h: _rates(r["cpu"], "gflops") for h, r in ok.items() if isinstance(r.get("cpu"), dict)}
    rates = {h: v for h, v in rates.items() if v and max(v) > 0}
    for h, v in rates.items():
        figures.setdefault(h, {}).update(cpu_gflops=max(v), cpu_samples=v)
    if len(rates) < 3:
        return []
    med = statistics.median(max(v) for v in rates.values())
    typical = statistics.median(spread(v) for v in rates.values())
    out = []
    for h, v in rates.items():
        load = batch_load if h == batch_host else 0.0
        noise = min(MAX_NOISE, max(spread(v), typical) + max(0.0, load))
        figures[h]["cpu_noise"] = round(noise, 3)
        out.append(Score(h, "CPU", "CPU matmul", "GFLOPS", max(v), med, f"the nodes' median {med:.1f}", noise,
                         full=med))
    return out


def _gpu_scores(ok: dict[str, dict[str, Any]], failed: dict[str, str],
                figures: dict[str, dict[str, Any]]) -> list[Score]:
    gpus = [(h, g) for h, r in ok.items() for g in r.get("gpus") or ()]
    by_kind: dict[str, list[float]] = {}
    for _, g in gpus:
        if _rates(g, "tflops"):
            by_kind.setdefault(str(g.get("name", "")), []).append(max(_rates(g, "tflops")))
    out = []
    for h, g in gpus:
        v = _rates(g, "tflops")
        figures.setdefault(h, {}).setdefault("gpu_tflops", []).append(max(v) if v else None)
        what = f"GPU {g.get('index')} ({g.get('name', '?')})"
        why = list(nvml_problems(g.get("nvml") or {})) + ([str(g["error"])] if g.get("error") else [])
        if not v and not why:
            why.append("no matmul rate")
        if why:
            failed.setdefault(h, f"{what}: {'; '.join(why)}")
            continue
        name = str(g.get("name", ""))
        ref, basis = expected_tflops(name), "its kind's measured rate"
        if ref is None and len(by_kind.get(name, [])) >= 3:
            ref, basis = statistics.median(by_kind[name]), "the job's median"
        if ref is not None:
            out.append(_gpu_score(h, what, g, v, ref, basis))
    return out


def _gpu_score(host: str, what: str, g: dict[str, Any], rates: list[float], ref: float, basis: str) -> Score:
    """The GPU's best window against `ref` scaled to the clock the site allowed in that window."""
    best_i = max(range(len(rates)), key=lambda i: rates[i] / (ref * allowed_clock(g, i)[0]))
    frac, held = allowed_clock(g, best_i)
    text = f"{basis} {ref:.0f}"
    if held:
        nv = g.get("nvml") or {}
        text += (f" at the {_clock(g, best_i):.0f} of {float(nv['sm_max_mhz']):.0f} MHz it was allowed "
                 f"({ref * frac:.0f})")
    return Score(host, what, "bf16 matmul", "TFLOPS", rates[best_i], ref * frac, text, min(MAX_NOISE, spread(rates)),
                 held, ref)


def _clock(g: dict[str, Any], i: int) -> float | None:
    clocks = g.get("sm_mhz")
    if isinstance(clocks, list):
        return float(clocks[i]) if i < len(clocks) and clocks[i] else None
    c = (g.get("nvml") or {}).get("sm_mhz")
    return float(c) if c else None


def allowed_clock(g: dict[str, Any], i: int) -> tuple[float, str]:
    """The fraction of its maximum SM clock a GPU was allowed in window `i`, and by what, when the site held it
    (the software power cap, application clocks, an enforced power limit below the default); (1.0, "") when
    it was not held or NVML did not say. Pure."""
    nv = g.get("nvml") or {}
    events = g.get("clock_events")
    mask = int(events[i] or 0) if isinstance(events, list) and i < len(events) else int(
        nv.get("clock_events_during") or 0)
    held = [name for bit, name in HELD_CLOCK_EVENTS.items() if mask & bit]
    limit, default = nv.get("power_limit_w"), nv.get("power_default_w")
    if limit is not None and default is not None and float(limit) < float(default):
        held.append(f"power limit {float(limit):.0f} of {float(default):.0f} W")
    sm, top = _clock(g, i), nv.get("sm_max_mhz")
    if not held or not sm or not top or sm >= float(top):
        return 1.0, ""
    return sm / float(top), ", ".join(held)


def merge_remeasured(first: dict[str, dict[str, Any] | None], again: dict[str, dict[str, Any] | None],
                     why: dict[str, str]) -> dict[str, dict[str, Any] | None]:
    """The first round's reports with the second round's windows of the re-measured hosts added (`why`: each
    one's borderline reason); each merged report says it was measured again (`remeasured`). Pure."""
    out = dict(first)
    for h, reason in why.items():
        rec, rec2 = first.get(h), again.get(h)
        if rec is None:
            continue
        merged = copy.deepcopy(rec)
        if rec2 is None or not rec2.get("done") or rec2.get("error"):
            err = "no report" if rec2 is None or not rec2.get("done") else str(rec2["error"])
            merged["remeasured"] = {"why": reason, "error": err}
            out[h] = merged
            continue
        if isinstance(merged.get("cpu"), dict) and isinstance(rec2.get("cpu"), dict):
            _add_samples(merged["cpu"], rec2["cpu"], "gflops", ("samples", "wall_samples"))
        two = {g.get("index"): g for g in rec2.get("gpus") or ()}
        for g in merged.get("gpus") or ():
            if g.get("index") in two:
                g2 = two[g["index"]]
                _add_samples(g, g2, "tflops", ("samples", "sm_mhz", "clock_events"))
                if g2.get("error"):
                    g["error"] = g2["error"]
                nv = g.setdefault("nvml", {})
                nv["clock_events_during"] = int(nv.get("clock_events_during") or 0) | int(
                    (g2.get("nvml") or {}).get("clock_events_during") or 0)
        merged["remeasured"] = {"why": reason, "windows": len(_samples_of(rec2))}
        out[h] = merged
    return out


def _add_samples(into: dict[str, Any], more: dict[str, Any], key: str, lists: tuple[str, ...]) -> None:
    first = _rates(into, key)
    for name in lists:
        base = list(into.get(name) or ([] if name != "samples" else first))
        base += [None] * (len(first) - len(base))  # one entry per window, so the lists stay aligned
        into[name] = base + list(more.get(name) or ())
    rates = _rates(into, key)
    if rates:
        into[key] = max(rates)


def _samples_of(rec: dict[str, Any]) -> list[float]:
    if isinstance(rec.get("cpu"), dict):
        return _rates(rec["cpu"], "gflops")
    return next((_rates(g, "tflops") for g in rec.get("gpus") or ()), [])


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
