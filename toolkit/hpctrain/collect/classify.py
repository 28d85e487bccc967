"""Failure classification: pure functions from log text (+ SLURM state) to one failure class.

Inputs are whatever a dead job leaves behind: per-rank logs (logs/attempt-K.rank-R.log), submitit's
per-task logs (submitit/<job>_<task>_log.out/.err), the SLURM state and exit code, and whether the
heartbeat went stale long before the job ended. Logs can be truncated, interleaved or hold binary
junk, so everything here works line by line on decoded text and never raises on bad input.

Stdlib only (the CLI imports this on the login node).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hpctrain.collect.logs import clean_text  # re-exported: callers and tests use cc.clean_text
from hpctrain.runs import tracebacks
from hpctrain.runs.events import EVENTS, FAILURE, STOP, Event
from hpctrain.states import (
    CLASS_OF_STATE,
    STOPPED_FROM_OUTSIDE,
    FailureClass,
    JobState,
    class_of_exit,
    normalize_state,
)

FC = FailureClass

# The failure classes, the SLURM states and which of those mean "stopped from outside" are hpctrain.states';
# what is here is the evidence: the node's events first, then patterns for the text that the ranks, SLURM and
# third-party libraries (torch, NCCL, gloo, container runtimes, the OOM killer) print.

_GPU_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|"
                      r"HIP out of memory|NCCL.*\bout of memory|cudaErrorMemoryAllocation")
_HOST_OOM = re.compile(r"oom[-_ ]kill|Out of memory: Kill|OUT_OF_MEMORY|Memory cgroup out of memory|"
                       r"oom_reaper|invoked oom-killer", re.IGNORECASE)
_KILLED = re.compile(r"^\s*(?:\S+: line \d+: \d+ )?Killed\b|\bexit(?:ed)?(?: with)?(?: code| status)? 137\b|"
                     r"\bsignal 9\b|SIGKILL", re.IGNORECASE)
# A lost peer, a failed collective (hpctrain.runs.tracebacks: the node reads them too, in its script's output).
PEER_LOST = tracebacks.PEER_LOST  # the hang watchdog (fault.watchdog) reads a rank's failure record with it
_COMM = tracebacks.COMM
peer_error = tracebacks.peer_error


_CONTAINER = re.compile(
    r"^(?:.*\b)?(?:podman|apptainer|singularity|ch-run|enroot|pyxis|conmon|crun|runc)\b.*"
    r"(?:error|ERROR|FATAL|fatal|failed|not found|denied)|"
    r"pyxis: (?:error|failed)|"
    r"FATAL: +(?:container|could not|while|image|failed)|"
    r"OCI runtime (?:error|create failed)|Error: (?:short-name|image not known)|"
    r"ch-run\[\d+\]: error")
# srun/slurmstepd noticing that a node of the step went away (before slurmctld calls it NODE_FAIL).
_NODE_LOST = re.compile(r"missing step on node (\d+)|Node failure on ([\w.-]+)|"
                        r"(?:node|host) ([\w.-]+) (?:is )?not responding|NODE_FAIL")
_PREFLIGHT = re.compile(r"PreflightError|pre-flight: .*(?:did not join|could not reach|did not answer|lost rank 0)|"
                        r"preflight failed")
_HOSTS_IN_PREFLIGHT = re.compile(r"expected on host\(s\) ([^;()\n]+)|rank 0's host (\S+)")
# The one line the node prints on stderr when a rank fails (node/launch/main.py): read only where no event says it
# (run folders from before events.jsonl, or a rank that could not write its event).
_NODE_FAILED = re.compile(r"hpctrain: rank (\d+) failed: ([\w.]+): (.*?)(?: \(traceback in .*\))?$")
# The node checkpointed on SLURM's pre-timeout signal (USR2) or a preemption (TERM) and exited 3.
_SIGNAL_STOP = re.compile(r"signal (\d+): checkpointed at step (\d+), stopping"
                          r"(?: for requeue \((\w+)| for requeue|: (cancel)led)?")
# submitit's own handler for that signal, when chained, refuses to requeue a non-Checkpointable job.
# (timed-out / preempted / "checkpoint function returned None" when no retry is wanted): a stop, not a bug.
_SUBMITIT_STOP = re.compile(r"UncompletedJobError: Job not requeued because")
# The test hook that kills every rank after step N (hpctrain.node.train._fail_hook) says so first.
_INJECTED = re.compile(r"HPCTRAIN_FAIL_AT_STEP=(\d+): exiting hard")
# Tags that identify who wrote a line: the node's "rank3", submitit's JobEnvironment line.
_RANK_TAG = re.compile(r"\brank ?(\d+)\b")
_JOBENV = re.compile(r"JobEnvironment\(job_id=([^,]+), hostname=([^,]+), local_rank=\d+\(\d+\), "
                     r"node=\d+\(\d+\), global_rank=(\d+)\(\d+\)\)")
_HOST_TAG = re.compile(r"\bhost[= ]([A-Za-z0-9][\w.-]*)")


@dataclass
class LogSource:
    """One log's text and who wrote it (rank/host may be unknown: None)."""

    name: str
    text: str
    rank: int | None = None
    host: str | None = None
    job_id: str | None = None


