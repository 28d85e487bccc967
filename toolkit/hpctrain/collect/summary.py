"""One summary per run: registry + sacct + run folder (attempts, logs, metrics) -> summary.json.

`summarize(refs)` is what `hpctrain summary` runs: it refreshes every unfinished SLURM attempt in
view with ONE sacct call (`cli_runs.refresh`, which also caches final states in the registry), then
builds each run's record from what its folder still holds. A finished run whose summary.json is
already final is read back, not rebuilt, so old runs cost a file read. Missing pieces (sacct down,
a vanished folder, a torn metrics line) become warnings in the record, never exceptions.

Stdlib only at module level; the pieces live in collect_classify / collect_logs / collect_metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.collect import logs as cl
from hpctrain.collect import metrics as cm
from hpctrain.collect import stragglers
from hpctrain.collect.files import (
    attempt_files,
    log_span,
    rank_hosts,
    rel,
    submitit_to_last_run,
    text_of,
)
from hpctrain.runs import events as run_events
from hpctrain.runs import history, journal
from hpctrain.runs.folder import RunFolder
from hpctrain.runs.history import hosts_of
from hpctrain.states import RUN_ENDED_STATES as ENDED
from hpctrain.states import FailureClass, JobState, is_final

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.runs.registry import Attempt, Registry, Run

SCHEMA_VERSION = 1


def _collector_version() -> str:
    """A hash of the collector's own source: a cached summary.json built by other code (an older
    classifier, other metrics rules) is rebuilt rather than trusted."""
    import hashlib

    h = hashlib.sha1()
    here = Path(__file__).parent
    for path in (*(here / n for n in ("summary.py", "classify.py", "metrics.py", "logs.py", "files.py")),
                 here.parent / "states.py", here.parent / "runs" / "events.py",
                 here.parent / "runs" / "history.py"):
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(path.name.encode())
    return f"collect-{h.hexdigest()[:12]}"


COLLECTOR = _collector_version()


@dataclass
class Shape:
    """How big each attempt is, from the registry's spec summary, else spec.toml/plan.json."""

    nodes: int = 1
    gpus_per_node: int = 0
    ranks_per_node: int = 1
    cpus_per_task: int = 1
    spare_nodes: int = 0  # allocated beside `nodes` (resources.spare_nodes): paid for, idle until one takes over


@dataclass
class RunInput:
    """Everything known about one run before its folder is read."""

    run_id: str
    folder: Path
    name: str = ""
    executor: str = ""
    state: str = JobState.UNKNOWN
    created: float | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    spec: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


# -- inputs -----------------------------------------------------------------------------------------
def from_registry(run: Run) -> RunInput:
    atts = [_attempt_dict(a) for a in run.attempts]
    return RunInput(run.run_id, Path(run.folder), run.name, run.executor, run.state, run.created, atts,
                    dict(run.spec))


def _attempt_dict(a: Attempt) -> dict[str, Any]:
    return {"attempt": a.attempt, "job_id": a.job_id, "state": a.state, "nodes": a.nodes, "submitted": a.submitted,
            "started": a.started, "ended": a.ended, "exit_code": a.exit_code, "failure_class": a.failure_class}


def from_folder(folder: Path) -> RunInput:
    """A run known only by its folder (not in this registry): attempts.jsonl is the record."""
    latest: dict[int, dict[str, Any]] = {}
    from hpctrain.runs.folder import read_attempts

    for rec in read_attempts(RunFolder(folder).attempts_jsonl):
        k = rec.get("attempt")
        if isinstance(k, int):
            latest.setdefault(k, {}).update({key: v for key, v in rec.items() if v not in (None, "")})
    atts = [latest[k] for k in sorted(latest)]
    executor = str(atts[0].get("executor", "")) if atts else ""
    state = str(atts[-1].get("state", JobState.UNKNOWN)) if atts else JobState.UNKNOWN
    return RunInput(folder.name, folder, folder.name, executor, state, None, atts)


