#!/usr/bin/env python
"""Goodput under failures: one training run on the local SLURM cluster, hit by injected faults.

    .venv/bin/python bench/goodput.py [--nodes 2] [--train-s 240] [--every-s 60] [--first-s S] [--ckpt-steps 40]
                                      [--faults preempt,node-kill,requeue] [--spare-nodes K] [--out FILE.json]

    # issue 19's campaign: one node loss or preemption per 10 minutes over 21 minutes of training, with a
    # spare (in-job restart) and without (resubmission through the queue), one after the other:
    .venv/bin/python bench/goodput.py --spare-nodes 1 --train-s 1260 --first-s 300 --every-s 600 \
        --faults node-kill,preempt --ckpt-steps 10 --timeout 2400 --out spare.json
    .venv/bin/python bench/goodput.py --spare-nodes 0 --train-s 1260 --first-s 300 --every-s 600 \
        --faults node-kill,preempt --ckpt-steps 10 --timeout 2400 --out resubmit.json
    .venv/bin/python bench/goodput.py --compare spare.json resubmit.json --queue-wait-s 0,600,3600

The run (tiny Llama, CPU ranks, 1 rank per node) is submitted with `hpctrain submit`; while it trains, a
fault is injected at --first-s seconds of training (default --every-s) and every --every-s after that,
cycling through --faults:
  preempt      `scancel --signal=USR2 JOB`  (what SLURM sends before a time limit or a preemption:
               every rank checkpoints, rank 0 requeues the job: same job id)
  node-kill    `slurm.sh kill-node N` on the last training node (every process killed, sockets closed: the
               survivors' gloo errors let the watchdog cancel the job and retry it as a new job without
               that node, or with --spare-nodes the in-job driver start a new srun step on the survivor
               and a spare; the node is restarted once the run moved on, or after 90 s)
  requeue      `scontrol requeue JOB` (a hard preemption: no checkpoint, the work since the last one is lost)
and the run finishes by itself. Reported, from metrics.jsonl and sacct:
  useful s     time of the steps on the final trajectory (each step's duration, last run of it)
  allocated s  the wall time of every run of the job (sacct -D: start..end of each record)
  goodput      useful / allocated
  per failure  lost steps, and the overhead (allocated - useful) it cost
  per fault    allocated time from the last step before it to the first step after it, plus the redone
               steps (lost steps x the median step time)
plus a projection to one failure per 10 minutes of training: 600 / (600 + startup + overhead per failure).
Allocated time is the jobs' wall time (sacct); node-time efficiency counts every allocated node, idle spares
too (useful s x training nodes / allocated node-s). The 1-CPU supervisor jobs are left out. An empty local
queue starts a resubmitted or requeued job at once; `--compare` adds a simulated queue wait W per pass through
the queue (each SLURM run of a job after the first) to the wall time: goodput(W) = useful / (wall + passes x W).
Leaves nothing running: the job is cancelled and every killed node restarted in `finally`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SLURM_SH = REPO / "tests" / "cluster" / "slurm.sh"
FAULTS = ("preempt", "node-kill", "requeue")


def sh(*argv: str, timeout: float = 60, check: bool = True) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: rc {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def metrics(run: Path) -> list[dict[str, Any]]:
    """The run's metrics records; a line cut mid-write is skipped (the collector's reader)."""
    from hpctrain.collect.metrics import read_metrics

    return list(read_metrics(run / "metrics" / "metrics.jsonl")[0])


def sacct_runs(job: str) -> list[dict[str, Any]]:
    """Every allocated record of the job (sacct -D): state, start, end (epoch s). A PENDING record (the job
    back in the queue after a requeue) holds no allocation and is left out; a job that lost a node under
    --no-kill shows a RESIZING record up to the node's removal and the rest after it."""
    out = []
    text = sh("sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State,Start,End,NodeList", timeout=30)
    for line in text.splitlines():
        state, start, end, nodes = (line.split("|") + ["", "", "", ""])[:4]

        def ts(x: str) -> float | None:
            try:
                return datetime.strptime(x, "%Y-%m-%dT%H:%M:%S").timestamp()
            except ValueError:
                return None

        if state.split()[0] != "PENDING":
            out.append({"state": state.split()[0], "start": ts(start), "end": ts(end), "nodes": nodes})
    return out