@dataclass
class Failure:
    """What went wrong in one attempt, and where the evidence is."""

    failure_class: str | None  # None: nothing went wrong
    message: str = ""
    rank: int | None = None
    host: str | None = None
    source: str | None = None  # file the evidence came from
    exception: str | None = None  # "ValueError: boom" for Python exceptions
    last_lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)




def identify(source: LogSource) -> LogSource:
    """Fill rank/host from submitit's JobEnvironment line or node tags when the file name did not."""
    m = _JOBENV.search(source.text)
    if m:
        source.host = source.host or m.group(2).strip()
        source.rank = source.rank if source.rank is not None else int(m.group(3))
        source.job_id = source.job_id or m.group(1)
    if source.host is None:
        h = _HOST_TAG.search(source.text[:4000])
        if h:
            source.host = h.group(1)
    return source


# -- single detectors: each returns the evidence line (or None) --------------------------------------
def _first(pattern: re.Pattern[str], lines: list[str]) -> str | None:
    return next((ln for ln in lines if pattern.search(ln)), None)


def find_traceback(lines: list[str]) -> tuple[str, list[str], int, int | None] | None:
    """The exception that failed the log's program ("Type: message"), the last lines of its traceback, the index of
    its "Traceback" line and the rank tag of its lines (hpctrain.runs.tracebacks.cause: the first exception of the
    program's own, not a peer's complaint printed after it, nor a launcher's). A traceback cut before its exception
    line gives "(traceback truncated)"."""
    got = tracebacks.cause(lines)
    if got is None:
        head = next((i for i in range(len(lines) - 1, -1, -1) if tracebacks.HEAD in lines[i]), None)
        if head is None:
            return None
        return "(traceback truncated)", [tracebacks.split(ln)[1].rstrip() for ln in lines[head:head + 8]], head, None
    block = [text.rstrip() for tag, text in map(tracebacks.split, lines[got.start:got.end + 1])
             if got.rank is None or tag == got.rank]
    return got.exception, block[-8:], got.start, got.rank


def _exception_from_node_line(lines: list[str]) -> tuple[int, str] | None:
    for ln in reversed(lines):
        m = _NODE_FAILED.search(ln)
        if m:
            return int(m.group(1)), f"{m.group(2)}: {m.group(3)}"
    return None


@dataclass
class _Evidence:
    cls: str
    line: str
    src: LogSource
    exception: str | None = None
    last_lines: list[str] = field(default_factory=list)
    time: float | None = None  # timestamp of the evidence (or of the nearest timed line before it)
    signal: int | None = None  # a stop: the signal the rank got (from its event)
    checkpointed: bool = False  # a stop: the rank saved a checkpoint first
    stop_class: str | None = None  # a stop: the class the rank gave it (time_limit, preempted, cancelled)