def _shape(inp: RunInput) -> Shape:
    """From the registry's spec summary; spec.toml's [resources] fills what it lacks (cpus_per_task)."""
    s = inp.spec
    res = _resources(RunFolder(inp.folder).spec_toml, need_all=not all(k in s for k in ("nodes", "gpus_per_node",
                                                                                   "ranks_per_node")))
    return Shape(nodes=_int(s.get("nodes"), res.get("nodes"), default=1),
                 gpus_per_node=_int(s.get("gpus_per_node"), res.get("gpus_per_node"), default=0),
                 ranks_per_node=_int(s.get("ranks_per_node"), res.get("tasks_per_node"), default=1),
                 cpus_per_task=_int(res.get("cpus_per_task"), default=1),
                 spare_nodes=_int(s.get("spare_nodes"), res.get("spare_nodes"), default=0))


_RESOURCES = re.compile(r"^\[resources\]\s*$(.*?)(?=^\[|\Z)", re.MULTILINE | re.DOTALL)
_INT_KEY = re.compile(r"^(nodes|gpus_per_node|tasks_per_node|cpus_per_task|spare_nodes)\s*=\s*(\d+)\s*(?:#.*)?$",
                      re.MULTILINE)


def _resources(path: Path, need_all: bool) -> dict[str, Any]:
    """The integer keys of spec.toml's [resources]. A plain scan of the section (spec.toml is written
    by hpctrain in one layout) keeps `summary --all` cheap; full TOML parsing only when the scan
    finds nothing."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    m = _RESOURCES.search(text)
    found = {k: int(v) for k, v in _INT_KEY.findall(m.group(1))} if m else {}
    if found and (not need_all or len(found) >= 4):
        return found
    try:
        import tomllib

        return dict(tomllib.loads(text).get("resources", {}))
    except Exception:  # noqa: BLE001 - unreadable spec.toml: the registry's summary or defaults will do
        return found


def _int(*vals: Any, default: int) -> int:
    for v in vals:
        try:
            if v is not None and not isinstance(v, bool):
                return int(v)
        except (TypeError, ValueError):
            continue
    return default


# -- one attempt ------------------------------------------------------------------------------------
def _attempt_row(inp: RunInput, a: dict[str, Any], files: list[cl.LogFile], recs: list[dict[str, Any]],
                 earlier: list[dict[str, Any]], ckpts: list[int], shape: Shape, is_last: bool,
                 heartbeat: dict[str, Any] | None, now: float, evs: list[run_events.Event]) -> dict[str, Any]:
    # Imported here: its ~40 regexes cost more than reading a cached summary, the common case.
    from hpctrain.collect import classify as cc

    k = int(a["attempt"])
    state = str(a.get("state") or JobState.UNKNOWN)
    start, end = _float(a.get("started")), _float(a.get("ended"))
    m = cm.attempt_metrics(recs, earlier, ckpts)
    if start is None and m.first_time is not None:
        start = m.first_time - (m.step_interval_s or 0)
    if end is None and state in ENDED and m.last_time is not None:
        end = m.last_time
    elapsed = (end if end is not None else (now if state not in ENDED else None))
    elapsed_s = max(0.0, elapsed - start) if (elapsed is not None and start is not None) else None
    hosts = hosts_of(str(a.get("nodes") or ""))
    nodes = len(hosts) or shape.nodes
    # The cost counts the whole allocation: an idle spare is paid for like a training node.
    held = max(len(hosts_of(str(a.get("allocated") or ""))), nodes + shape.spare_nodes)
    gpu_h, cpu_h = cm.resource_hours(elapsed_s, held, shape.gpus_per_node, shape.ranks_per_node * shape.cpus_per_task)
    mine = [f for f in files if f.attempt == k]
    host_of = rank_hosts(mine, str(a.get("nodes") or ""), shape.ranks_per_node)
    # Each rank's own events name its host (SLURMD_NODENAME): truer than the block distribution guessed above.
    host_of.update({int(r): str(h) for r, h in (a.get("rank_hosts") or {}).items()})
    sources = [cc.LogSource(rel(f.path, inp.folder), text_of(f, a, start), f.rank,
                            host_of.get(f.rank) if f.rank is not None else None, str(a.get("job_id") or ""))
               for f in mine]
    beat = m.last_time
    if is_last and heartbeat and _float(heartbeat.get("time")):
        beat = max(beat or 0.0, float(heartbeat["time"]))
    hang_end = end if state in ENDED else now
    hang = state not in (JobState.COMPLETED, JobState.PENDING) and cc.is_hang(beat, hang_end, m.step_interval_s)
    hang_msg = (f"no step for {((hang_end or 0) - (beat or 0)) / 60:.0f} min before "
                f"{'the job ended' if state in ENDED else 'now'} (last step {m.last_step})") if hang else ""
    watch = journal.from_note(journal.HANG, a.get("hang"))  # the hang watchdog's verdict
    if watch and state in ENDED and state != JobState.COMPLETED:
        hang, hang_msg = True, watch.message or hang_msg
    # A running attempt is judged by its own events only: a job's shared logs (submitit's, untimed lines) still
    # hold what its earlier run said, and that failure belongs to the earlier run, never to its successor.
    failure = cc.classify(state if state in ENDED or hang else None, sources if state in ENDED or hang else [],
                          exit_code=a.get("exit_code"),
                          hang=hang, hang_message=hang_msg, hosts=hosts, events=evs, executor=inp.executor)
    lost = journal.from_note(journal.PEER_LOST, a.get("peer_lost"))
    # The watchdog cancelled it (or is cancelling it: its verdict comes first): a node died, not a person, and
    # the verdict is the one cause; the survivors' errors blame whichever peer each one talked to.
    if lost and state != JobState.COMPLETED:
        failure = _peer_lost_failure(lost, failure)
    in_job = a.get("_in_job_failure")
    if in_job:  # the in-job driver's verdict on its step (it read the same evidence, and the watchdog's)
        cls, msg, host = in_job
        failure = cc.Failure(cls, f"in-job restart: {msg}", host=host, source=run_events.EVENTS)
    if failure.failure_class == FailureClass.CANCELLED and not failure.message.startswith("cancelled by the user"):
        asked = RunFolder(inp.folder).cancel_request() or {}
        if str(a.get("job_id") or "") in {str(j) for j in asked.get("jobs") or []}:
            failure.message = f"cancelled by the user (hpctrain cancel); {failure.message}"
    if watch and failure.failure_class == FailureClass.HANG:
        silent, hosts_named = watch.silent_ranks, watch.silent_hosts
        failure.rank = silent[0] if len(silent) == 1 else failure.rank
        failure.host = hosts_named[0] if len(hosts_named) == 1 else failure.host
    return {
        "attempt": k, "job_id": str(a.get("job_id") or ""), "state": state, "exit_code": a.get("exit_code"),
        "failure_class": failure.failure_class, "failure": failure.to_dict() if failure.failure_class else None,
        "nodes": nodes, "hosts": hosts, "allocated_nodes": held, "how": str(a.get("how") or history.SUBMITTED),
        "spare_hours": round((gpu_h or cpu_h) * (held - nodes) / held, 6) if held else 0.0,
        **({"replaced": a["replaced"]} if a.get("replaced") else {}),
        "submitted": _float(a.get("submitted")), "start": start, "end": end,
        "elapsed_s": elapsed_s, "gpu_hours": round(gpu_h, 6), "cpu_hours": round(cpu_h, 6),
        **m.to_dict(), "logs": [s.name for s in sources],
        "excluded": [str(h) for h in a.get("excluded") or []],
        "resubmit": a.get("decision") if isinstance(a.get("decision"), dict) else None,
        **({"step_id": a["step_id"]} if a.get("step_id") else {}),
        **({"in_job_restart": a["in_job_restart"]} if a.get("in_job_restart") else {}),
        **({"health": a["health"]} if a.get("health") else {}),
    }


def _peer_lost_failure(lost: journal.WatchdogVerdict, found: Any) -> Any:
    """The watchdog's node verdict as the attempt's failure on the silent host: node_fail (a lost peer, a failed
    health check), or straggler (slow, not failed: never called a node failure)."""
    from hpctrain.collect import classify as cc

    hosts, ranks = lost.silent_hosts, lost.silent_ranks
    return cc.Failure(lost.failure_class, lost.message or "a peer's node went away",
                      rank=ranks[0] if len(ranks) == 1 else None, host=hosts[0] if len(hosts) == 1 else None,
                      source="metrics/watchdog.jsonl", exception=getattr(found, "exception", None))


def _with_fault_notes(folder: Path, atts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What hpctrain.fault.supervisor wrote to attempts.jsonl about each job (the --exclude it ran with, the
    watchdog's hang / peer-lost verdict, the retry decision), onto the job's last row (not a REQUEUED run
    of it). The watchdog's own file fills in a verdict no supervisor recorded (a run with retries 0). A verdict
    that names its attempt goes to that attempt's row: a failure is never shown on its successor (an in-job
    restart's running step)."""
    from hpctrain.runs.folder import read_attempts

    notes: dict[str, dict[str, Any]] = {}
    for rec in read_attempts(RunFolder(folder).attempts_jsonl):
        if rec.get("job_id") is not None:
            notes.setdefault(str(rec["job_id"]), {}).update(
                {k: rec[k] for k in ("excluded", "hang", "peer_lost", "decision") if rec.get(k) is not None})
    for verdict in journal.read_verdicts(folder):
        if verdict.job_id:
            note = notes.setdefault(verdict.job_id, {})
            if journal.HANG not in note and journal.PEER_LOST not in note:
                note[journal.note_key(verdict)] = verdict.to_json()
    if not notes:
        return atts
    rows = {(str(a.get("job_id")), int(a["attempt"])): i for i, a in enumerate(atts)}
    last_row = {str(a.get("job_id")): i for i, a in enumerate(atts)}
    out = [dict(a) for a in atts]
    for job, note in notes.items():
        for key, value in note.items():
            k = value.get("attempt") if key in ("hang", "peer_lost") and isinstance(value, dict) else None
            i = rows.get((job, k)) if isinstance(k, int) and (job, k) in rows else last_row.get(job)
            if i is not None:
                out[i][key] = value
    return out


