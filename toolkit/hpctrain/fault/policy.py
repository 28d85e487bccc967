"""The retry policy: a pure decision from a run's attempt history to the next action.

`decide(history, policy, fit)` looks only at its arguments (no SLURM, no files, no clock), so every rule
is unit-tested with plain records and the supervisor (`hpctrain.fault.supervisor`) is just plumbing around it:

* COMPLETED                                -> done
* a user error (Python exception in the user's code or config, a bad input file, an OOM the same
  batch would hit again, a broken container image)  -> stop, quoting the evidence; never retried
* cancelled by a person (a user's cancel)  -> stop (the watchdog's cancel is a hang, not this)
* the same failure twice in a row (class, exception text and last step identical) -> stop
* attempts that make no progress (same last complete checkpoint) `no_progress_attempts` times in a
  row -> stop early
* the retry budget is spent                -> stop
* NODE_FAIL, PREEMPTED, TIMEOUT, hang, transient NCCL/gloo errors, a failed pre-flight, or an
  unexplained crash -> retry from the latest complete checkpoint, with the implicated host(s)
  added to --exclude while the request still fits the partition (capped), and saying so otherwise.

Stdlib only: the CLI imports this on the login node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hpctrain.states import (
    OUTSIDE_EVENTS,
    RETRYABLE,
    STOPPED_BY_PERSON,
    USER_ERRORS,
    FailureClass,
    JobState,
    class_of_exit,
)

# The retry budget a spec may ask for is capped: a run that failed ten times needs a person.
MAX_RETRIES_CAP = 10

Action = Literal["retry", "stop", "done"]


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How hard to try. `max_retries` is clamped to MAX_RETRIES_CAP."""

    max_retries: int = 3
    exclude_failed_nodes: bool = True
    max_excluded: int = 4  # never more hosts than this in --exclude (and never so many the job can't fit)
    no_progress_attempts: int = 2  # stop after this many attempts in a row ending at the same checkpoint

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries = {self.max_retries}: cannot be negative")
        object.__setattr__(self, "max_retries", min(self.max_retries, MAX_RETRIES_CAP))


@dataclass(frozen=True, kw_only=True)
class AttemptRecord:
    """What the policy needs to know about one finished attempt (one SLURM job of the run).

    `checkpoint_step` is the step a resume starts from when the attempt ended (None: none yet);
    `hosts` the job's nodes; `implicated` the host(s) the failure points at (a dead node, the rank
    that crashed or went silent); `excluded` the --exclude it ran with.
    """

    attempt: int
    job_id: str
    state: str
    failure_class: str | None = None
    exit_code: str | None = None
    exception: str | None = None
    message: str = ""
    evidence: str = ""  # where to look: a log path, a rank
    last_step: int | None = None
    checkpoint_step: int | None = None
    hosts: tuple[str, ...] = ()
    implicated: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fit:
    """How many nodes the request needs and the partition has (for the exclusion cap)."""

    nodes_needed: int
    partition_nodes: int | None = None  # None: unknown (then at most Policy.max_excluded hosts)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    exclude: tuple[str, ...] = ()  # the whole --exclude for the next attempt
    added: tuple[str, ...] = ()  # hosts newly excluded by this decision
    not_excluded: tuple[str, ...] = ()  # implicated hosts left in (the request would not fit)
    failure_class: str | None = None
    retries_used: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("exclude", "added", "not_excluded"):
            d[k] = list(d[k])
        return d


def effective_class(rec: AttemptRecord) -> str | None:
    """The failure class the policy acts on: where no evidence named one, the node's exit code does (2: bad
    input, a user error even when no traceback names it; 4: the pre-flight)."""
    if rec.state == JobState.COMPLETED and not rec.failure_class:
        return None
    by_exit = class_of_exit(rec.exit_code)
    if by_exit is not None and rec.failure_class in (None, FailureClass.UNKNOWN):
        return by_exit
    return rec.failure_class or (FailureClass.UNKNOWN if rec.state != JobState.COMPLETED else None)


