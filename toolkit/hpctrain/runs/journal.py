"""The run folder's typed records of what was decided about a run, beside hpctrain.runs.events.Event (what
the ranks themselves say): one dataclass per record, written and read here only.

`WatchdogVerdict`: one line of metrics/watchdog.jsonl. Its writers are the hang watchdog of the batch script
(`hang`, `peer_lost`: hpctrain.fault.watchdog) and the in-job driver (`unhealthy`: nodes that failed the health
check, `straggler`: a persistent straggler, and a verdict it acted on, marked `in_job`: hpctrain.fault.injob);
its readers the driver, the supervisor's retry decision and the collector's summary. Lines written before
this module (plain dicts with the same keys) load unchanged; keys a writer added beyond the typed fields
(`stale_s`, `timeout_s`, `detected_s`, `in_job`, ...) travel in `extra`.

`SupervisorDecision`: a decision line of attempts.jsonl, what followed an attempt (the supervisor's retry or stop,
or a person's `hpctrain resubmit`), with the verdict it acted on and the attempt it submitted; beside it the
notes saying which supervisor job was armed for which job (`write_armed`, `supervisors_of`). The attempt rows
of the same file are the submission's (hpctrain.slurm.dispatch, hpctrain.runs.history reads them).

Stdlib only, like runs.events: the node side and the login side both import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.runs.events import HEALTH, RESTART, Event
from hpctrain.runs.folder import RunFolder, append_attempt, iter_jsonl
from hpctrain.states import NODE_VERDICTS, FailureClass, class_of_verdict

HANG, PEER_LOST, UNHEALTHY, STRAGGLER = "hang", "peer_lost", "unhealthy", "straggler"
_TYPED = ("event", "time", "job_id", "attempt", "last_step", "silent_ranks", "silent_hosts", "message", "details")


@dataclass(frozen=True, kw_only=True)
class WatchdogVerdict:
    """A verdict on the ranks of one job: `event` is hang, peer_lost, unhealthy or straggler; `silent_hosts` the
    hosts it implicates (a retry excludes them; a node verdict replaces them with spares in the job),
    `silent_ranks` the ranks it names, `last_step` the last step every rank completed, `details` the evidence
    per rank, `message` the one line a person reads."""

    event: str
    time: float
    job_id: str = ""
    attempt: int | None = None
    last_step: int | None = None
    silent_ranks: tuple[int, ...] = ()
    silent_hosts: tuple[str, ...] = ()
    message: str = ""
    details: tuple[dict[str, Any], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def blames_nodes(self) -> bool:
        """A node verdict (peer_lost, unhealthy, straggler): the nodes, not the program (states.NODE_VERDICTS)."""
        return self.event in NODE_VERDICTS

    @property
    def failure_class(self) -> FailureClass:
        return class_of_verdict(self.event)

    def replace(self, **changes: Any) -> WatchdogVerdict:
        """A copy with fields changed; unknown names go into `extra` (e.g. in_job="the reason")."""
        typed = {k: v for k, v in changes.items() if k in _TYPED}
        extra = {k: v for k, v in changes.items() if k not in _TYPED}
        if "silent_hosts" in typed:
            typed["silent_hosts"] = tuple(typed["silent_hosts"])
        return dataclasses.replace(self, **typed, extra={**self.extra, **extra})

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object: the keys older readers know, with the same names and shapes (lists)."""
        return {**self.extra, "event": self.event, "time": self.time, "job_id": self.job_id, "attempt": self.attempt,
                "last_step": self.last_step, "silent_ranks": list(self.silent_ranks),
                "silent_hosts": list(self.silent_hosts), "message": self.message, "details": list(self.details)}

    def note(self) -> dict[str, Any]:
        """The copy the supervisor keeps with its decision in attempts.jsonl (read back with `from_note`)."""
        seen = self.to_json()
        return {k: seen[k] for k in ("event", "last_step", "silent_ranks", "silent_hosts", "stale_s", "detected_s",
                                     "message") if k in seen}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> WatchdogVerdict | None:
        """A line read back (also one written before this type existed); None when it is no verdict."""
        if not isinstance(obj.get("event"), str):
            return None
        try:
            return cls(event=obj["event"], time=float(obj.get("time") or 0.0), job_id=str(obj.get("job_id") or ""),
                       attempt=_int(obj.get("attempt")), last_step=_int(obj.get("last_step")),
                       silent_ranks=tuple(int(r) for r in obj.get("silent_ranks") or ()),
                       silent_hosts=tuple(str(h) for h in obj.get("silent_hosts") or ()),
                       message=str(obj.get("message") or ""),
                       details=tuple(d for d in obj.get("details") or () if isinstance(d, dict)),
                       extra={k: v for k, v in obj.items() if k not in _TYPED})
        except (TypeError, ValueError):
            return None  # a hand-edited or damaged line: not a verdict anyone can act on