def _with_health_checks(atts: list[dict[str, Any]], evs: list[run_events.Event]) -> list[dict[str, Any]]:
    """The health check a job ran before its first step (hpctrain.fault.injob's `health` event) onto the row
    of the attempt it opened: which nodes failed and why, and the spare that took each one's place."""
    checks = {(h.job_id, h.attempt): h for h in journal.health_checks(evs)}
    if not checks:
        return atts
    out = []
    for a in atts:
        h = checks.get((str(a.get("job_id") or ""), int(a["attempt"])))
        if h is None:
            out.append(a)
            continue
        out.append(dict(a, health={"step_id": h.step_id, "hosts": list(h.hosts), "failed": dict(h.failed),
                                   "replaced": dict(h.replaced), "train_hosts": list(h.train_hosts),
                                   "notes": list(h.notes), "elapsed_s": h.elapsed_s, "figures": dict(h.figures)}))
    return out


_WAITING = frozenset({JobState.PENDING, JobState.SUBMIT_UNKNOWN, JobState.SUBMIT_FAILED, JobState.REQUEUE_HOLD})


def _waiting(a: dict[str, Any]) -> bool:
    """Never started: queued (or never submitted) and no start time from sacct or from its own logs."""
    return str(a.get("state") or "") in _WAITING and _float(a.get("started")) is None


