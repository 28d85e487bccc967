"""Which log files belong to which run of a job, and which host each rank ran on.

A run's logs: logs/attempt-K.rank-R.log from the node (K = HPCTRAIN_ATTEMPT + SLURM_RESTART_COUNT),
and submitit's %j_%t_log.out/.err per task, appended by every run of a requeued job.

Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain.collect import logs as cl
from hpctrain.runs.folder import RunFolder
from hpctrain.runs.history import hosts_of


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


def log_sources(folder: Path, attempts: list[dict[str, Any]], ranks_per_node: int
                ) -> tuple[Callable[[], list[cl.LogFile]], Callable[[cl.LogFile], str]]:
    """(list the files now, host of a file) for `hpctrain logs`: rank logs, plus submitit's logs for attempts
    that have no rank log (the job died before the node started logging). Each attempt's hosts are its placement
    as every report sees it (hpctrain.runs.history): an in-job restart's or a requeue's ranks ran where their own
    events say, not on the job's first nodelist."""
    from hpctrain.runs import history

    hosts: dict[tuple[int, int], str] = {}

    def list_files() -> list[cl.LogFile]:
        files = attempt_files(folder, attempts)
        with_rank_logs = {f.attempt for f in files if f.kind == "rank"}
        chosen = [f for f in files if f.kind == "rank" or f.attempt not in with_rank_logs]
        new = {f.attempt for f in chosen} - {a for a, _ in hosts}
        if new:
            rows = {int(r["attempt"]): r for r in history.expand(attempts, folder)}
            for k in new:
                row = rows.get(k, {"attempt": k})
                got = rank_hosts([f for f in files if f.attempt == k], str(row.get("nodes") or ""), ranks_per_node)
                got.update({int(r): str(h) for r, h in (row.get("rank_hosts") or {}).items()})
                hosts.update({(k, r): h for r, h in got.items()})
        return chosen

    def host_of(f: cl.LogFile) -> str:
        return hosts.get((f.attempt, f.rank if f.rank is not None else -1), "")

    return list_files, host_of


def attempt_files(folder: Path, attempts: list[dict[str, Any]]) -> list[cl.LogFile]:
    """Every rank log and every submitit task log of the run's attempts."""
    jobs = {str(a.get("job_id")): int(a["attempt"]) for a in attempts if a.get("job_id")}
    run = RunFolder(folder)
    return cl.rank_log_files(run.logs_dir) + cl.submitit_log_files(run.submitit_dir, jobs)


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


def log_span(files: list[cl.LogFile]) -> tuple[float | None, float | None]:
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
