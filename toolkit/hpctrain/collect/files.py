"""Which log files belong to which run of a job, and which host each rank ran on.

A run's logs: logs/attempt-K.rank-R.log from the node (K = HPCTRAIN_ATTEMPT + SLURM_RESTART_COUNT),
and submitit's %j_%t_log.out/.err per task, appended by every run of a requeued job.

Stdlib only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.collect import logs as cl
from hpctrain.runs.folder import RunFolder
from hpctrain.states import JobState


def hosts_of(nodelist: str) -> list[str]:
    if not nodelist:
        return []
    try:
        from hpctrain.nodelist import expand

        return expand(nodelist)
    except Exception:  # noqa: BLE001 - a malformed nodelist: keep the plain names, never fail the collector
        return [h for h in nodelist.split(",") if h and "[" not in h]


def rank_hosts(job_files: list[cl.LogFile], nodelist: str, ranks_per_node: int) -> dict[int, str]:
    """rank -> host: submitit's JobEnvironment line is ground truth; SLURM's block distribution over
    the job's nodelist (ranks_per_node per host, in order) fills the rest."""
    from hpctrain.collect import classify as cc  # here: its regexes are only needed when logs are read

    out: dict[int, str] = {}
    hosts = hosts_of(nodelist)
    for f in job_files:
        if f.kind == "submitit" and f.rank is not None and f.rank not in out:
            src = cc.identify(cc.LogSource(f.path.name, cl.read_text(f.path, limit=16384)))
            if src.host:
                out[src.rank if src.rank is not None else f.rank] = src.host
    if hosts:
        per = max(1, ranks_per_node)
        for r in range(len(hosts) * per):
            out.setdefault(r, hosts[r // per])
    return out


def attempt_files(folder: Path, attempts: list[dict[str, Any]]) -> list[cl.LogFile]:
    """Every rank log and every submitit task log of the run's attempts."""
    jobs = {str(a.get("job_id")): int(a["attempt"]) for a in attempts if a.get("job_id")}
    run = RunFolder(folder)
    return cl.rank_log_files(run.logs_dir) + cl.submitit_log_files(run.submitit_dir, jobs)


def expand_requeues(atts: list[dict[str, Any]], files: list[cl.LogFile]) -> list[dict[str, Any]]:
    """One row per RUN of each job. The node numbers its logs attempt-K with K = HPCTRAIN_ATTEMPT (the
    attempt's base, set at resubmission) + SLURM_RESTART_COUNT, so a job that SLURM or submitit requeued
    leaves logs/attempt-K+1.. with no registry attempt of their own. Each becomes a row with the job's
    id; every run but the job's last is REQUEUED, timed by its own logs (sacct describes the latest
    run only). A row without a start time (the registry not refreshed yet) takes its logs' first time."""
    if not atts:
        return atts
    logs = {f.attempt for f in files if f.kind == "rank"}
    groups: list[tuple[str, list[dict[str, Any]]]] = []  # consecutive entries of one job id
    for a in sorted(atts, key=lambda a: int(a["attempt"])):
        jid = str(a.get("job_id"))
        if groups and groups[-1][0] == jid:
            groups[-1][1].append(a)
        else:
            groups.append((jid, [a]))
    out: list[dict[str, Any]] = []
    for i, (_, entries) in enumerate(groups):
        k0 = int(entries[0]["attempt"])
        k_next = int(groups[i + 1][1][0]["attempt"]) if i + 1 < len(groups) else 1 << 30
        nums = sorted({int(e["attempt"]) for e in entries} | {k for k in logs if k0 < k < k_next})
        job = dict(entries[0])
        for e in entries[1:]:  # later notes on the same job (a supervisor's record) fill in
            job.update({key: v for key, v in e.items() if v not in (None, "")})
        for k in nums:
            row = dict(job, attempt=k)
            mine = [f for f in files if f.attempt == k and f.kind == "rank"]
            if len(nums) > 1:
                row["_requeued"] = True
            if k != nums[-1]:
                first, last = _log_span(mine)
                row.update(state=JobState.REQUEUED, started=first, ended=last, exit_code=None, failure_class=None)
            elif row.get("started") is None and mine:
                row["started"] = _log_span(mine)[0]
            out.append(row)
    return out


def submitit_to_last_run(files: list[cl.LogFile], atts: list[dict[str, Any]]) -> list[cl.LogFile]:
    """submitit's %j_%t logs are appended by every run of a requeued job: give them to its last row,
    so an earlier run is judged by its own rank logs, not by what a later run printed."""
    last_of: dict[str, int] = {}
    first_of: dict[str, int] = {}
    for a in atts:
        job = str(a.get("job_id"))
        last_of[job] = int(a["attempt"])
        first_of.setdefault(job, int(a["attempt"]))
    moved = {first_of[j]: last_of[j] for j in last_of if last_of[j] != first_of[j]}
    if not moved:
        return files
    return [cl.LogFile(f.path, moved.get(f.attempt, f.attempt), f.rank, f.kind) if f.kind == "submitit" else f
            for f in files]


def _log_span(files: list[cl.LogFile]) -> tuple[float | None, float | None]:
    times = [t for f in files for t in (_first_time(f.path), cl.last_timestamp(cl.read_text(f.path, 1 << 20)))
             if t is not None]
    return (min(times), max(times)) if times else (None, None)


def _first_time(path: Path) -> float | None:
    for line in cl.read_text(path, limit=1 << 30)[:65536].splitlines():
        t = cl.parse_time(line)
        if t is not None:
            return t
    return None


def rel(path: Path, folder: Path) -> str:
    return str(path.relative_to(folder)) if folder in path.parents else path.name


def text_of(f: cl.LogFile, a: dict[str, Any], start: float | None) -> str:
    text = cl.read_text(f.path, limit=4 << 20)
    if f.kind == "submitit" and a.get("_requeued") and start is not None:
        text = cl.text_since(text, start)  # only this run's part of the job's shared submitit log
    return text