def union_s(records: list[dict[str, Any]], weight: Any = None) -> float:
    """Seconds covered by the records' [start, end] intervals, overlaps counted once (x weight(record), the
    node count, when given: the largest weight of the records covering each moment)."""
    edges = sorted({t for r in records if r["start"] for t in (r["start"], r["end"] or time.time())})
    total = 0.0
    for a, b in itertools.pairwise(edges):
        live = [r for r in records if r["start"] and r["start"] <= a and (r["end"] or time.time()) >= b]
        if live:
            total += (b - a) * (max(weight(r) for r in live) if weight else 1)
    return total


def run_jobs(run: Path) -> list[str]:
    """Every training job of the run, oldest first (the supervisor may have resubmitted it)."""
    jobs: list[str] = []
    for line in (run / "attempts.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("state") == "PENDING" and rec.get("job_id") and str(rec["job_id"]) not in jobs:
            jobs.append(str(rec["job_id"]))
    return jobs


def squeue_state(job: str) -> tuple[str, str]:
    out = sh("squeue", "-h", "-j", job, "-o", "%T|%N", check=False).strip()
    state, _, nodes = out.partition("|")
    return state, nodes


def events(run: Path) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def useful_time(recs: list[dict[str, Any]], starts: list[float]) -> tuple[float, list[int]]:
    """(seconds of the steps on the final trajectory, steps lost at each restart).

    Runs are split at the node's "start" events (a resume at the very step a checkpoint-on-signal
    stopped at does not show in the step numbers). A step's duration is its time minus the previous
    record's in the same run; the first step of a run counts the median step instead (its gap holds
    the start-up). The last run of a step wins; lost = steps reached minus the step resumed from."""
    runs: list[list[dict[str, Any]]] = [[] for _ in starts] or [[]]
    for r in recs:
        k = max([i for i, t in enumerate(starts) if t <= r["time"]], default=0)
        runs[k].append(r)
    runs = [x for x in runs if x]
    gaps = [b["time"] - a["time"] for run in runs for a, b in itertools.pairwise(run)]
    med = statistics.median(gaps) if gaps else 0.0
    dur: dict[int, float] = {}
    for run in runs:
        prev = None
        for r in run:
            dur[r["step"]] = (r["time"] - prev) if prev is not None else med
            prev = r["time"]
    lost = [a[-1]["step"] - (b[0]["step"] - 1) for a, b in itertools.pairwise(runs)]
    return sum(dur.values()), lost


def per_fault(recs: list[dict[str, Any]], starts: list[float], records: list[dict[str, Any]],
              lost: list[int]) -> list[tuple[float, float]]:
    """(allocated s between the last step before a restart and the first step after it, redone s) per restart."""
    times = sorted(r["time"] for r in recs)
    gaps = [b - a for a, b in itertools.pairwise(times) if b - a < 5]
    med = statistics.median(gaps) if gaps else 0.0
    out = []
    for k, t0 in enumerate(starts[1:]):
        before = max((t for t in times if t < t0), default=t0)
        after = min((t for t in times if t >= t0), default=t0)
        alloc = sum(max(0.0, min(after, r["end"] or after) - max(before, r["start"])) for r in records if r["start"])
        out.append((alloc, (lost[k] if k < len(lost) else 0) * med))
    return out


def node_count(nodes: str) -> int:
    return len(sh("scontrol", "show", "hostnames", nodes, check=False).split()) if nodes else 0


def spans(samples: list[tuple[float, str, str]]) -> list[dict[str, Any]]:
    """The allocation as this script saw it, polling squeue about once a second: each stretch of RUNNING or
    COMPLETING samples with the same nodes is one record (start = its first sample, end = the first sample
    after it). sacct's records of a job that was resized (a node lost under --no-kill) and then requeued are not
    usable (an end "Unknown", an elapsed time still growing after the job ended)."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for t, state, nodes in samples:
        live = state in ("RUNNING", "COMPLETING")
        if cur is not None and (not live or nodes != cur["nodes"]):
            cur["end"] = t
            out.append(cur)
            cur = None
        if live and cur is None:
            cur = {"state": state, "start": t, "end": None, "nodes": nodes}
    if cur is not None:
        cur["end"] = samples[-1][0]
        out.append(cur)
    return out


def analyze(run: Path, injected: list[dict[str, Any]], training_nodes: int = 0,
            samples: list[tuple[float, str, str]] | None = None) -> dict[str, Any]:
    """Print the goodput table of a finished run folder; return its figures. With the squeue `samples` of the
    campaign the allocation is taken from them, else from sacct (fine for jobs never resized)."""
    recs = metrics(run)
    starts = [e["time"] for e in events(run) if e.get("event") == "start"]
    useful, lost = useful_time(recs, starts)
    records = spans(samples) if samples else [r for j in run_jobs(run) for r in sacct_runs(j)]
    faults = per_fault(recs, starts, records, lost)
    alloc = union_s(records)
    counts = {r["nodes"]: node_count(r["nodes"]) for r in records}
    node_s = union_s(records, lambda r: counts[r["nodes"]])
    first = min(r["start"] for r in records if r["start"])
    startup = starts[0] - first if starts else 0.0
    restarts = max(1, len(starts) - 1)  # training starts after the first: in-job steps and new SLURM runs alike
    overhead = (alloc - useful - startup) / restarts
    proj = 600 / (600 + startup + overhead)
    kinds = ", ".join(i["kind"] for i in injected) or f"{restarts} restarts"
    print("\n| faults | final step | useful s | allocated s | goodput | startup s | overhead/restart s | lost steps |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {kinds} | {recs[-1]['step'] if recs else '-'} | {useful:.0f} | {alloc:.0f} | "
          f"{100 * useful / alloc:.1f}% | {startup:.0f} | {overhead:.0f} | {lost} |")
    print("\n| fault | at step | lost steps | allocated s, last step -> first step after | redone s | overhead s |")
    print("|---|---|---|---|---|---|")
    for k, (gap, redo) in enumerate(faults):
        kind = injected[k]["kind"] if k < len(injected) else "restart"
        at = injected[k]["at_step"] if k < len(injected) else "-"
        print(f"| {kind} | {at} | {lost[k] if k < len(lost) else '-'} | {gap:.1f} | {redo:.1f} | {gap + redo:.1f} |")
    print("\nallocation (job state start->end s):")
    for r in records:
        print(f"  {r['state']:10s} {r['nodes']:10s} {((r['end'] or time.time()) - r['start']):6.0f} s")
    print(f"projection, 1 restart per 10 min of training: goodput = 600 / (600 + {startup:.0f} + {overhead:.0f}) "
          f"= {100 * proj:.1f}%")
    wall = max((r["end"] or time.time()) for r in records if r["start"]) - first
    nodes = training_nodes or (int(recs[0].get("world_size", 0)) if recs else 0)
    eff = useful * nodes / node_s if node_s and nodes else None
    tl = restart_timeline(run)
    for t in tl:
        print(f"in-job restart {t['attempt']} -> {t['next_attempt']} ({t['class']}, replaced {t['replaced']}): "
              + ", ".join(f"{k} {t[k]}" for k in ("first_error", "stopped", "launched", "ranks_up", "resumed",
                                                   "first_step") if t.get(k) is not None) + " s from detection; "
              f"rank 0 start-up {t.get('startup')}")
    return {"run": str(run), "faults": injected, "final_step": recs[-1]["step"] if recs else None,
            "useful_s": round(useful, 1), "allocated_s": round(alloc, 1), "wall_s": round(wall, 1),
            "node_s": round(node_s, 1), "training_nodes": nodes, "goodput": round(useful / alloc, 4),
            "node_efficiency": round(eff, 4) if eff else None, "startup_s": round(startup, 1),
            "overhead_per_restart_s": round(overhead, 1), "lost_steps": lost,
            "per_fault": [{"kind": injected[k]["kind"] if k < len(injected) else "restart", "gap_s": round(g, 1),
                           "redone_s": round(r, 1)} for k, (g, r) in enumerate(faults)],
            "queue_passes": queue_passes(run), "slurm_runs": records, "restart_timeline": tl,
            "projection_10min": round(proj, 4)}


def queue_passes(run: Path) -> int:
    """How often the run went back through the queue: each start of the ranks after the first that was not an
    in-job restart (a requeue of the same job, or a resubmitted job)."""
    evs = events(run)
    starts = [e for e in evs if e.get("kind") == "start" and e.get("rank") == 0]
    in_job = [e for e in evs if e.get("kind") == "restart"]
    return max(0, len(starts) - 1 - len(in_job))


def restart_timeline(run: Path) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO / "toolkit"))
    from hpctrain.fault.injob import timeline

    return list(timeline(run))


def compare(paths: list[Path], waits: list[float]) -> None:
    """The campaign's table: each path's goodput, and its wall-clock goodput under a simulated queue wait."""
    rows = [json.loads(p.read_text()) for p in paths]
    head = " | ".join(f"wall goodput, queue wait {w:g} s" for w in waits)
    print(f"\n| path | faults | useful s | allocated s | goodput (allocated) | node-time efficiency | "
          f"queue passes | {head} |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(waits))
    for p, r in zip(paths, rows, strict=True):
        walls = " | ".join(f"{100 * r['useful_s'] / (r['wall_s'] + r['queue_passes'] * w):.1f}%" for w in waits)
        eff = f"{100 * r['node_efficiency']:.1f}%" if r.get("node_efficiency") else "-"
        kinds = ", ".join(f["kind"] for f in r["faults"])
        print(f"| {r.get('label', p.stem)} | {kinds} | {r['useful_s']:.0f} | {r['allocated_s']:.0f} | "
              f"{100 * r['goodput']:.1f}% | {eff} | {r['queue_passes']} | {walls} |")


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--train-s", type=float, default=240, help="fault-free training time to aim for")
    ap.add_argument("--every-s", type=float, default=60, help="a fault every this many seconds of training")
    ap.add_argument("--first-s", type=float, default=None, help="the first fault after this much training "
                    "(default: --every-s)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated cycle of {', '.join(FAULTS)}")
    ap.add_argument("--ckpt-steps", type=int, default=40)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--step-s", type=float, default=0.35, help="expected seconds per step (sizes --steps)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--spare-nodes", type=int, default=0, help="spare nodes (in-job restarts onto them)")
    ap.add_argument("--time", default=None, help="the job's time limit (default: 3 x --train-s + 10 min, so "
                    "that no time-limit requeue adds a fault of its own)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--analyze", type=Path, default=None, help="only print the table of this finished run folder")
    ap.add_argument("--compare", type=Path, nargs="+", default=None, help="print the table of these --out files")
    ap.add_argument("--queue-wait-s", default="0,600,3600", help="simulated queue waits for --compare")
    a = ap.parse_args()
    if a.compare:
        compare(a.compare, [float(w) for w in a.queue_wait_s.split(",") if w.strip()])
        return 0
    if a.analyze:
        analyze(a.analyze, [])
        return 0
    cycle = [f.strip() for f in a.faults.split(",") if f.strip()]
    bad = [f for f in cycle if f not in FAULTS]
    if bad or not cycle:
        ap.error(f"--faults {a.faults!r}: unknown fault(s) {', '.join(bad) or '(none given)'}; "
                 f"use a comma-separated list of {', '.join(FAULTS)}")
    first = a.every_s if a.first_s is None else a.first_s
    steps = int(a.train_s / a.step_s)
    root = Path(tempfile.mkdtemp(prefix="hpctrain-goodput-"))
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(root / "runs"), "HPCTRAIN_STATE_DIR": str(root / "state")}
    argv = [sys.executable, "-m", "hpctrain", "submit", str(REPO / "examples" / "tiny.toml"), "--executor", "slurm",
            "--partition", "debug", "--nodes", str(a.nodes), "--steps", str(steps), "--job-name", "goodput",
            "--set", "resources.tasks_per_node=1", "--set", f"data.seq_len={a.seq}",
            "--set", f"checkpoint.every_steps={a.ckpt_steps}", "--set", "checkpoint.export_hf=false",
            "--set", "train.min_lr=0.001", "--set", "train.warmup_steps=0", "--json",
            "--time", a.time or _hms(3 * a.train_s + 600),
            *(["--spare-nodes", str(a.spare_nodes)] if a.spare_nodes else [])]
    sub = json.loads(subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=True).stdout)[0]
    job, run = str(sub["job_id"]), Path(sub["run_dir"])
    print(f"run {run.name}: job {job}, {a.nodes} nodes, {steps} steps, checkpoint every {a.ckpt_steps} steps")
    killed: dict[str, tuple[float, str]] = {}  # host -> (when, the job it was killed under)
    injected: list[dict[str, Any]] = []
    samples: list[tuple[float, str, str]] = []  # (time, squeue state, nodes) of the run's latest job
    t0 = time.monotonic()
    try:
        trained = 0.0
        last_tick, last_steps = None, 0
        while time.monotonic() - t0 < a.timeout:
            job = run_jobs(run)[-1]
            state, nodes = squeue_state(job)
            samples.append((time.time(), state, nodes))
            recs = metrics(run)
            if not state and recs and recs[-1]["step"] >= steps:
                break
            if not state and '"done"' not in (run / "attempts.jsonl").read_text() and any(
                    '"stop"' in ln for ln in (run / "attempts.jsonl").read_text().splitlines()):
                print("the supervisor stopped the run", file=sys.stderr)
                break
            if recs and len(recs) != last_steps and state == "RUNNING":
                now = time.monotonic()
                if last_tick is not None:
                    trained += now - last_tick
                last_tick, last_steps = now, len(recs)
            elif state != "RUNNING":
                last_tick = None
            for n, (when, under) in sorted(killed.items()):  # bring a killed node back once the run moved on
                if job != under or time.monotonic() - when > 90:
                    sh("bash", str(SLURM_SH), "restart-node", n[4:], timeout=120)
                    del killed[n]
            if state == "RUNNING" and trained >= first + a.every_s * len(injected) and not killed:
                kind = cycle[len(injected) % len(cycle)]
                step = recs[-1]["step"] if recs else 0
                if kind == "preempt":
                    sh("scancel", "--signal=USR2", job)
                elif kind == "requeue":
                    sh("scontrol", "requeue", job)
                else:
                    # the last training host: never the batch host (it runs the in-job driver), never an idle spare
                    hostfile = run / "hostfile"
                    trained_on = [ln.split()[0] for ln in hostfile.read_text().splitlines() if ln.strip()] \
                        if hostfile.is_file() else []
                    host = (trained_on or sh("scontrol", "show", "hostnames", nodes).split())[-1]
                    sh("bash", str(SLURM_SH), "kill-node", host[4:], timeout=60)
                    killed[host] = (time.monotonic(), job)
                injected.append({"kind": kind, "at_step": step, "t": round(time.monotonic() - t0, 1)})
                print(f"  t={injected[-1]['t']:6.1f}s  {kind:9s} at step {step}", flush=True)
                last_tick = None
            time.sleep(1)
        else:
            print("timed out", file=sys.stderr)
    finally:
        for n in sorted(killed):
            sh("bash", str(SLURM_SH), "restart-node", n[4:], timeout=120, check=False)
        sh("scancel", *run_jobs(run), check=False)
        sup = [json.loads(x).get("supervisor_job") for x in (run / "attempts.jsonl").read_text().splitlines()]
        sh("scancel", *[s for s in sup if s], check=False) if any(sup) else None
    time.sleep(3)
    samples.append((time.time(), "", ""))
    res = analyze(run, injected, a.nodes, samples)
    res.update(label=f"{'spare ' + str(a.spare_nodes) if a.spare_nodes else 'resubmit'} ({a.nodes} nodes)",
               spare_nodes=a.spare_nodes, argv=sys.argv[1:])
    if a.out:
        a.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