def _kind_of_exception(exc: str) -> str:
    """An exception that reports a lost peer, an OOM or the stop signal is that, not a user bug."""
    if _SUBMITIT_STOP.search(exc):
        return "signal_stop"
    if _GPU_OOM.search(exc):
        return FC.GPU_OOM
    if _COMM.search(exc) or PEER_LOST.search(exc):
        return FC.COMM_TIMEOUT
    if _PREFLIGHT.search(exc):
        return FC.PREFLIGHT
    return FC.PYTHON_EXCEPTION


def _time_at(lines: list[str], index: int) -> float | None:
    from hpctrain.collect.logs import parse_time  # local: collect_logs imports this module

    for ln in reversed(lines[max(0, index - 400):index + 1]):
        t = parse_time(ln)
        if t is not None:
            return t
    return None


def _index(lines: list[str], line: str) -> int:
    try:
        return lines.index(line)
    except ValueError:
        return len(lines) - 1


def _scan(src: LogSource) -> list[_Evidence]:
    """Every kind of evidence in one log."""
    lines = clean_text(src.text).split("\n")
    out: list[_Evidence] = []
    tb = find_traceback(lines)
    if tb is not None and tb[3] is not None and tb[3] != src.rank:
        src = replace(src, rank=tb[3])  # a per-node launcher's log: the program's rank that raised it
    for cls, pattern in ((FC.PREFLIGHT, _PREFLIGHT), (FC.GPU_OOM, _GPU_OOM), (FC.HOST_OOM, _HOST_OOM),
                         (FC.CONTAINER_ERROR, _CONTAINER), (FC.NODE_FAIL, _NODE_LOST), (FC.COMM_TIMEOUT, _COMM)):
        hit = _first(pattern, lines)
        if hit is not None:
            out.append(_Evidence(cls, hit.strip(), src, tb[0] if tb else None, tb[1] if tb else [],
                                 _time_at(lines, _index(lines, hit))))
    if tb is not None:
        exc, block, head, _ = tb
        out.append(_Evidence(_kind_of_exception(exc), exc, src, exc, block, _time_at(lines, head)))
    else:
        node = _exception_from_node_line(lines)
        if node is not None:
            rank, exc = node
            if src.rank is None:
                src.rank = rank
            out.append(_Evidence(_kind_of_exception(exc), exc, src, exc, [exc]))
    stop = _first(_SIGNAL_STOP, lines)
    if stop is not None:
        m = _SIGNAL_STOP.search(stop)
        said = (m.group(3) if m.group(3) in (FC.TIME_LIMIT, FC.PREEMPTED) else
                FC.CANCELLED if m.group(4) else None) if m else None
        out.append(_Evidence("signal_stop", stop.strip(), src, checkpointed=True, stop_class=said))
    killed = _first(_KILLED, lines)
    if killed is not None:
        out.append(_Evidence("killed", killed.strip(), src))
    return out


def _from_events(evs: Iterable[Event]) -> list[_Evidence]:
    """The ranks' own account (events.jsonl): class, rank, host and exact time of each failure and stop.
    The node names the class by the exception's type; a plain exception that carries another library's
    text (gloo's "Connection closed by peer", an OOM inside NCCL) is refined by the patterns above. A
    failure event without a class is a rank that stopped because another failed: a consequence, skipped."""
    out: list[_Evidence] = []
    for e in evs:
        src = LogSource(EVENTS, "", e.rank, e.host or None, e.job_id or None)
        if e.kind == STOP:
            out.append(_Evidence("signal_stop", e.message or f"stopped on signal {e.signal}", src, time=e.time,
                                 signal=e.signal if e.signal is not None else 0,
                                 checkpointed=e.extra.get("checkpointed") is True,
                                 stop_class=e.failure_class or None))
        elif e.kind == FAILURE and e.failure_class:
            if isinstance(e.extra.get("script_rank"), int):  # a per-node launcher's rank (node/launch/main.py)
                src.rank = int(e.extra["script_rank"])
            cls = e.failure_class
            if cls == FC.PYTHON_EXCEPTION:
                cls = _kind_of_exception(e.exception)
            line = e.message if cls == FC.INPUT_ERROR else (e.exception or e.message)
            out.append(_Evidence(cls, line, src, e.exception or None, list(e.traceback[-8:]) or [line], e.time))
    return out


