"""Submissions whose outcome is unknown: sbatch timed out, was killed, or answered without a job id.

The job may be queued, so nothing is removed: the run is recorded as SUBMIT_UNKNOWN with the tag
its job carries in `--comment`, and `reconcile` (run by `list`/`status`/`cancel`) later finds the
job by that tag in squeue/sacct -> its real id and state, or, when SLURM has no such job after a
grace period, SUBMIT_FAILED with the reason.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from hpctrain import slurmcommands as _slurm
from hpctrain.runs import folder as runs_mod

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.runs.registry import Attempt, Registry, Run


class JobMayExist(click.ClickException):
    """A submit failed after sbatch may have queued (or did queue) the job: the caller must keep the
    run folders, which the job runs in."""


class SubmitUncertain(JobMayExist):
    """sbatch may have queued the job: the run is kept and recorded as SUBMIT_UNKNOWN (exit 75,
    EX_TEMPFAIL: a script must not simply submit again)."""

    exit_code = 75


def submission_tag(run_dirs: Sequence[Path], attempt: int = 0) -> str:
    """The job's --comment, what `reconcile` finds an unanswered submission by: the (first) run id, and for a
    resubmission its attempt number too (attempt 3's job is never taken for attempt 2's, still in squeue)."""
    return f"hpctrain:{Path(run_dirs[0]).name}" + (f":{attempt}" if attempt else "")


def record_unknown(dirs: list[Path], name: str, summary: dict[str, Any], mode: str, exc: Any, attempt: int = 0,
                   record: dict[str, Any] | None = None) -> SubmitUncertain:
    """Keep the run folder(s) and record each run as SUBMIT_UNKNOWN, with the submission's tag, in
    attempts.jsonl and the registry (`name`, `summary`: what dispatch records for a queued run);
    returns the error to raise (it says what to do)."""
    from hpctrain.runs.registry import SUBMIT_UNKNOWN, Attempt, Registry

    now, tag, reason = time.time(), submission_tag(dirs), str(exc.reason)
    attempts = [Attempt(run_id=d.name, attempt=attempt, job_id="", state=SUBMIT_UNKNOWN, submitted=now,
                        note=reason, tag=tag) for d in dirs]
    for i, d in enumerate(dirs):
        pickle = exc.kept[i] if i < len(exc.kept) else None
        runs_mod.append_attempt(runs_mod.RunFolder(d).attempts_jsonl,
                                {**(record or {}), "attempt": attempt, "job_id": "", "state": SUBMIT_UNKNOWN,
                                 "submitted": now, "executor": "slurm", "mode": mode, "note": reason,
                                 "tag": tag, "pickle": pickle})
    recorded = ""
    try:
        reg = Registry()
        if attempt:
            reg.add_attempt(attempts[0])
        else:
            reg.add_submitted_many([({"run_id": d.name, "name": name, "folder": str(d), "executor": "slurm",
                                      "created": now, "spec": {**summary, "array_index": i if len(dirs) > 1 else None}},
                                     a) for i, (d, a) in enumerate(zip(dirs, attempts, strict=True))])
    except Exception as rexc:  # noqa: BLE001 - attempts.jsonl holds the record; `registry rebuild` reads it
        recorded = f" (the registry could not record it: {rexc}; `hpctrain registry rebuild` will)"
    first = dirs[0].name
    return SubmitUncertain(
        f"run {first}{f' and {len(dirs) - 1} more' if len(dirs) > 1 else ''}: {reason}. The job may or may "
        f"not be queued, so its run folder is kept and the run is recorded as {SUBMIT_UNKNOWN}{recorded}. "
        f"Fix: do not submit it again; `hpctrain status {first}` finds the job by its comment {tag} once "
        f"SLURM lists it, or marks the run SUBMIT_FAILED if SLURM never does (`squeue --me -o '%i %k'` shows "
        "comments too)")


class UnknownOutcome(SubmitUncertain):
    """An action (cancel, resubmit) refused because a submission's outcome could not be established: a job may
    be queued that hpctrain cannot name, so acting as if there were none (or one) would be a claim it cannot make."""


def establish(reg: Registry, run: Run, action: str) -> list[str]:
    """Before acting on `run` (`action`: "cancels", "resubmits"): its submissions of unknown outcome resolved by
    their tag (`reconcile`). Raises UnknownOutcome, naming the attempt, its tag and what to do, when one stays
    unknown (SLURM could not be asked, or lists no job with the tag yet); returns reconcile's warnings."""
    from hpctrain.runs.registry import SUBMIT_UNKNOWN

    warnings = reconcile(reg, [run])
    left = [a for a in run.attempts if a.state == SUBMIT_UNKNOWN and run.executor == "slurm"]
    if not left:
        return warnings
    att = left[-1]
    asked = [w for w in warnings if w.startswith("could not look up")]
    age = time.time() - (att.submitted or time.time())
    why = (asked[0].replace("could not look up submissions of unknown outcome: ", "SLURM could not be asked: ")
           if asked else f"SLURM lists no job with that comment yet ({age:.0f}s after the submission; it counts as "
           f"not queued {grace_s():.0f}s after)")
    _refuse(run, att, why, action)


