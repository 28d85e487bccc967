"""The run folder's typed records of what was decided about the ranks, beside hpctrain.runs.events.Event (what
the ranks themselves say): one dataclass per record, written and read here only.

`WatchdogVerdict`: one line of metrics/watchdog.jsonl. Its writers are the hang watchdog of the batch script
(`hang`, `peer_lost`: hpctrain.fault.watchdog) and the in-job driver (`unhealthy`: nodes that failed the health
check, `straggler`: a persistent straggler, and a verdict it acted on, marked `in_job`: hpctrain.fault.injob);
its readers the driver, the supervisor's retry decision and the collector's summary. Lines written before
this module (plain dicts with the same keys) load unchanged; keys a writer added beyond the typed fields
(`stale_s`, `timeout_s`, `detected_s`, `in_job`, ...) travel in `extra`.

Stdlib only, like runs.events: the node side and the login side both import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