# Root causes first: a failed pre-flight explains everything after it, and a refused input everything the
# ranks did not do; OOMs explain the exception they raise; a real exception on one rank explains its
# peers' "connection closed" errors.
_PRIORITY = (FC.PREFLIGHT, FC.INPUT_ERROR, FC.GPU_OOM, FC.HOST_OOM, FC.CONTAINER_ERROR, FC.NODE_FAIL,
             FC.PYTHON_EXCEPTION, FC.COMM_TIMEOUT)


def classify(state: str | None, sources: Iterable[LogSource], *, exit_code: str | None = None,
             hang: bool = False, hang_message: str = "", hosts: list[str] | None = None,
             events: Iterable[Event] = (), executor: str = "slurm") -> Failure:
    """One failure class for one attempt from its SLURM state, the ranks' events, logs and heartbeat verdict.

    `state` is SLURM's (or the local executor's) final state; None/RUNNING/PENDING mean still going.
    COMPLETED with no error evidence gives failure_class None. `events` are this attempt's lines of
    events.jsonl: read first, and preferred over the same evidence found in the logs. `executor` is the run's
    ("slurm", "local"): the messages name whose state it is.
    """
    state = normalize_state(state or "") if state else ""
    srcs = [identify(s) for s in sources]
    found = _from_events(events) + [e for s in srcs for e in _scan(s)]
    external = state in STOPPED_FROM_OUTSIDE
    by_cls: dict[str, list[_Evidence]] = {}
    for e in found:
        by_cls.setdefault(e.cls, []).append(e)
    for cls in _PRIORITY:
        if cls not in by_cls:
            continue
        if external and cls == FC.COMM_TIMEOUT:
            break  # survivors' complaints about a peer that was cancelled / lost / timed out
        if state == JobState.COMPLETED and cls in (FC.COMM_TIMEOUT, FC.CONTAINER_ERROR, FC.NODE_FAIL):
            continue  # a warning the job survived
        if cls == FC.NODE_FAIL:
            return _node_lost(by_cls[cls], srcs, hosts or [])
        if cls == FC.COMM_TIMEOUT:
            dead = _silent_peer(srcs)
            if dead:  # the peer the survivors lost logged nothing more: its node or process died
                ev = _culprit(by_cls[cls])
                return Failure(FC.NODE_FAIL, f"rank {ev.src.rank} on {ev.src.host} lost its peer on {dead}, "
                               "whose ranks stopped without an error (node or process died)",
                               rank=ev.src.rank, host=dead,
                               source=ev.src.name, exception=ev.exception, last_lines=ev.last_lines)
        return _failure(cls, _culprit(by_cls[cls]))
    if state == JobState.OUT_OF_MEMORY or ("killed" in by_cls and not external and _is_kill_exit(exit_code, state)):
        killed = by_cls.get("killed")
        return _failure(FC.HOST_OOM, killed[0] if killed else None,
                        default=f"{_state_of(executor, state)}, exit {exit_code or '?'}: killed (host memory "
                                "exhausted?)")
    if "signal_stop" in by_cls and state not in (JobState.CANCELLED, JobState.NODE_FAIL):
        return _signal_stop(by_cls["signal_stop"], state)
    if "signal_stop" in by_cls and state == JobState.CANCELLED:
        told = [e for e in by_cls["signal_stop"] if e.stop_class == FC.CANCELLED]
        if told:
            return Failure(FC.CANCELLED, "cancelled by the user (hpctrain cancel); " + _tidy(told[0].line),
                           rank=told[0].src.rank, host=told[0].src.host, source=told[0].src.name)
    if hang and state != JobState.COMPLETED:
        return Failure(FC.HANG, hang_message or "heartbeat stopped long before the job ended")
    if state == JobState.REQUEUED:  # an earlier run of a requeued job: SLURM lost a node or preempted it
        host = lost_host(srcs)
        if host:
            return Failure(FC.NODE_FAIL, f"SLURM requeued the job; {host} went away", host=host)
        return Failure(FC.PREEMPTED, "SLURM requeued the job (preemption or a node failure)")
    if state in CLASS_OF_STATE:
        cls = CLASS_OF_STATE[JobState(state)]
        if cls == FC.NODE_FAIL:
            host = lost_host(srcs)
            return Failure(FC.NODE_FAIL, f"SLURM lost a node{f' ({host})' if host else ''}", host=host)
        return Failure(cls, _state_of(executor, state))
    if state == JobState.FAILED or (exit_code and exit_code not in ("0", "0:0")):
        if FC.COMM_TIMEOUT in by_cls:
            return _failure(FC.COMM_TIMEOUT, _culprit(by_cls[FC.COMM_TIMEOUT]))
        by_exit = class_of_exit(exit_code)  # the node's exit code names it (2: bad input, 4: pre-flight)
        if by_exit is not None:
            return Failure(by_exit, f"{_state_of(executor, state)}, exit {exit_code}: the node's exit code for "
                                    f"{by_exit}; no log or event says more")
        injected = _injected_crash(srcs)
        if injected is not None:
            return Failure(FC.UNKNOWN, f"{_state_of(executor, state)}, exit {exit_code or '?'}: {injected[0]}",
                           rank=injected[1].rank, host=injected[1].host, source=injected[1].name)
        return Failure(FC.UNKNOWN, f"{_state_of(executor, state)}, exit {exit_code or '?'}; no error found in the logs")
    return Failure(None)