def _float(v: Any) -> float | None:
    try:
        return float(v) if v is not None and v != "" else None
    except (TypeError, ValueError):
        return None


# -- one run ----------------------------------------------------------------------------------------
def build_run(inp: RunInput, now: float | None = None) -> dict[str, Any]:
    """The summary record of one run (what summary.json holds)."""
    now = time.time() if now is None else now
    warnings = list(inp.warnings)
    folder_ok = inp.folder.is_dir()
    if not folder_ok:
        warnings.append(f"run folder {inp.folder} is missing (moved, deleted, or its filesystem is not "
                        "mounted here); showing what the registry knows")
    shape = _shape(inp)
    records, bad = cm.read_metrics(RunFolder(inp.folder).metrics_jsonl) if folder_ok else ([], 0)
    if bad:
        warnings.append(f"skipped {bad} unreadable line(s) in metrics/metrics.jsonl (cut mid-write?)")
    ckpts = cm.complete_checkpoints(RunFolder(inp.folder).checkpoints_dir) if folder_ok else []
    atts = sorted(inp.attempts, key=lambda a: int(a["attempt"]))
    files = attempt_files(inp.folder, atts) if folder_ok else []
    evs = run_events.read_events(inp.folder) if folder_ok else []
    atts = history.expand(atts, inp.folder, events=evs, logs={f.attempt for f in files if f.kind == "rank"},
                          span=lambda k: log_span([f for f in files if f.attempt == k and f.kind == "rank"]))
    atts = _with_fault_notes(inp.folder, atts) if folder_ok else atts
    atts = _with_health_checks(atts, evs)
    files = submitit_to_last_run(files, atts)
    # An attempt still waiting in the queue (a retry pending) has no metrics and no start: it is left out of
    # the split, so the previous attempt's steps, loss and lost steps stay on the previous attempt. An in-job
    # restart's step splits at its `_split` point (the restart's detection), exact where start times are not.
    ran = [i for i, a in enumerate(atts) if not _waiting(a)]
    got = cm.split_by_attempt(records, [_float(atts[i].get("_split", atts[i].get("started"))) for i in ran]) \
        if ran else []
    per: list[list[dict[str, Any]]] = [[] for _ in atts]
    for i, recs in zip(ran, got, strict=True):
        per[i] = recs
    heartbeat = _read_json(RunFolder(inp.folder).heartbeat) if folder_ok else None
    rows: list[dict[str, Any]] = []
    earlier: list[dict[str, Any]] = []
    for i, a in enumerate(atts):
        recs = per[i] if i < len(per) else []
        rows.append(_attempt_row(inp, a, files, recs, earlier, ckpts, shape, i == len(atts) - 1, heartbeat, now,
                                 run_events.of_attempt(evs, int(a["attempt"]), str(a.get("job_id") or ""))))
        earlier = earlier + recs
    _lost_from_redone_steps(rows)
    state = rows[-1]["state"] if rows else inp.state
    return {
        "schema_version": SCHEMA_VERSION, "collector": COLLECTOR, "run_id": inp.run_id, "name": inp.name,
        "folder": str(inp.folder),
        "folder_exists": folder_ok, "executor": inp.executor, "state": state,
        "failure_class": rows[-1]["failure_class"] if rows else None,
        "gpus_per_node": shape.gpus_per_node, "ranks_per_node": shape.ranks_per_node,
        "complete": bool(rows) and all(r["state"] in ENDED for r in rows),
        "updated": now, "attempts": rows, "totals": {**_totals(rows), **_eval_totals(records)}, "warnings": warnings,
        "stragglers": stragglers.of_run(inp.folder) if folder_ok else None,
        "waiting_because": (history.wait_reason(atts, inp.folder) or None) if folder_ok else None,
        **_data_report(evs),
    }