def _int(v: Any) -> int | None:
    try:
        return None if v is None or isinstance(v, bool) else int(v)
    except (TypeError, ValueError):
        return None


def from_note(key: str, obj: Any) -> WatchdogVerdict | None:
    """A verdict as the supervisor copies it into attempts.jsonl under "hang" or "peer_lost" (every node verdict);
    notes written before they carried their `event` take it from `key`."""
    return WatchdogVerdict.from_json({"event": key, **obj}) if isinstance(obj, dict) else None


def note_key(verdict: WatchdogVerdict) -> str:
    """The attempts.jsonl key a verdict is copied under: "peer_lost" for a node verdict, else "hang"."""
    return PEER_LOST if verdict.blames_nodes else HANG


def write_verdict(run_dir: str | Path, verdict: WatchdogVerdict) -> None:
    """Append the verdict to the run's metrics/watchdog.jsonl (one write: concurrent writers' lines stay whole)."""
    append_attempt(RunFolder(run_dir).watchdog_jsonl, verdict.to_json())


def read_verdicts(run_dir: str | Path, job: str | None = None) -> list[WatchdogVerdict]:
    """The run's verdicts in the order written (only job `job`'s when given); torn or foreign lines skipped."""
    out = []
    for obj in iter_jsonl(RunFolder(run_dir).watchdog_jsonl):
        v = WatchdogVerdict.from_json(obj)
        if v is not None and (job is None or v.job_id == str(job)):
            out.append(v)
    return out