def _state_of(executor: str, state: str) -> str:
    """Whose state it is: SLURM's (sacct), or the local executor's (hpctrain.slurm.dispatch.local_state), which
    never touched SLURM. An unknown executor (a run folder from before the field) reads as SLURM, as it always did."""
    return f"{'local job' if executor == 'local' else 'SLURM'} state {state or '?'}"


def _injected_crash(srcs: list[LogSource]) -> tuple[str, LogSource] | None:
    """The test hook's own line (hpctrain.node.train._fail_hook: HPCTRAIN_FAIL_AT_STEP=N kills every rank
    with os._exit after step N): the crash was asked for, not a fault to hunt in the logs."""
    for src in srcs:
        m = _INJECTED.search(src.text)
        if m:
            return (f"crash injected by the HPCTRAIN_FAIL_AT_STEP={m.group(1)} test hook (the ranks exited hard "
                    f"after step {m.group(1)})"), src
    return None


def _node_lost(evidence: list[_Evidence], srcs: list[LogSource], hosts: list[str]) -> Failure:
    """srun saw a node of the step vanish: name it (srun gives a node index into the job's hosts)."""
    ev = evidence[0]
    m = _NODE_LOST.search(ev.line)
    host = None
    if m and m.group(1) is not None and hosts and int(m.group(1)) < len(hosts):
        host = hosts[int(m.group(1))]
    elif m and (m.group(2) or m.group(3)):
        host = m.group(2) or m.group(3)
    host = host or lost_host(srcs)
    return Failure(FC.NODE_FAIL, f"{_tidy(ev.line)}" + (f" ({host})" if host else ""), host=host, source=ev.src.name)