def _lost_from_redone_steps(rows: list[dict[str, Any]]) -> None:
    """Lost work from what happened, not from the existence of a checkpoint: an attempt that has a successor lost
    the steps the successor trained again (its last step - the successor's first step + 1; a user's script that
    never resumes redoes them all); a completed one lost none; the latest unfinished one has the steps since its
    last checkpoint at risk (`lost_from` says which). A "checkpointed: resumable" stop whose successor started over
    says so."""
    for i, row in enumerate(rows):
        if row["last_step"] is None:
            continue
        nxt = next((r for r in rows[i + 1:] if r["first_step"] is not None), None)
        if nxt is not None:
            row["lost_steps"] = max(0, row["last_step"] - nxt["first_step"] + 1)
            row["lost_from"] = "redone"
            f = row.get("failure")
            if f and nxt["first_step"] <= 1 and row["last_step"] > 1 and "(checkpointed: resumable)" in f["message"]:
                f["message"] = f["message"].replace(
                    "(checkpointed: resumable)", f"(checkpointed, but attempt {nxt['attempt']} started again from "
                    "step 1: the script does not resume; docs/scripts.md says how)")
        elif row["state"] == JobState.COMPLETED:
            row["lost_steps"], row["lost_from"] = 0, "completed"
        else:
            row["lost_from"] = "since_checkpoint"


