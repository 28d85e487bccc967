"""A new attempt of a run, by hand: what `hpctrain resubmit RUN` (and the Python API) does, below the CLI.

The checks come first (no attempt still running, none of unknown outcome, not a completed run, the supervisor
has not resubmitted it already), then the exclusions (`--exclude-failed-nodes` grows them from the last
failure, hpctrain.fault.policy), then the one Submission (hpctrain.fault.supervisor.resubmit_run ->
hpctrain.slurm.submission), all under the run's supervise lock: never beside the supervisor deciding the same job.
"""

from __future__ import annotations

import dataclasses
import fcntl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpctrain.errors import HpcUsageError, bad_value
from hpctrain.fault import policy as pol
from hpctrain.fault import supervisor as sup
from hpctrain.runs import folder as runs_mod
from hpctrain.runs import journal
from hpctrain.states import JobState, is_final


def run_folder(ref: str) -> tuple[Path, list[str]]:
    """(run folder, job ids of its attempts) from a run reference (hpctrain.runs.resolve); submissions of unknown
    outcome established by their tag first (hpctrain.slurm.uncertain.establish refuses while one stays
    unknown: a job may run that a resubmission would double), states refreshed."""
    from hpctrain.runs.registry import Registry
    from hpctrain.runs.resolve import resolve_run
    from hpctrain.slurm.refresh import refresh
    from hpctrain.slurm.uncertain import establish

    reg = Registry()
    found = resolve_run(reg, ref)
    if found.run is None:
        jobs = [str(r["job_id"]) for r in runs_mod.RunFolder(found.folder).read_attempts() if r.get("job_id")]
        return found.folder, list(dict.fromkeys(jobs))
    establish(reg, found.run, "resubmits")
    refresh(reg, [found.run])
    if not found.folder.is_dir():
        raise HpcUsageError(f"RUN = {ref!r}: its folder {found.folder} is missing. Fix: resubmit needs the run "
                            "folder (spec, checkpoints) on this filesystem")
    return found.folder, [a.job_id for a in found.run.attempts if a.job_id]


def resubmit_by_hand(ref: str, *, exclude_failed_nodes: bool = False, exclude: Sequence[str] = (),
                     max_retries: int | None = None, time_limit: str | None = None, nodes: int | None = None,
                     tasks_per_node: int | None = None) -> dict[str, Any]:
    """Submit a new attempt of the run `ref` names: same spec and run folder, a new job recorded as the next
    attempt; the ranks resume from the latest complete checkpoint. Returns what was submitted (run_id, attempt,
    job_id, excluded, time, supervisor, resume_step, notes). Refused while an attempt may still run."""
    if max_retries is not None and max_retries < 0:
        raise bad_value("--max-retries", max_retries, "cannot be negative", "pass --max-retries 0 or more")
    if time_limit is not None:
        from hpctrain.slurm.dispatch import time_minutes

        try:
            time_minutes(time_limit)
        except ValueError:
            raise bad_value("--time", time_limit, "not a SLURM time", "write MM, HH:MM:SS or D-HH:MM") from None
    run_dir, jobs = run_folder(ref)
    if not jobs:
        raise HpcUsageError(f"RUN = {ref!r}: no attempt was ever submitted. Fix: use `hpctrain submit`")
    last_job = jobs[-1]
    with open(run_dir / ".supervise.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # never alongside the supervisor deciding the same job
        hist = _check_resubmittable(ref, run_dir, last_job)
        excluded, notes = _exclusions(run_dir, hist, exclude_failed_nodes, exclude)
        ck = sup.latest_checkpoint(run_dir)
        out = sup.resubmit_run(run_dir, exclude=tuple(excluded), time_limit=time_limit, retries=max_retries,
                               nodes=nodes, tasks_per_node=tasks_per_node,
                               record={"manual": True, "resubmitted_after": last_job,
                                       "reason": "hpctrain resubmit (by hand)"})
        journal.write_decision(run_dir, journal.SupervisorDecision(
            job_id=last_job, checkpoint_step=ck,
            decision={"action": "manual", "reason": f"resubmitted by hand as attempt {out['attempt']}"},
            next={"attempt": out["attempt"], "job_id": out["job_id"], "supervisor": out["supervisor"]}))
    return {**out, "resume_step": ck, "notes": notes}


def _check_resubmittable(ref: str, run_dir: Path, last_job: str) -> list[pol.AttemptRecord]:
    """The run's attempt history, once it is clear that a new attempt is wanted and safe."""
    done = sup.already_decided(run_dir, last_job)
    if done and done.action == "retry" and done.next:
        nxt = done.next
        raise HpcUsageError(f"RUN = {ref!r}: the supervisor already resubmitted job {last_job} as attempt "
                            f"{nxt['attempt']} (job {nxt['job_id']}). Fix: wait for it, or `hpctrain cancel` "
                            "the run first")
    hist, summary = sup.history(run_dir, last_job)
    row = summary["attempts"][-1] if summary["attempts"] else None
    # The last row is the job's current state: a REQUEUED job runs again, so it is not over yet.
    if row is not None and not is_final(row["state"]):
        raise HpcUsageError(f"RUN = {ref!r}: attempt {row['attempt']} (job {row['job_id']}) is still "
                            f"{row['state']}. Fix: wait for it to end, or `hpctrain cancel {ref}` first")
    if row is not None and row["state"] == JobState.COMPLETED and not row.get("failure_class"):
        raise HpcUsageError(
            f"RUN = {ref!r}: attempt {row['attempt']} (job {row['job_id']}) COMPLETED at step "
            f"{row.get('last_step')}: training is done, a resubmission would resume at its last step and "
            "train nothing. Fix: to train longer, submit a new run with more --steps (`hpctrain submit "
            "RUN.toml --steps N`); to export the model, `hpctrain export`")
    return hist


def _exclusions(run_dir: Path, hist: list[pol.AttemptRecord], from_failure: bool,
                extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """The hosts the new attempt excludes (spec's, `extra`, and with `from_failure` the last failure's, capped so
    the job still fits) and notes saying what --exclude-failed-nodes did."""
    from hpctrain.spec.model import read_resolved

    spec = read_resolved(run_dir)
    exclude = list(spec.resources.exclude)
    exclude += [h.strip() for h in extra if h.strip() and h.strip() not in exclude]
    notes: list[str] = []
    if from_failure and hist:
        last = dataclasses.replace(hist[-1], excluded=tuple(exclude))
        grown, added, kept, notes = pol.exclusions(last, pol.Policy(), sup.fit_of(spec))
        exclude = list(grown)
        if not added and not kept:
            cls = hist[-1].failure_class or "none"
            named = [h for h in hist[-1].implicated if h]
            notes.append(f"--exclude-failed-nodes: the last failure (attempt {hist[-1].attempt}, class {cls}) "
                         + (f"implicates {', '.join(named)}, already excluded" if named else "implicates no host")
                         + "; nothing more is excluded")
    elif from_failure:
        notes.append("--exclude-failed-nodes: no failed attempt to take hosts from; nothing more is excluded")
    return exclude, notes