def _silent_peer(srcs: list[LogSource]) -> str | None:
    """A host named as the lost peer in the survivors' errors whose own logs just stop."""
    hosts = {s.host for s in srcs if s.host}
    named = _peer_hosts(srcs, hosts, resolve=True)
    for host in named:
        mine = [s for s in srcs if s.host == host and s.name.endswith(".log")]
        if mine and not any(_ENDED.search(s.text) for s in mine):
            return host
    return None


def _signal_stop(evidence: list[_Evidence], state: str) -> Failure:
    """The job stopped on SLURM's pre-timeout signal (USR1/USR2) or a preemption (TERM)."""
    # The ranks' stop events first, then their log lines; signal 0 is a rank that only learned of the stop
    # from its peers: prefer one that got the signal.
    stops = sorted((e for e in evidence if _signum(e) is not None), key=lambda e: e.src.name != EVENTS)
    ev = next((e for e in stops if _signum(e) != 0), stops[0] if stops else evidence[0])
    sig = _signum(ev)
    words = " ".join(e.line for e in evidence)
    told = next((e.stop_class for e in stops if e.stop_class), None)  # the rank's own verdict (time left)
    if state in (JobState.TIMEOUT, JobState.DEADLINE):
        cls: str = FC.TIME_LIMIT
    elif state == JobState.PREEMPTED:
        cls = FC.PREEMPTED
    elif told is not None:
        cls = told
    else:  # an old run folder: the signal's documented meaning
        timed_out = "timed-out" in words or sig in (10, 12)
        cls = FC.TIME_LIMIT if timed_out else FC.PREEMPTED
    note = " (checkpointed: resumable)" if ev.checkpointed else ""
    return Failure(cls, _tidy(ev.line) + note, rank=ev.src.rank, host=ev.src.host, source=ev.src.name)


def _signum(e: _Evidence) -> int | None:
    if e.signal is not None:
        return e.signal
    m = _SIGNAL_STOP.search(e.line)
    return int(m.group(1)) if m else None


def _is_kill_exit(exit_code: str | None, state: str) -> bool:
    """137 = 128 + SIGKILL; sacct writes "0:9" when the signal killed the step. Without an exit
    code (sacct down) a bare "Killed" on a FAILED job is still the best guess."""
    if not exit_code:
        return state in (JobState.FAILED, "")
    return exit_code.split(":")[0] == "137" or exit_code.endswith(":9")


def _culprit(evidence: list[_Evidence]) -> _Evidence:
    """The rank that showed this evidence FIRST (its peers fail after it: "another rank failed"),
    then the lowest rank; rank logs before submitit's, which repeat them without timestamps. The ranks'
    events, where there are any for this class, are the account to trust: they are used alone."""
    evidence = [e for e in evidence if e.src.name == EVENTS] or evidence
    timed = [e.time for e in evidence if e.time is not None]
    first = min(timed) if timed else None
    # Lines carry whole seconds: evidence within the same second counts as simultaneous.
    pool = [e for e in evidence if first is None or (e.time is not None and e.time < first + 1.0)] or evidence
    return min(pool, key=lambda e: (e.src.rank if e.src.rank is not None else 1 << 30,
                                    not e.src.name.endswith(".log")))


def _failure(cls: str, ev: _Evidence | None, default: str = "") -> Failure:
    if ev is None:
        return Failure(cls, default)
    msg = ev.line if cls != FC.PYTHON_EXCEPTION else (ev.exception or ev.line)
    if cls == FC.PREFLIGHT:
        hosts = _HOSTS_IN_PREFLIGHT.search(msg) or next(
            (h for h in (_HOSTS_IN_PREFLIGHT.search(ln) for ln in ev.src.text.splitlines()) if h), None)
        host = (hosts.group(1) or hosts.group(2)).strip() if hosts else ev.src.host
        return Failure(cls, _tidy(msg), rank=ev.src.rank, host=host, source=ev.src.name)
    return Failure(cls, _tidy(msg), rank=ev.src.rank, host=ev.src.host, source=ev.src.name,
                   exception=ev.exception if cls in (FC.PYTHON_EXCEPTION, FC.GPU_OOM, FC.COMM_TIMEOUT) else None,
                   last_lines=ev.last_lines)


