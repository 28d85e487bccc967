"""Every attempt of a run, one row each, as every report counts them: the one reader of attempts and placement.

An attempt is one run of the training command, whichever way it began:
  * `submitted`: a job of its own (the first submission, a supervisor's or a person's resubmission): a row of the
    registry, or of attempts.jsonl for a run this registry never saw;
  * `requeued`: SLURM or submitit ran the same job again (the node numbers its logs attempt-K with K =
    HPCTRAIN_ATTEMPT + SLURM_RESTART_COUNT, so the run leaves logs/attempt-K.* with no registry row of its own);
  * `in_job`: the in-job driver (hpctrain.fault.injob) ended an srun step and started the next one in the same
    allocation (its `restart` event in events.jsonl, its line in attempts.jsonl).

`expand(base, ...)` turns the job-level rows (registry or attempts.jsonl) into attempt rows; `status`, `list`,
`summary`, `logs`, `watch` and `sync` all read attempts through it, so an in-job restart or a requeue is one more
attempt in each of them. Each row keeps its job's allocation (`allocated`: spares included, for the cost) beside
the hosts its ranks trained on (`nodes`), the node a spare replaced when it began (`replaced`), and its ranks'
hosts (`rank_hosts`): what each rank's own events said, else SLURM's block distribution over `nodes`.

Each run of a requeued job is SLURM's own record of it (`sacct -D`: one per requeue, with its state, hosts, start and
end), as the job-state refresh (hpctrain.slurm.refresh) wrote it to attempts.jsonl (`sacct_runs`); without one (a
folder from before, sacct down) an earlier run ends REQUEUED with the job's hosts and its ranks' span. The job's last
row keeps the job's state. Stdlib only: the login side and the collector import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.runs import events as run_events
from hpctrain.runs import journal
from hpctrain.runs.folder import RunFolder
from hpctrain.states import JobState

SUBMITTED, REQUEUED, IN_JOB = "submitted", "requeued", "in_job"  # how an attempt began
_WAITING = frozenset({JobState.PENDING, JobState.SUBMIT_UNKNOWN, JobState.REQUEUE_HOLD})
Span = Callable[[int], tuple[float | None, float | None]]  # attempt -> (first, last) time its logs show


@dataclass(frozen=True, kw_only=True)
class AttemptView:
    """One attempt as every report shows it (a typed view of an `expand` row)."""

    attempt: int
    job_id: str
    how: str
    state: str
    step_id: str = ""
    hosts: tuple[str, ...] = ()  # where its ranks trained
    allocated: tuple[str, ...] = ()  # the job's allocation, spares included
    replaced: dict[str, str] = field(default_factory=dict)  # dead or unhealthy host -> the spare that took over
    rank_hosts: dict[int, str] = field(default_factory=dict)
    started: float | None = None
    ended: float | None = None
    exit_code: str | None = None
    failure_class: str | None = None

    @property
    def label(self) -> str:
        """ "job 123", "step 123.1" (an in-job restart), "job 123, requeue 1" (a later run of a job)."""
        if self.how == IN_JOB and self.step_id:
            return f"step {self.step_id}"
        return f"job {self.job_id}" + (" (requeued)" if self.how == REQUEUED else "")

    @classmethod
    def of(cls, row: dict[str, Any], ranks_per_node: int = 1) -> AttemptView:
        hosts = tuple(hosts_of(str(row.get("nodes") or "")))
        return cls(attempt=int(row["attempt"]), job_id=str(row.get("job_id") or ""),
                   how=str(row.get("how") or SUBMITTED),
                   state=str(row.get("state") or JobState.UNKNOWN), step_id=str(row.get("step_id") or ""),
                   hosts=hosts, allocated=tuple(hosts_of(str(row.get("allocated") or ""))) or hosts,
                   replaced=dict(row.get("replaced") or {}),
                   rank_hosts=rank_hosts(row, ranks_per_node),
                   started=_float(row.get("started")), ended=_float(row.get("ended")),
                   exit_code=None if row.get("exit_code") in (None, "") else str(row["exit_code"]),
                   failure_class=row.get("failure_class") or (row.get("in_job_restart") or {}).get("class") or None)


def hosts_of(nodelist: str) -> list[str]:
    """A SLURM nodelist ("node[1-3]") as host names; a malformed one keeps its plain names."""
    if not nodelist:
        return []
    try:
        from hpctrain.nodelist import expand as expand_nodelist

        return expand_nodelist(nodelist)
    except Exception:  # noqa: BLE001 - a malformed nodelist must never fail a report
        return [h for h in nodelist.split(",") if h and "[" not in h]


def rank_hosts(row: dict[str, Any], ranks_per_node: int) -> dict[int, str]:
    """rank -> host of one attempt row: the ranks' own events first, then the block distribution over its hosts."""
    out = {int(k): str(v) for k, v in (row.get("rank_hosts") or {}).items()}
    hosts = hosts_of(str(row.get("nodes") or ""))
    per = max(1, ranks_per_node)
    for r in range(len(hosts) * per):
        out.setdefault(r, hosts[r // per])
    return out


def log_attempts(folder: Path) -> set[int]:
    """K of every logs/attempt-K.rank-R.log (a directory listing, no file read)."""
    out: set[int] = set()
    try:
        names = [p.name for p in RunFolder(folder).logs_dir.iterdir()]
    except OSError:
        return out
    for name in names:
        head = name.split(".", 1)[0]
        if name.startswith("attempt-") and head[8:].isdigit():
            out.add(int(head[8:]))
    return out


def expand(base: list[dict[str, Any]], folder: Path, *, events: list[run_events.Event] | None = None,
           logs: set[int] | None = None, span: Span | None = None) -> list[dict[str, Any]]:
    """One row per attempt (see the module doc) from the job-level rows `base` ({attempt, job_id, state, nodes,
    started, ended, ...}: the registry's, or attempts.jsonl's). `events` and `logs` are read from `folder` when
    not given; `span` times a requeued run from its logs (the collector's reader), else its events time it."""
    if not base:
        return []
    evs = run_events.read_events(folder) if events is None else events
    logs = log_attempts(folder) if logs is None else logs
    recs = RunFolder(folder).read_attempts()
    in_job = _in_job_numbers(recs, evs)
    sacct_runs = _sacct_runs(recs)
    groups: list[list[dict[str, Any]]] = []  # consecutive entries of one job id
    for a in sorted(base, key=lambda a: int(a["attempt"])):
        if groups and str(groups[-1][0].get("job_id")) == str(a.get("job_id")):
            groups[-1].append(a)
        else:
            groups.append([a])
    out: list[dict[str, Any]] = []
    for i, entries in enumerate(groups):
        jid = str(entries[0].get("job_id") or "")
        k0 = int(entries[0]["attempt"])
        k_next = int(groups[i + 1][0]["attempt"]) if i + 1 < len(groups) else 1 << 30
        mine = {k for k in logs | in_job.get(jid, set()) if k0 < k < k_next}
        nums = sorted({int(e["attempt"]) for e in entries} | mine)
        requeues = {k for k in nums if k != k0 and k not in in_job.get(jid, set())}
        job = dict(entries[0])
        for e in entries[1:]:  # later notes on the same job (a supervisor's record) fill in
            job.update({key: v for key, v in e.items() if v not in (None, "")})
        job["allocated"] = ",".join(_allocation(str(job.get("nodes") or ""), jid, evs))
        if str(job.get("state")) in _WAITING and in_job.get(jid):
            # The job started a new srun step of its own: it holds its allocation, so a registry not refreshed
            # yet (or a submission of unknown outcome) must not show it as waiting.
            job["state"] = JobState.RUNNING
        for k in nums:
            row = dict(job, attempt=k, how=SUBMITTED if k == k0 else IN_JOB if k in in_job.get(jid, ()) else REQUEUED)
            if len(nums) > 1:
                row["_requeued"] = True  # the job's submitit logs hold every run: each row reads its own part
            if k != nums[-1]:
                first, last = _span(evs, jid, k, span)
                row.update(state=JobState.REQUEUED, started=first, ended=last, exit_code=None, failure_class=None)
            elif row.get("started") is None:  # the registry not refreshed yet
                row["started"] = _span(evs, jid, k, span)[0]
            out.append(row)
        if requeues and sacct_runs.get(jid):
            _own_runs(out, sacct_runs[jid], jid, [k for k in nums if k not in in_job.get(jid, set())], evs)
        # sacct's start of a job SLURM resized (a node lost under --no-kill) is the resize time
        _first_run_start(out, evs, jid, k0, job if not any(int(k) in requeues for k in nums) else None)
    out = _with_in_job_restarts(out, evs)
    return _with_rank_hosts(out, evs)


def _allocation(nodelist: str, jid: str, evs: list[run_events.Event], attempts: set[int] | None = None) -> list[str]:
    """Every node the job held, spares included: SLURM's node list (after SLURM resized the job under --no-kill,
    it lacks the node it dropped), and the nodes its in-job restarts name (the driver's allocation, else the
    ended step's hosts and the next one's: the dead node and the spare that replaced it); `attempts`: only the
    restarts that ended one of these (the rows of one run of a requeued job)."""
    out = dict.fromkeys(hosts_of(nodelist))
    for r in journal.restarts(evs):
        if r.job_id == jid and (attempts is None or r.attempt in attempts):
            out.update(dict.fromkeys((*r.job_hosts, *r.step_hosts, *r.hosts)))
    return list(out)


def _sacct_runs(recs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """job id -> its runs as `sacct -D` listed them last (attempts.jsonl's `sacct_runs`, hpctrain.slurm.refresh),
    oldest first. A RESIZING record is no run of its own: SLURM ends it when it shrinks the job (a node lost under
    --no-kill) and the job goes on in the next record, which keeps the first one's start."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in recs:
        got = rec.get("sacct_runs")
        if isinstance(got, list) and rec.get("job_id") is not None:
            out[str(rec["job_id"])] = [r for r in got if isinstance(r, dict)]
    for jid, runs in out.items():
        folded: list[dict[str, Any]] = []
        carry: float | None = None
        for r in runs:
            if str(r.get("state")) == JobState.RESIZING:
                carry = carry if carry is not None else _float(r.get("start"))
                continue
            folded.append(dict(r, start=carry) if carry is not None else r)
            carry = None
        out[jid] = folded
    return out


def _own_runs(rows: list[dict[str, Any]], runs: list[dict[str, Any]], jid: str, heads: list[int],
              evs: list[run_events.Event]) -> None:
    """Each earlier run of a requeued job (its `heads`: the attempt that began each run, in-job restarts aside)
    takes SLURM's record of that run: its state and exit code on its last row, its hosts, allocation, start and end
    (a start SLURM cleared keeps the ranks' span). Runs match heads one to one when sacct lists as many; otherwise
    (a run requeued before any rank logged) each head takes the run whose time holds its first event."""
    mine = [r for r in rows if str(r.get("job_id") or "") == jid]
    if len(runs) == len(heads):
        pairs = list(zip(heads, runs, strict=True))
    else:
        pairs = [(k, r) for k in heads[:-1] for r in [_run_at(runs, _float(_row(mine, k).get("started")))] if r]
    for k, run in pairs:
        if k == heads[-1]:
            continue  # the job's latest run: the registry's record of the job is sacct's latest already
        nxt = min((h for h in heads if h > k), default=1 << 30)
        span = [r for r in mine if k <= int(r["attempt"]) < nxt]
        nodes = str(run.get("nodelist") or "")
        start, end = _float(run.get("start")), _float(run.get("end"))
        held = ",".join(_allocation(nodes, jid, evs, {int(x["attempt"]) for x in span}))
        for r in span:
            if nodes:
                r.update(nodes=nodes, allocated=held)
        if start is not None:
            span[0]["started"] = start
        if end is not None:
            span[-1]["ended"] = end
        span[-1].update(state=str(run.get("state") or JobState.REQUEUED), exit_code=run.get("exit_code") or None)


def _run_at(runs: list[dict[str, Any]], t: float | None, slack: float = 5.0) -> dict[str, Any] | None:
    """The run of `runs` (sacct's records of one job) whose start..end holds the time `t`."""
    if t is None:
        return None
    for r in runs:
        start, end = _float(r.get("start")), _float(r.get("end"))
        if start is not None and start - slack <= t and (end is None or t <= end + slack):
            return r
    return None


def _row(rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    return next(r for r in rows if int(r["attempt"]) == k)


def _first_run_start(rows: list[dict[str, Any]], evs: list[run_events.Event], jid: str, k0: int,
                     job: dict[str, Any] | None) -> None:
    """The job's first run started no later than its first event (sacct's start moves when SLURM resizes it), nor
    than SLURM's start of the job when it ran once (`job`; its in-job restarts aside): the time before the first
    rank's start (the batch script, the health check) is the allocation's too, and costs as much."""
    first = min((e.time for e in evs if e.job_id == jid and e.attempt == k0), default=None)
    allocated = _float(job.get("started")) if job is not None else None
    for row in rows:
        if str(row.get("job_id")) == jid and int(row["attempt"]) == k0:
            known = [t for t in (_float(row.get("started")), first, allocated) if t is not None]
            row["started"] = min(known) if known else None


def _span(evs: list[run_events.Event], jid: str, k: int, span: Span | None) -> tuple[float | None, float | None]:
    if span is not None:
        first, last = span(k)
        if first is not None:
            return first, last
    times = [e.time for e in evs if e.attempt == k and (not e.job_id or e.job_id == jid)]
    return (min(times), max(times)) if times else (None, None)


def _in_job_numbers(recs: list[dict[str, Any]], evs: list[run_events.Event]) -> dict[str, set[int]]:
    """job id -> the attempt numbers its in-job restarts began (restart events, and attempts.jsonl's lines
    `recs`: those are written before the new step's ranks log anything)."""
    out: dict[str, set[int]] = {}
    for r in journal.restarts(evs):
        if r.next_attempt >= 0:
            out.setdefault(r.job_id, set()).add(r.next_attempt)
    for rec in recs:
        if rec.get("in_job_restart_of") is not None and isinstance(rec.get("attempt"), int):
            out.setdefault(str(rec.get("job_id") or ""), set()).add(int(rec["attempt"]))
    return out


def _with_in_job_restarts(atts: list[dict[str, Any]], evs: list[run_events.Event]) -> list[dict[str, Any]]:
    """Rows of in-job restarts (hpctrain.fault.injob's `restart` events): each gets its step id, its own hosts
    and times (the step's launch to the restart's detection), the nodes a spare replaced, and the restart."""
    restarts = {(r.job_id, r.attempt): r for r in journal.restarts(evs)}
    if not restarts:
        return atts
    after = {(r.job_id, r.next_attempt): r for r in restarts.values()}
    out = []
    for a in atts:
        key = (str(a.get("job_id") or ""), int(a["attempt"]))
        row, ended, began = dict(a), restarts.get(key), after.get(key)
        if began is not None:
            row.update(step_id=began.next_step_id, started=began.launched,
                       nodes=",".join(began.hosts) or row.get("nodes"), replaced=dict(began.replaced))
            # The metrics split allows 5 s of clock skew before a start; every record of the ended step is
            # older than the restart's detection, so the split point is exact there.
            over = began.stopped or began.detected
            if over:
                row["_split"] = over + 5
        if ended is not None:
            replaced = ended.replaced
            row.update(step_id=ended.step_id, state=JobState.REQUEUED, ended=ended.detected or ended.time,
                       in_job_restart={"next_attempt": ended.next_attempt, "next_step_id": ended.next_step_id,
                                       "replaced": dict(ended.replaced), "hosts": list(ended.hosts),
                                       "restart": ended.restart, "budget": ended.budget,
                                       "class": ended.failure_class, "message": ended.message})
            if ended.step_hosts:
                row["nodes"] = ",".join(ended.step_hosts)
            row["_in_job_failure"] = (ended.failure_class, ended.message, next(iter(replaced), None))
        out.append(row)
    return out


def _with_rank_hosts(atts: list[dict[str, Any]], evs: list[run_events.Event]) -> list[dict[str, Any]]:
    """Each rank's host as its own events of that attempt name it (SLURMD_NODENAME on the rank)."""
    for row in atts:
        jid, k = str(row.get("job_id") or ""), int(row["attempt"])
        got = {e.rank: e.host for e in run_events.of_attempt(evs, k, jid) if e.rank is not None and e.host}
        if got:
            row["rank_hosts"] = {**(row.get("rank_hosts") or {}), **got}
    return atts


def views(base: list[dict[str, Any]], folder: Path, ranks_per_node: int = 1) -> list[AttemptView]:
    """`expand`'s rows as typed views (status, list, logs, watch); a missing folder leaves the base rows."""
    rows = expand(base, folder) if folder.is_dir() else [dict(a, how=SUBMITTED) for a in base]
    return [AttemptView.of(r, ranks_per_node) for r in rows]


def wait_reason(rows: list[dict[str, Any]], folder: Path) -> str:
    """Why the latest attempt waits in the queue, from the decision that queued it (attempts.jsonl): a host the
    retry could not exclude (SLURM will not place it on a DOWN node), or "" when nothing recorded one."""
    if not rows or str(rows[-1].get("state")) not in (JobState.PENDING, JobState.REQUEUE_HOLD):
        return ""
    jid = str(rows[-1].get("job_id") or "")
    for rec in reversed(journal.decisions(folder)):
        d, nxt = rec.decision, rec.next or {}
        if str(nxt.get("job_id") or "") == jid:
            kept = [str(h) for h in d.get("not_excluded") or []]
            notes = [str(n) for n in d.get("notes") or []]
            return "; ".join(notes) or (f"its nodes may include {', '.join(kept)}" if kept else "")
    return ""


def job_rows(attempts: Iterable[Any]) -> list[dict[str, Any]]:
    """The registry's attempts (hpctrain.runs.registry.Attempt) as the job-level rows `expand` takes."""
    return [{"attempt": a.attempt, "job_id": a.job_id, "state": a.state, "nodes": a.nodes, "submitted": a.submitted,
             "started": a.started, "ended": a.ended, "exit_code": a.exit_code, "failure_class": a.failure_class}
            for a in attempts]


def _float(v: Any) -> float | None:
    try:
        return float(v) if v is not None and v != "" else None
    except (TypeError, ValueError):
        return None