# -- attempts.jsonl: what followed an attempt ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SupervisorDecision:
    """One decision line of attempts.jsonl: what followed the attempt of job `job_id`. The supervisor's (`retry`,
    `stop`: hpctrain.fault.supervisor) or a person's (`manual`: `hpctrain resubmit`, hpctrain.fault.resubmit).
    `decision` is the retry policy's whole answer (hpctrain.fault.policy.Decision.to_dict(): action, reason,
    failure_class, exclude, added, not_excluded, notes, ...); `verdict` the watchdog's verdict it acted on; `next`
    the attempt it submitted ({attempt, job_id, supervisor})."""

    job_id: str
    decision: dict[str, Any]
    time: float | None = None
    attempt: int | None = None
    state: str | None = None
    failure_class: str | None = None
    checkpoint_step: int | None = None
    verdict: WatchdogVerdict | None = None
    next: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def action(self) -> str:
        return str(self.decision.get("action") or "")

    @property
    def reason(self) -> str:
        return str(self.decision.get("reason") or "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.extra, "job_id": self.job_id, "decision": self.decision}
        for k in ("time", "attempt", "state", "failure_class", "checkpoint_step", "next"):
            if getattr(self, k) is not None or k == "checkpoint_step":  # checkpoint_step None: none yet, said
                out[k] = getattr(self, k)
        if self.verdict is not None:
            out[note_key(self.verdict)] = self.verdict.note()
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SupervisorDecision | None:
        """A decision line read back (every line of attempts.jsonl that carries a `decision`), else None."""
        if not isinstance(obj.get("decision"), dict) or obj.get("job_id") is None:
            return None
        verdict = from_note(HANG, obj.get(HANG)) or from_note(PEER_LOST, obj.get(PEER_LOST))
        known = {"job_id", "decision", "time", "attempt", "state", "failure_class", "checkpoint_step", "next", HANG,
                 PEER_LOST}
        return cls(job_id=str(obj["job_id"]), decision=dict(obj["decision"]), time=_float(obj.get("time")),
                   attempt=_int(obj.get("attempt")), state=_str(obj.get("state")),
                   failure_class=_str(obj.get("failure_class")), checkpoint_step=_int(obj.get("checkpoint_step")),
                   verdict=verdict, next=obj["next"] if isinstance(obj.get("next"), dict) else None,
                   extra={k: v for k, v in obj.items() if k not in known})


def _float(v: Any) -> float | None:
    try:
        return None if v is None or isinstance(v, bool) else float(v)
    except (TypeError, ValueError):
        return None


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


def write_decision(run_dir: str | Path, decision: SupervisorDecision) -> None:
    RunFolder(run_dir).append_attempt(decision.to_json())


def decisions(run_dir: str | Path, job: str | None = None) -> list[SupervisorDecision]:
    """The decision lines of the run's attempts.jsonl in the order written (only those about job `job`)."""
    out = []
    for obj in iter_jsonl(RunFolder(run_dir).attempts_jsonl):
        d = SupervisorDecision.from_json(obj)
        if d is not None and (job is None or d.job_id == str(job)):
            out.append(d)
    return out


def write_armed(run_dir: str | Path, supervisor_job: str, job: str, when: float) -> None:
    """attempts.jsonl: supervisor job `supervisor_job` decides what follows job `job` once it ends."""
    RunFolder(run_dir).append_attempt({"supervisor_job": supervisor_job, "supervises": job, "time": when})


def supervisors_of(run_dir: str | Path, job: str) -> list[str]:
    """The supervisor jobs armed for job `job` (write_armed), oldest first."""
    return [str(r["supervisor_job"]) for r in iter_jsonl(RunFolder(run_dir).attempts_jsonl)
            if r.get("supervises") is not None and str(r["supervises"]) == str(job) and r.get("supervisor_job")]


# -- events.jsonl: what the in-job driver did --------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class InJobRestart:
    """One in-job restart (hpctrain.fault.injob), an events.jsonl line of kind `restart`: srun step `step_id` of
    attempt `attempt` ended (`failure_class`, `message`; detected, stopped, its first rank error), and step
    `next_step_id` began as attempt `next_attempt` on `hosts` (launched), a spare replacing each key of
    `replaced`; restart `restart` of `budget`, in a job that holds `job_hosts`."""

    time: float
    job_id: str
    attempt: int
    host: str = ""  # the first host a spare replaced ("" for a restart in place)
    failure_class: str | None = None
    message: str = ""
    step_id: str = ""
    step_hosts: tuple[str, ...] = ()
    next_step_id: str = ""
    next_attempt: int = -1
    hosts: tuple[str, ...] = ()
    replaced: dict[str, str] = field(default_factory=dict)
    restart: int = 0
    budget: int = 0
    detected: float | None = None
    stopped: float | None = None
    first_error: float | None = None
    job_hosts: tuple[str, ...] = ()
    launched: float | None = None

    def to_event(self) -> Event:
        extra = {"step_id": self.step_id, "step_hosts": list(self.step_hosts), "next_step_id": self.next_step_id,
                 "next_attempt": self.next_attempt, "replaced": dict(self.replaced), "hosts": list(self.hosts),
                 "restart": self.restart, "budget": self.budget, "detected": self.detected, "stopped": self.stopped,
                 "first_error": self.first_error, "job_hosts": list(self.job_hosts), "launched": self.launched}
        return Event(kind=RESTART, time=self.time, host=self.host, job_id=self.job_id, attempt=self.attempt,
                     failure_class=self.failure_class, message=self.message, extra=extra)

    @classmethod
    def of_event(cls, e: Event) -> InJobRestart | None:
        if e.kind != RESTART or e.attempt is None:
            return None
        x = e.extra
        return cls(time=e.time, job_id=e.job_id, attempt=e.attempt, host=e.host, failure_class=e.failure_class,
                   message=e.message, step_id=str(x.get("step_id") or ""), step_hosts=_strs(x.get("step_hosts")),
                   next_step_id=str(x.get("next_step_id") or ""), next_attempt=_or(_int(x.get("next_attempt")), -1),
                   hosts=_strs(x.get("hosts")),
                   replaced={str(k): str(v) for k, v in (x.get("replaced") or {}).items()},
                   restart=_or(_int(x.get("restart")), 0), budget=_or(_int(x.get("budget")), 0),
                   detected=_float(x.get("detected")), stopped=_float(x.get("stopped")),
                   first_error=_float(x.get("first_error")), job_hosts=_strs(x.get("job_hosts")),
                   launched=_float(x.get("launched")))


@dataclass(frozen=True, kw_only=True)
class HealthCheck:
    """The in-job driver's health check before a job's first step (hpctrain.fault.health's HealthVerdict), an
    events.jsonl line of kind `health`: the nodes tested (`hosts`), those that failed and why, the spare that
    took each one's place, the nodes chosen to train, notes, each node's figures, the nodes measured twice."""

    time: float
    job_id: str
    attempt: int
    step_id: str = ""
    hosts: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    train_hosts: tuple[str, ...] = ()
    replaced: dict[str, str] = field(default_factory=dict)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    remeasured: tuple[str, ...] = ()
    elapsed_s: float | None = None
    driver: dict[str, Any] | None = None  # the driver's own load on the batch host

    def to_event(self) -> Event:
        extra: dict[str, Any] = {"step_id": self.step_id, "hosts": list(self.hosts), "failed": dict(self.failed),
                                 "notes": list(self.notes), "train_hosts": list(self.train_hosts),
                                 "replaced": dict(self.replaced), "figures": self.figures,
                                 "remeasured": list(self.remeasured), "elapsed_s": self.elapsed_s}
        if self.driver:
            extra["driver"] = self.driver
        return Event(kind=HEALTH, time=self.time, job_id=self.job_id, attempt=self.attempt,
                     message="; ".join(f"{h}: {w}" for h, w in sorted(self.failed.items())), extra=extra)

    @classmethod
    def of_event(cls, e: Event) -> HealthCheck | None:
        if e.kind != HEALTH or e.attempt is None:
            return None
        x = e.extra
        return cls(time=e.time, job_id=e.job_id, attempt=e.attempt, step_id=str(x.get("step_id") or ""),
                   hosts=_strs(x.get("hosts")), failed={str(k): str(v) for k, v in (x.get("failed") or {}).items()},
                   notes=_strs(x.get("notes")), train_hosts=_strs(x.get("train_hosts")),
                   replaced={str(k): str(v) for k, v in (x.get("replaced") or {}).items()},
                   figures=dict(x.get("figures") or {}), remeasured=_strs(x.get("remeasured")),
                   elapsed_s=_float(x.get("elapsed_s")),
                   driver=x["driver"] if isinstance(x.get("driver"), dict) else None)


def _or(v: int | None, default: int) -> int:
    return default if v is None else v


def _strs(v: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in v) if isinstance(v, (list, tuple)) else ()


def restarts(evs: list[Event]) -> list[InJobRestart]:
    """The in-job restarts among a run's events (hpctrain.runs.events.read_events), in order."""
    return [r for r in map(InJobRestart.of_event, evs) if r is not None]


def health_checks(evs: list[Event]) -> list[HealthCheck]:
    """The health checks among a run's events, in order."""
    return [h for h in map(HealthCheck.of_event, evs) if h is not None]