def decide(history: Sequence[AttemptRecord], policy: Policy, fit: Fit) -> Decision:
    """The next action after the last attempt in `history` (oldest first) ended."""
    if not history:
        raise ValueError("decide() needs at least one finished attempt")
    last = history[-1]
    cls = effective_class(last)
    used = len(history) - 1  # attempts after the first are retries

    def end(action: Action, reason: str) -> Decision:
        return Decision(action, reason, exclude=last.excluded, failure_class=cls, retries_used=used)

    if last.state == JobState.COMPLETED and cls is None:
        return end("done", f"attempt {last.attempt} (job {last.job_id}) completed")
    what = _describe(last, cls)
    if cls in USER_ERRORS:
        return end("stop", f"{what}: a user error (code, config or sizing); not retried, it would fail the "
                        f"same way. Fix it, then `hpctrain resubmit` the run.")
    if cls in STOPPED_BY_PERSON:
        return end("stop", f"{what}: a user's cancel (hpctrain cancel or scancel; hpctrain's watchdog cancels "
                        "are hang or node_fail); not retried")
    if len(history) >= 2 and _same_failure(history[-2], last):
        return end("stop", f"{what}: the same failure as attempt {history[-2].attempt} (same class, message "
                        f"and last step); not retried again")
    stuck = _attempts_without_progress(history)
    if policy.no_progress_attempts > 0 and stuck >= policy.no_progress_attempts:
        ck = last.checkpoint_step
        return end("stop", f"{what}: {stuck} attempts in a row made no progress (last complete checkpoint "
                        f"{'none' if ck is None else f'step {ck}'}); stopping early")
    if used >= policy.max_retries:
        return end("stop", f"{what}: retry budget spent ({used} of {policy.max_retries} retries used)")
    if cls not in RETRYABLE:
        return end("stop", f"{what}: no retry rule for failure class {cls!r}")
    exclude, added, kept, notes = exclusions(last, policy, fit)
    resume = "the start" if last.checkpoint_step is None else f"checkpoint step {last.checkpoint_step}"
    reason = f"{what}: retry {used + 1} of {policy.max_retries}, resuming from {resume}"
    if added:
        reason += f"; excluding {', '.join(added)}"
    return Decision("retry", reason, exclude=exclude, added=added, not_excluded=kept, failure_class=cls,
                    retries_used=used, notes=notes)


def _describe(rec: AttemptRecord, cls: str | None) -> str:
    parts = [f"attempt {rec.attempt} (job {rec.job_id}) ended {rec.state}"]
    if cls:
        parts.append(f"[{cls}]")
    detail = rec.exception or rec.message
    if detail:
        parts.append(f"- {detail}")
    if rec.evidence:
        parts.append(f"(see {rec.evidence})")
    return " ".join(parts)


def _same_failure(a: AttemptRecord, b: AttemptRecord) -> bool:
    """Identical repeats: only for failures that carry a message (a bare NODE_FAIL twice is bad luck)."""
    if not (a.exception or a.message) or effective_class(a) != effective_class(b):
        return False
    if effective_class(b) in OUTSIDE_EVENTS:
        return False  # outside events: they repeat without saying anything about the run
    return (a.exception, a.message, a.last_step) == (b.exception, b.message, b.last_step)


def _attempts_without_progress(history: Sequence[AttemptRecord]) -> int:
    """How many attempts at the end of `history` ended at the checkpoint they started from."""
    n = 0
    for i in range(len(history) - 1, -1, -1):
        before = history[i - 1].checkpoint_step if i > 0 else None
        if history[i].checkpoint_step != before:
            break
        n += 1
    return n


def exclusions(last: AttemptRecord, policy: Policy, fit: Fit
                ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], list[str]]:
    """(new --exclude, hosts added, implicated hosts kept in, notes): grow by the implicated hosts up
    to the cap, where cap = min(policy.max_excluded, partition nodes - nodes needed)."""
    current = tuple(dict.fromkeys(last.excluded))
    wanted = [h for h in dict.fromkeys(last.implicated) if h and h not in current]
    if not policy.exclude_failed_nodes or not wanted:
        return current, (), (), []
    room = policy.max_excluded
    limit_note = f"at most {policy.max_excluded} excluded host(s) (policy cap)"
    if fit.partition_nodes is not None:
        spare = fit.partition_nodes - fit.nodes_needed
        if spare < room:
            room = spare
            limit_note = (f"the partition has {fit.partition_nodes} node(s) and the run needs {fit.nodes_needed}: "
                          f"excluding more than {max(spare, 0)} would leave the job unable to start")
    free = max(0, room - len(current))
    added = tuple(wanted[:free])
    kept = tuple(wanted[free:])
    notes = []
    if kept:
        notes.append(f"not excluding {', '.join(kept)}: {limit_note}; SLURM will not place the job on a DOWN "
                     f"node, so it waits for the node to return or for capacity")
    return current + added, added, kept, notes