def _tidy(msg: str, limit: int = 300) -> str:
    msg = re.sub(r"^\S+T\d\d:\d\d:\d\d\S* rank\d+ [A-Z]+ ", "", msg.strip())  # the node's log prefix
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


# The peer a survivor's communication error names (gloo: "Read error [10.77.0.2]:36531", "Connection closed by
# peer [node2]:1234"), read so by the collector (lost_host) and the hang watchdog (hpctrain.fault.watchdog).
PEER_ADDR = re.compile(r"(?:closed by peer|reset by peer|Read error|Write error|from|to) "
                       r"\[?([0-9]{1,3}(?:\.[0-9]{1,3}){3}|[A-Za-z][\w.-]*)\]?:\d+")
_ENDED = re.compile(r"\b(?:ERROR|Traceback|done$|finished at step|checkpointed at step \d+, stopping)", re.MULTILINE)


def lost_host(sources: list[LogSource], resolve: bool = True) -> str | None:
    """After NODE_FAIL or a requeue: the host that went away. In order of trust:
    the peer the survivors' "connection closed by peer [addr]:port" errors name (an address resolved
    through the hosts database); else the only host(s) whose logs just stop (no error, no end line)
    while others' logs end in errors; else the host that stopped logging first, by a second or more."""
    from hpctrain.collect.logs import last_timestamp  # local: collect_logs imports this module

    hosts = {s.host for s in sources if s.host}
    if len(hosts) < 2:
        return None
    named = _peer_hosts(sources, hosts, resolve)
    if len(named) == 1:
        return named.pop()
    silent = {s.host for s in sources if s.host and not _ENDED.search(s.text)}
    loud = hosts - silent
    if loud and len(silent) == 1:
        return silent.pop()
    last: dict[str, float] = {}
    for s in sources:
        t = last_timestamp(s.text) if s.host else None
        if s.host and t is not None:
            last[s.host] = max(last.get(s.host, t), t)
    if len(last) < 2:
        return None
    ordered = sorted(last, key=lambda h: last[h])
    return ordered[0] if last[ordered[1]] - last[ordered[0]] >= 1.0 else None


def _peer_hosts(sources: list[LogSource], hosts: set[str], resolve: bool) -> set[str]:
    out: set[str] = set()
    for s in sources:
        for m in PEER_ADDR.finditer(s.text):
            short = peer_host(m.group(1), resolve)
            if short in hosts and short != s.host:
                out.add(short)
    return out


def peer_host(addr: str, resolve: bool = True) -> str:
    """A peer as PEER_ADDR finds it (an address or a name) -> its short host name, an address resolved through
    the hosts database (unless `resolve` is off; an unknown address stays itself)."""
    return (_resolve(addr) if addr[0].isdigit() and resolve else addr).split(".")[0]


def _resolve(addr: str) -> str:
    """Address -> host name via the hosts database; the address itself when unknown."""
    import socket

    try:
        return socket.gethostbyaddr(addr)[0]
    except (OSError, UnicodeError):
        return addr


def rank_of_line(line: str) -> int | None:
    m = _RANK_TAG.search(line)
    return int(m.group(1)) if m else None


def is_hang(heartbeat_time: float | None, job_end: float | None, step_interval_s: float | None,
            *, min_stale_s: float = 300.0, factor: float = 10.0) -> bool:
    """The heartbeat went quiet long before the job ended: more than max(min_stale_s,
    factor x the usual step time). Needs both times; without them nobody can say it hung."""
    if heartbeat_time is None or job_end is None:
        return False
    limit = max(min_stale_s, factor * (step_interval_s or 0.0))
    return job_end - heartbeat_time > limit
