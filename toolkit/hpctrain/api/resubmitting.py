"""`Run.resubmit()` and `hpctrain resubmit RUN`: attempt K+1 of a run, by hand, through the same Submission.

Refused while an attempt still runs, after the supervisor already resubmitted the same job, after a run that
completed its training, and while a submission's outcome is unknown (a job may exist). The new attempt resumes
from the latest complete checkpoint; its supervisor job is armed as for any submission (fault.supervisor).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Resubmitted:
    """The new attempt: its number and job, the hosts it excludes, its time limit, the supervisor job armed for
    it (None: no retries, or a local run), the checkpoint step it resumes from (None: the start), notes."""

    run_id: str
    run_dir: Path
    attempt: int
    job_id: str
    excluded: list[str]
    supervisor: str | None
    resume_step: int | None
    notes: list[str] = field(default_factory=list)
    answer: dict[str, Any] = field(default_factory=dict, repr=False)  # the supervisor's resubmit_run answer

    def to_dict(self) -> dict[str, Any]:
        """What `hpctrain resubmit --json` prints: resubmit_run's answer (run, attempt, job, excluded, time,
        supervisor) with the resume step and the notes."""
        return {**self.answer, "resume_step": self.resume_step, "notes": self.notes}


def run_dir(ref: str) -> tuple[Path, list[str]]:
    """(run folder, job ids of its attempts) from a run reference (hpctrain.runs.resolve); states refreshed."""
    from hpctrain.errors import HpcUsageError
    from hpctrain.runs.folder import RunFolder
    from hpctrain.runs.registry import Registry
    from hpctrain.runs.resolve import resolve_run
    from hpctrain.slurm.refresh import refresh
    from hpctrain.slurm.uncertain import establish

    reg = Registry()
    found = resolve_run(reg, ref)
    if found.run is None:
        jobs = [str(r["job_id"]) for r in RunFolder(found.folder).read_attempts() if r.get("job_id")]
        return found.folder, list(dict.fromkeys(jobs))
    # A submission of unknown outcome may have a job: never start a second one beside it.
    establish(reg, found.run, "resubmits")
    refresh(reg, [found.run])
    if not found.folder.is_dir():
        raise HpcUsageError(f"RUN = {ref!r}: its folder {found.folder} is missing. Fix: resubmit needs the run "
                            "folder (spec, checkpoints) on this filesystem")
    return found.folder, [a.job_id for a in found.run.attempts]


def _check_args(max_retries: int | None, time_limit: str | None) -> None:
    from hpctrain.errors import bad_value

    if max_retries is not None and max_retries < 0:
        raise bad_value("--max-retries", max_retries, "cannot be negative", "pass --max-retries 0 or more")
    if time_limit is not None:
        from hpctrain.slurm.dispatch import time_minutes

        try:
            time_minutes(time_limit)
        except ValueError:
            raise bad_value("--time", time_limit, "not a SLURM time", "write MM, HH:MM:SS or D-HH:MM") from None


def resubmit(ref: str | os.PathLike[str], *, exclude_failed_nodes: bool = False, exclude: Sequence[str] = (),
             max_retries: int | None = None, time_limit: str | None = None) -> Resubmitted:
    """Submit a new attempt of the run `ref` names: same spec and run folder, a new SLURM job recorded as the next
    attempt. `exclude` adds hosts to the run's exclusions; `exclude_failed_nodes` adds the hosts the last
    failure implicates (capped so the job still fits); `max_retries` and `time_limit` replace the run's."""
    import fcntl

    from hpctrain.errors import HpcUsageError
    from hpctrain.fault import supervisor as sup
    from hpctrain.runs import folder as runs_mod

    ref = os.fspath(ref)
    _check_args(max_retries, time_limit)
    folder, jobs = run_dir(ref)
    if not jobs:
        raise HpcUsageError(f"RUN = {ref!r}: no attempt was ever submitted. Fix: use `hpctrain submit`")
    last_job = jobs[-1]
    with open(folder / ".supervise.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # never alongside the supervisor deciding the same job
        hist = _refuse_unless_over(ref, folder, last_job)
        hosts, notes = _exclusions(folder, hist, exclude, exclude_failed_nodes)
        ck = sup.latest_checkpoint(folder)
        out = sup.resubmit_run(folder, exclude=tuple(hosts), time_limit=time_limit, retries=max_retries,
                               record={"manual": True, "resubmitted_after": last_job,
                                       "reason": "hpctrain resubmit (by hand)"})
        runs_mod.RunFolder(folder).append_attempt({
            "job_id": last_job, "checkpoint_step": ck,
            "decision": {"action": "manual", "reason": f"resubmitted by hand as attempt {out['attempt']}"},
            "next": {"attempt": out["attempt"], "job_id": out["job_id"], "supervisor": out["supervisor"]}})
    return Resubmitted(run_id=str(out["run_id"]), run_dir=folder, attempt=int(out["attempt"]),
                       job_id=str(out["job_id"]), excluded=list(out["excluded"]), supervisor=out["supervisor"],
                       resume_step=ck, notes=notes, answer=dict(out))


def _refuse_unless_over(ref: str, folder: Path, last_job: str) -> list[Any]:
    """The run's failure history, once sure a resubmission makes sense: the last attempt ended, not by
    completing its training, and no supervisor resubmitted it already."""
    from hpctrain.errors import HpcUsageError
    from hpctrain.fault import supervisor as sup
    from hpctrain.states import JobState, is_final

    done = sup.already_decided(folder, last_job)
    if done and done["decision"].get("action") == "retry" and done.get("next"):
        nxt = done["next"]
        raise HpcUsageError(f"RUN = {ref!r}: the supervisor already resubmitted job {last_job} as attempt "
                            f"{nxt['attempt']} (job {nxt['job_id']}). Fix: wait for it, or `hpctrain cancel` "
                            "the run first")
    hist, summary = sup.history(folder, last_job)
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
    return list(hist)


def _exclusions(folder: Path, hist: list[Any], extra: Sequence[str], failed_nodes: bool) -> tuple[list[str], list[str]]:
    """(hosts the new attempt excludes, notes): the run's own, `extra`, and with `failed_nodes` the hosts the last
    failure implicates (hpctrain.fault.policy.exclusions: capped so the job still fits)."""
    import dataclasses

    from hpctrain.fault import policy as pol
    from hpctrain.fault import supervisor as sup
    from hpctrain.spec.model import read_resolved

    spec = read_resolved(folder)
    exclude = list(spec.resources.exclude)
    exclude += [h.strip() for h in extra if h.strip() and h.strip() not in exclude]
    notes: list[str] = []
    if failed_nodes and hist:
        last = dataclasses.replace(hist[-1], excluded=tuple(exclude))
        grown, added, kept, notes = pol.exclusions(last, pol.Policy(), sup.fit_of(spec))
        exclude = list(grown)
        if not added and not kept:
            cls = hist[-1].failure_class or "none"
            named = [h for h in hist[-1].implicated if h]
            notes.append(f"--exclude-failed-nodes: the last failure (attempt {hist[-1].attempt}, class {cls}) "
                         + (f"implicates {', '.join(named)}, already excluded" if named else "implicates no host")
                         + "; nothing more is excluded")
    elif failed_nodes:
        notes.append("--exclude-failed-nodes: no failed attempt to take hosts from; nothing more is excluded")
    return exclude, list(notes)
