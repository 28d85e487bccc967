"""The journal's word in the log view: which node was lost, and the surviving ranks' peer errors as its consequences.

After a node dies, the ranks that survive it print gloo or NCCL errors naming the peer they talked to, often a
healthy one that had stopped because of the lost node: read alone, their logs blame healthy peers. The journal
(the hang watchdog's verdicts, the in-job driver's restarts: hpctrain.runs.journal) knows which node was lost;
`hpctrain logs` says so where it happened and marks each survivor's peer error after it as a consequence.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from hpctrain.collect.classify import peer_error
from hpctrain.collect.logs import _INF, JOURNAL, Line
from hpctrain.runs import journal
from hpctrain.runs.events import read_events
from hpctrain.states import FailureClass

_PEER_SLACK_S = 60.0  # a survivor's peer error this long before the recorded loss still follows from it


@dataclass(frozen=True)
class NodeLoss:
    """Nodes of attempt `attempt` lost at `time`, as the run's journal records it (`by`: who decided)."""

    attempt: int
    hosts: tuple[str, ...]
    time: float
    by: str

    def says(self) -> str:
        when = datetime.fromtimestamp(self.time).strftime("%H:%M:%S")
        return (f"{', '.join(self.hosts)} lost at {when} ({self.by}); the peer errors other ranks print after it "
                "are its consequences, not their causes")


def node_losses(run_dir: Path) -> list[NodeLoss]:
    """Every node loss the journal records: the hang watchdog's peer_lost verdicts (its silent hosts) and the
    in-job driver's node_fail restarts (the nodes a spare replaced, or the one it names), once per attempt and
    hosts, in time order. The ranks' own errors never decide it: a survivor's gloo error names the peer it
    talked to, often a healthy one that had stopped because of the lost node."""
    found: dict[tuple[int, tuple[str, ...]], NodeLoss] = {}
    for v in journal.read_verdicts(run_dir):
        if v.event == journal.PEER_LOST and v.silent_hosts and v.attempt is not None:
            hosts = tuple(sorted(v.silent_hosts))
            first = v.time - float(v.extra.get("detected_s") or 0)  # its first sign, not the verdict's time
            found.setdefault((v.attempt, hosts), NodeLoss(v.attempt, hosts, first, "the watchdog: peer_lost"))
    try:
        evs = read_events(run_dir)
    except (OSError, ValueError):
        evs = []
    for r in journal.restarts(evs):
        hosts = tuple(sorted(r.replaced)) or ((r.host,) if r.host else ())
        if r.failure_class == FailureClass.NODE_FAIL and hosts:
            when = r.first_error or r.detected or r.time
            loss = NodeLoss(r.attempt, hosts, when, f"in-job restart {r.restart}: {_spares(r.replaced)}")
            found[(r.attempt, hosts)] = loss  # the driver's record names the spare too
    return sorted(found.values(), key=lambda x: (x.attempt, x.time))


def _spares(replaced: dict[str, str]) -> str:
    return ", ".join(f"{spare} took {lost}'s place" for lost, spare in sorted(replaced.items())) or "no spare"


class LossNotes:
    """The journal's word in the log view: before the first line of an attempt at or after a node loss, one
    line saying which node was lost; a surviving rank's peer error after it (hpctrain.collect.classify's lost-peer
    and communication patterns) noted as a consequence."""

    def __init__(self, read: Callable[[], Iterable[NodeLoss]]) -> None:
        self.read = read
        self.by_attempt: dict[int, list[NodeLoss]] = {}
        self.said: set[NodeLoss] = set()
        self.seen: set[int] = set()  # the attempts whose lines were shown (a filtered view shows only theirs)
        self.refresh()

    @classmethod
    def of_run(cls, run_dir: Path) -> LossNotes:
        return cls(lambda: node_losses(run_dir))

    def refresh(self) -> None:
        self.by_attempt = {}
        for loss in self.read():
            self.by_attempt.setdefault(loss.attempt, []).append(loss)

    def lines(self, ln: Line) -> list[Line]:
        """`ln`, noted, after the journal's lines due before it: a loss is said before the first line at or after
        its time, or before its first consequence (log times are whole seconds)."""
        noted = self._noted(ln)
        self.seen.add(ln.attempt)
        out: list[Line] = []
        for loss in self.by_attempt.get(ln.attempt, []):
            if loss not in self.said and (ln.time >= math.floor(loss.time) or noted.note):
                self.said.add(loss)
                out.append(Line(loss.time, ln.attempt, None, JOURNAL, loss.says()))
        return [*out, noted]

    def rest(self) -> list[Line]:
        """The losses of the attempts shown that no line came after (a log that ends before the journal's record)."""
        out = [Line(x.time, x.attempt, None, JOURNAL, x.says()) for k in sorted(self.seen)
               for x in self.by_attempt.get(k, []) if x not in self.said]
        self.said.update(x for k in self.seen for x in self.by_attempt.get(k, []))
        return out

    def _noted(self, ln: Line) -> Line:
        for loss in self.by_attempt.get(ln.attempt, []):
            host = ln.host.split(".")[0]
            if host in loss.hosts or not peer_error(ln.text):
                continue
            if ln.time == _INF or ln.time >= loss.time - _PEER_SLACK_S:
                return dataclasses.replace(ln, note=f"a consequence of {', '.join(loss.hosts)}'s loss")
        return ln


