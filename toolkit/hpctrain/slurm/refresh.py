"""Job-state refresh: bring a run's attempts in the registry up to date from SLURM or the local executor.

Below the CLI so that `hpctrain list/status/cancel`, the collector and the fault commands share it. One
sacct call covers every unfinished SLURM attempt in view; settled final states stay cached in the registry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import click

from hpctrain import slurmcommands as commands
from hpctrain.runs.folder import RunFolder, append_attempt, read_attempts
from hpctrain.runs.registry import Registry, Run
from hpctrain.slurm.dispatch import local_state
from hpctrain.slurm.localctl import read_exit_code
from hpctrain.states import is_final


def refresh(reg: Registry, runs: list[Run]) -> list[str]:
    """Bring non-final attempts up to date: ONE sacct call for all SLURM jobs, /proc for local ones.

    Finished attempts are not asked about again once settled (SETTLE_S after their end): their
    state is cached in the registry.
    Returns warnings (e.g. sacct unavailable) instead of failing: cached states are still useful.
    """
    now = time.time()
    pending = [(r, a) for r in runs for a in r.attempts if _unsettled(r.executor, a, now)]
    if not pending:
        return []
    warnings: list[str] = []
    fresh: dict[str, dict[str, Any]] = {}
    runs_of: dict[str, list[dict[str, Any]]] = {}  # a requeued job's runs, each with its own hosts and times
    slurm_ids = [a.job_id for r, a in pending if r.executor == "slurm"]
    if slurm_ids:
        try:
            for jid, rec in commands.sacct_states(slurm_ids).items():
                fresh[jid] = {"state": rec.state, "nodes": rec.nodelist, "started": rec.start,
                              "ended": rec.end, "exit_code": rec.exit_code or None}
                if len(rec.runs) > 1:
                    runs_of[jid] = [dataclasses.asdict(r) for r in rec.runs]
        except click.ClickException as exc:
            warnings.append(f"states may be stale: {exc.format_message()}")
    updates = []
    for run, att in pending:
        if run.executor == "local":
            # The reason (e.g. "see 123_0_result.pkl") is for humans; collect assigns failure classes.
            state, _ = local_state(Path(run.folder), att.job_id)
            fields: dict[str, Any] = {"state": state}
            if is_final(state):
                fields.update(_local_end(Path(run.folder), att.job_id))
        elif att.job_id in fresh:
            fields = {k: v for k, v in fresh[att.job_id].items() if v not in (None, "")}
        else:
            continue  # sacct does not know it yet (just submitted): keep what we have
        changed = {k: v for k, v in fields.items() if getattr(att, k) != v}
        if att.job_id in runs_of and not is_final(str(fields.get("state", att.state))):
            _record_runs(run, att, runs_of[att.job_id])  # known while the job runs again (status, logs)
        if not changed:
            continue
        updates.append((run.run_id, att.attempt, changed))
        for k, v in changed.items():
            setattr(att, k, v)
        run.state = run.attempts[-1].state
        if att.final:
            line = {"attempt": att.attempt, "job_id": att.job_id, "state": att.state, "nodes": att.nodes,
                   "started": att.started, "ended": att.ended, "exit_code": att.exit_code,
                   "failure_class": att.failure_class,
                   **({"sacct_runs": runs_of[att.job_id]} if att.job_id in runs_of else {})}
            with contextlib.suppress(OSError):  # the run folder may be gone; the registry still has it
                append_attempt(RunFolder(run.folder).attempts_jsonl, line)
    reg.update_attempts(updates)
    return warnings


def _local_end(folder: Path, job_id: str) -> dict[str, Any]:
    """An ended local job's end time and, where its controller recorded one, its exit code (sacct's form)."""
    fields: dict[str, Any] = {"ended": time.time()}
    code = read_exit_code(RunFolder(folder).submitit_dir, job_id)
    if code is not None:
        fields["exit_code"] = code
    return fields


def _record_runs(run: Run, att: Any, runs: list[dict[str, Any]]) -> None:
    """The runs of a requeued job as sacct -D lists them (hpctrain.runs.history gives each its own hosts, start,
    end and state), into attempts.jsonl once per change: only a job SLURM requeued reads the file here."""
    path = RunFolder(run.folder).attempts_jsonl
    try:
        known = [r.get("sacct_runs") for r in read_attempts(path) if str(r.get("job_id")) == att.job_id]
        if runs not in known:
            append_attempt(path, {"attempt": att.attempt, "job_id": att.job_id, "sacct_runs": runs})
    except OSError:
        pass  # the run folder may be gone; the registry still has it


# slurmdbd can report a just-finished job as COMPLETED before its record is whole (seen: a 4-node
# job listed on "node1" for a moment), so a SLURM attempt is re-read for this long after it ends.
SETTLE_S = 60.0


def _unsettled(executor: str, att: Any, now: float) -> bool:
    if not att.final:
        return True
    return executor == "slurm" and (att.ended is None or now - att.ended < SETTLE_S)