def _refuse(run: Run, att: Attempt, why: str, action: str) -> NoReturn:
    tag = _tag(run, att)
    raise UnknownOutcome(
        f"RUN = {run.run_id!r}: attempt {att.attempt} was submitted with an unknown outcome ({att.note}), and {why}. "
        f"A job tagged {tag} may be queued or running, so hpctrain {action} nothing. Fix: `hpctrain status "
        f"{run.run_id}` again once SLURM answers (it finds the job by its comment, or marks the attempt "
        f"SUBMIT_FAILED); `squeue --me -o '%i %k'` lists your jobs with their comments")


def drop_pickles(pickles: list[Path], exc: BaseException) -> None:
    """A failed sbatch leaves no pickle behind, unless it may have queued the job: the job needs its
    pickle, so it is kept and `reconcile` renames it to the job id it finds."""
    if isinstance(exc, _slurm.SubmitUnknown):
        exc.kept = [str(p) for p in pickles]
        return
    for p in pickles:
        p.unlink(missing_ok=True)


def grace_s() -> float:
    """How long after an unanswered sbatch SLURM may still not list the job before it counts as not
    queued ($HPCTRAIN_SUBMIT_GRACE_S; squeue keeps a finished job for MinJobAge, 300 s by default)."""
    return float(os.environ.get("HPCTRAIN_SUBMIT_GRACE_S", "300"))


def reconcile(reg: Registry, runs: list[Run]) -> list[str]:
    """Resolve the SUBMIT_UNKNOWN attempts of `runs` (in place and in the registry): ONE squeue (and at
    most one sacct) call for all of them. Returns warnings; a SLURM that does not answer changes nothing."""
    from hpctrain.runs.registry import SUBMIT_UNKNOWN

    todo = [(r, a) for r in runs for a in r.attempts if a.state == SUBMIT_UNKNOWN and r.executor == "slurm"]
    if not todo:
        return []
    now = time.time()
    try:
        found = _slurm.jobs_by_comment({_tag(r, a) for r, a in todo},
                                       since=min(a.submitted or now for _, a in todo))
    except click.ClickException as exc:
        return [f"could not look up submissions of unknown outcome: {exc.format_message()}"]
    updates = []
    for run, att in todo:
        fields = _resolution(run, att, found.get(_tag(run, att)), now)
        if fields is None:
            continue
        for k, v in fields.items():
            setattr(att, k, v)
        run.state = run.attempts[-1].state
        updates.append((run.run_id, att.attempt, fields))
        with contextlib.suppress(OSError):  # the folder may be gone; the registry still has the answer
            runs_mod.append_attempt(runs_mod.RunFolder(run.folder).attempts_jsonl,
                                    {"attempt": att.attempt, **fields})
    return reg.cache_updates(updates)


def reconcile_all(reg: Registry) -> list[str]:
    """Every run of the registry with a submission of unknown outcome, resolved by its tag (what `hpctrain
    registry rebuild` does after importing run folders: a submitter killed after sbatch left only its intent).
    Returns one line per such attempt (its state now, and its job when found), then reconcile's warnings."""
    from hpctrain.runs.registry import SUBMIT_UNKNOWN

    runs = [r for r in reg.list_runs(limit=None) if any(a.state == SUBMIT_UNKNOWN for a in r.attempts)]
    todo = {(r.run_id, a.attempt) for r in runs for a in r.attempts if a.state == SUBMIT_UNKNOWN}
    warnings = reconcile(reg, runs) if runs else []
    lines = [f"run {r.run_id}, attempt {a.attempt}: {a.state}{f' (job {a.job_id})' if a.job_id else ''}: {a.note}"
             for r in runs for a in r.attempts if (r.run_id, a.attempt) in todo]
    return lines + [f"warning: {w}" for w in warnings]


def _tag(run: Run, att: Attempt) -> str:
    return att.tag or f"hpctrain:{run.run_id}"


def _resolution(run: Run, att: Attempt, hit: tuple[str, str] | None, now: float) -> dict[str, Any] | None:
    from hpctrain.runs.registry import SUBMIT_FAILED

    tag = _tag(run, att)
    if hit is not None:
        main, state = hit
        index = run.spec.get("array_index")
        job_id = main if index is None else f"{main}_{index}"
        _claim_pickle(run, att, job_id)
        # An array's squeue line is one task's state; sacct (refresh) gives each task its own.
        return {"job_id": job_id, "state": state if index is None else "PENDING",
                "note": f"found by its comment {tag} after: {att.note}"}
    waited = now - (att.submitted or now)
    if waited < grace_s():
        return None
    return {"state": SUBMIT_FAILED, "ended": now,
            "note": f"{att.note}; SLURM lists no job with comment {tag} {waited:.0f}s later, so it was not "
                    f"queued. Fix: submit it again"}


def _claim_pickle(run: Run, att: Attempt, job_id: str) -> None:
    """Give the kept pickle the job id's name, where submitit on the node looks for it."""
    lines = [ln for ln in runs_mod.RunFolder(run.folder).read_attempts()
             if ln.get("attempt") == att.attempt and ln.get("pickle")]
    if not lines:
        return
    src = Path(str(lines[-1]["pickle"]))
    dst = runs_mod.RunFolder(run.folder).submitit_dir / f"{job_id}_submitted.pkl"
    with contextlib.suppress(OSError):  # the job then fails without its pickle; its state says so
        if src.is_file() and not dst.exists():
            src.rename(dst)
