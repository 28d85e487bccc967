"""The run folder's events.jsonl: what the ranks say happened, one JSON object per line.

Kinds: `start` (rank 0, once per attempt), `train` (rank 0's training milestones, the record under `event`: start with
the resume point and layout, stopped-on-signal, finished with the eval), `stop` (a rank stopped on SLURM's pre-timeout
or preemption signal after a checkpoint), `failure` (a rank failed: its failure class, exception, exit code), `restart`
(the in-job driver ended a step and started the next one in the same job). Every line carries time, kind, rank, host,
job_id and attempt (K of logs/attempt-K.rank-R.log), so the collector
classifies an attempt from its events even when the rank logs are gone; the logs' regexes remain for text
that other programs print (OOM killer, NCCL, gloo, container runtimes).

Writers are many ranks on many hosts at once: each line is ONE write() on an O_APPEND descriptor (whole
lines, never interleaved on a local or a POSIX-conforming shared filesystem), kept short (long texts are
cut), and a torn last line (a rank killed mid-write) is skipped by the reader.

Stdlib only: every rank and the login side import this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.runs.folder import EVENTS_JSONL, iter_jsonl

EVENTS = EVENTS_JSONL  # in the run folder's root
START, TRAIN, STOP, FAILURE = "start", "train", "stop", "failure"
# One in-job restart (hpctrain.fault.injob, not a rank): `attempt` is the attempt whose srun step ended; extra
# holds step_id, next_step_id, next_attempt, step_hosts, hosts (the next step's), replaced {old: spare}.
RESTART = "restart"
HEALTH = "health"  # the in-job driver's health check: which nodes failed it and why (hpctrain.fault.health)
_MAX_TEXT = 2000  # characters per text field: a line stays one small write
_MAX_LINES = 12  # traceback lines kept


@dataclass(frozen=True, kw_only=True)
class Event:
    """One line of events.jsonl. `failure_class` is the JSON key "class" (hpctrain.states.FailureClass);
    None on a failure event means "stopped because another rank failed": a consequence, never a cause."""

    kind: str
    time: float
    rank: int | None = None
    host: str = ""
    job_id: str = ""
    attempt: int | None = None
    failure_class: str | None = None
    exception: str = ""  # "ValueError: boom", as a traceback's last line prints it
    message: str = ""
    exit_code: int | None = None
    signal: int | None = None  # stop: the signal this rank got (0: it learned of the stop from its peers)
    traceback: tuple[str, ...] = ()  # the last lines of the traceback
    extra: dict[str, Any] = field(default_factory=dict)  # anything else the writer added (mode, world_size)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"time": self.time, "kind": self.kind, "class": self.failure_class, "rank": self.rank,
                               "host": self.host, "job_id": self.job_id, "attempt": self.attempt,
                               "exception": _cut(self.exception), "message": _cut(self.message),
                               "exit_code": self.exit_code, "signal": self.signal,
                               "traceback": [_cut(ln, 300) for ln in self.traceback[-_MAX_LINES:]]}
        # The fields every reader may count on are always there (null when unknown); the rest only when set.
        always = ("time", "kind", "class", "rank", "host", "job_id", "attempt", "message", "exit_code")
        return {**self.extra, **{k: v for k, v in out.items() if k in always or v not in (None, "", [])}}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Event | None:
        """A line read back; None when it is not an event (no kind or time)."""
        try:
            known = {"time", "kind", "class", "rank", "host", "job_id", "attempt", "exception", "message",
                     "exit_code", "signal", "traceback"}
            return cls(kind=str(obj["kind"]), time=float(obj["time"]), rank=_int(obj.get("rank")),
                       host=str(obj.get("host") or ""), job_id=str(obj.get("job_id") or ""),
                       attempt=_int(obj.get("attempt")),
                       failure_class=str(obj["class"]) if obj.get("class") else None,
                       exception=str(obj.get("exception") or ""), message=str(obj.get("message") or ""),
                       exit_code=_int(obj.get("exit_code")), signal=_int(obj.get("signal")),
                       traceback=tuple(str(x) for x in obj.get("traceback") or () if isinstance(x, str)),
                       extra={k: v for k, v in obj.items() if k not in known})
        except (KeyError, TypeError, ValueError):
            return None


def events_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / EVENTS


def append_event(run_dir: Path | str, event: Event) -> None:
    """Append one line to RUN_DIR/events.jsonl with a single write() on an O_APPEND descriptor."""
    data = (json.dumps(event.to_json(), sort_keys=True, default=str) + "\n").encode("utf-8")
    fd = os.open(events_path(run_dir), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        written = os.write(fd, data)
        if written != len(data):  # a full disk: say so rather than leave half a line that looks whole
            raise OSError(f"{events_path(run_dir)}: wrote {written} of {len(data)} bytes")
    finally:
        os.close(fd)


def read_events(run_dir: Path | str, *, kind: str | None = None) -> list[Event]:
    """Every event of the run, oldest first in file order; unreadable or torn lines are skipped."""
    return [e for e in _iter(events_path(run_dir)) if kind is None or e.kind == kind]


def of_attempt(events: list[Event], attempt: int, job_id: str = "") -> list[Event]:
    """The events of one run of one job: its attempt number, and its job id where both know one."""
    return [e for e in events if e.attempt == attempt and (not job_id or not e.job_id or e.job_id == job_id)]


def _iter(path: Path) -> Iterator[Event]:
    try:  # an unreadable file (permissions, a flaky filesystem) tells nothing, it does not fail the reader
        objs = list(iter_jsonl(path))
    except OSError:
        return
    for obj in objs:
        ev = Event.from_json(obj)
        if ev is not None:
            yield ev


def _cut(text: str, limit: int = _MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None