def _data_report(evs: list[run_events.Event]) -> dict[str, Any]:
    """{"data": ...}: the SFT records' tally rank 0 wrote at its latest start (read, trained on, bad by reason;
    hpctrain.data.sft), or {} for a run without one."""
    reports = [e.extra for e in evs if e.kind == run_events.TRAIN and e.extra.get("event") == "data"]
    if not reports:
        return {}
    r = reports[-1]
    return {"data": {k: r.get(k) for k in ("format", "source", "records", "kept", "truncated", "bad", "first")}}


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    last = [r["last_step"] for r in rows if r["last_step"] is not None]
    losses = [r["last_loss"] for r in rows if r["last_loss"] is not None]
    return {
        "attempts": len(rows),
        "elapsed_s": sum(r["elapsed_s"] or 0.0 for r in rows),
        "gpu_hours": round(sum(r["gpu_hours"] for r in rows), 6),
        "cpu_hours": round(sum(r["cpu_hours"] for r in rows), 6),
        "last_step": max(last) if last else None,
        "steps_done": sum(r["steps_done"] for r in rows),
        "lost_steps": sum(r["lost_steps"] or 0 for r in rows),
        "last_loss": losses[-1] if losses else None,
    }


def _eval_totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The last and the best validation loss (metrics lines with eval_loss, [train] eval_every); {} if none."""
    evals = [r for r in records if isinstance(r.get("eval_loss"), (int, float))]
    if not evals:
        return {}
    last, best = evals[-1], min(evals, key=lambda r: float(r["eval_loss"]))
    return {"eval": {"last_step": last["step"], "last_loss": last["eval_loss"], "last_ppl": last.get("eval_ppl"),
                     "best_step": best["step"], "best_loss": best["eval_loss"], "best_ppl": best.get("eval_ppl")}}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def write_summary(record: dict[str, Any]) -> str | None:
    """summary.json in the run folder, replaced atomically; returns a warning instead of raising."""
    folder = Path(record["folder"])
    if not record.get("folder_exists"):
        return None
    tmp = folder / f".summary.json.tmp-{os.getpid()}"
    try:
        # Compact: json's C encoder is used only without indent, and --all writes a thousand of these.
        tmp.write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")
        os.replace(tmp, RunFolder(folder).summary_json)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return f"could not write {RunFolder(folder).summary_json}: {exc}"
    return None


def cached(inp: RunInput) -> dict[str, Any] | None:
    """A final summary.json that still matches the run's attempts: reused as is (old runs cost a
    file read, no log scan)."""
    if not inp.attempts or not all(is_final(str(a.get("state"))) for a in inp.attempts):
        return None
    old = _read_json(RunFolder(inp.folder).summary_json)
    if not old or not old.get("complete") or old.get("collector") != COLLECTOR:
        return None
    # Per job id, its final state (a requeued job has extra REQUEUED rows before its last one).
    want = {str(a.get("job_id")): str(a.get("state")) for a in inp.attempts}
    have = {str(r.get("job_id")): str(r.get("state")) for r in old.get("attempts", [])}
    return old if want == have else None


# -- many runs --------------------------------------------------------------------------------------
def resolve_refs(reg: Registry, refs: list[str], all_runs: bool) -> tuple[list[RunInput], list[str], list[str]]:
    """(runs in view, errors for refs that match nothing, warnings such as "sacct is down").

    A ref is what hpctrain.runs.resolve accepts (id, prefix, name, `last`, or a run folder path, also for
    runs this registry never saw). Unknown refs do not stop the others from being summarised.
    """
    from hpctrain.errors import HpcUsageError
    from hpctrain.runs.resolve import resolve_run

    errors: list[str] = []
    warnings: list[str] = []
    if all_runs or not refs:
        try:
            runs = reg.list_runs(limit=None if all_runs else 20)
        except Exception as exc:  # noqa: BLE001 - unreadable registry: nothing to list, say why
            return [], [f"cannot read the run registry {reg.path}: {exc}"], []
        return _inputs(reg, runs, warnings), errors, warnings
    found: list[Run] = []
    loose: list[RunInput] = []
    for ref in refs:
        try:
            got = resolve_run(reg, ref)
        except HpcUsageError as exc:
            errors.append(exc.format_message())
            continue
        except Exception as exc:  # noqa: BLE001 - any registry failure becomes the run's error line
            errors.append(f"RUN = {ref!r}: cannot read the run registry {reg.path}: {exc}")
            continue
        if got.run is None:
            loose.append(from_folder(got.folder.resolve()))
        else:
            found.append(got.run)
    return _inputs(reg, found, warnings) + loose, errors, warnings


def _inputs(reg: Registry, runs: list[Run], warnings: list[str]) -> list[RunInput]:
    """ONE sacct call for every unfinished SLURM attempt in view (the job-state refresh), and the
    registry keeps final states so the next refresh skips them."""
    try:
        from hpctrain.slurm.refresh import refresh

        warnings.extend(refresh(reg, runs))
    except Exception as exc:  # noqa: BLE001 - sacct missing, slurmdbd down, registry locked: stale states help
        warnings.append(f"states may be stale: {exc}")
    inputs = [from_registry(r) for r in runs]
    for inp in inputs:
        inp.warnings.extend(warnings)
    return inputs


def summarize(inputs: list[RunInput], *, write: bool = True, now: float | None = None) -> list[dict[str, Any]]:
    """Records for the runs in view; rebuilds only what is not cached, writes summary.json files."""
    out = []
    for inp in inputs:
        rec = cached(inp)
        if rec is None:
            rec = build_run(inp, now)
            if write:
                warn = write_summary(rec)
                if warn:
                    rec["warnings"].append(warn)
        out.append(rec)
    return out


def store_failure_classes(reg: Registry, records: list[dict[str, Any]]) -> None:
    """Put the failure class of finished attempts into the registry (for `status` and resubmit)."""
    updates = []
    for rec in records:
        known = {int(a["attempt"]): (str(a.get("state")), a.get("failure_class"))
                 for a in rec.pop("_registry_attempts", [])}
        for row in rec["attempts"]:
            state, old = known.get(row["attempt"], (None, None))
            # Only rows that ARE the registry's attempt (not a REQUEUED run of it), and only changes.
            if row["state"] == state and is_final(row["state"]) and row.get("failure_class") not in (None, old):
                updates.append((rec["run_id"], row["attempt"], {"failure_class": row["failure_class"]}))
    if updates:
        with contextlib.suppress(Exception):  # a locked or read-only registry must not cost the summary
            reg.update_attempts(updates)


def update_folder_summary(run_dir: Path | str, running: bool = False) -> None:
    """Rebuild RUN_DIR/summary.json from the folder alone (no registry, no sacct), for callers on the
    allocation that want the file to follow the run, e.g. the node's rank 0 after each checkpoint
    (`running=True` marks the latest unfinished attempt RUNNING). Never raises: a summary must not
    cost a training step."""
    with contextlib.suppress(Exception):  # best effort by contract
        inp = from_folder(Path(run_dir))
        if running and inp.attempts and not is_final(str(inp.attempts[-1].get("state"))):
            inp.attempts[-1]["state"] = JobState.RUNNING
        write_summary(build_run(inp))
