"""`hpctrain resubmit RUN` and `hpctrain supervise RUN --job J` -- the fault-tolerance commands.

`register(group)` adds them to the main group (cli/main.py calls it). Only click at module level: the
policy, supervisor, registry and SLURM wrapper load inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click


def register(group: click.Group) -> None:
    group.add_command(resubmit_cmd)
    group.add_command(supervise_cmd)


def _run_dir(ref: str) -> tuple[Path, list[str]]:
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


@click.command("resubmit", short_help="Run a failed run again from its latest checkpoint.")
@click.argument("run")
@click.option("--exclude-failed-nodes", is_flag=True,
              help="Add the host(s) implicated in the last failure to --exclude (capped so the job still fits).")
@click.option("--exclude", "extra_exclude", default="", metavar="HOSTS",
              help="More hosts to exclude, comma-separated.")
@click.option("--max-retries", type=int, default=None,
              help="Automatic retries after this attempt (default: the run's launch.retries; 0 = none).")
@click.option("--time", "time_limit", default=None, help="New time limit (SLURM syntax, e.g. 02:00:00).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def resubmit_cmd(run: str, exclude_failed_nodes: bool, extra_exclude: str, max_retries: int | None,
                 time_limit: str | None, as_json: bool) -> None:
    """Submit a new attempt of RUN: same spec and run folder, a new SLURM job recorded as the next
    attempt; the ranks resume from the latest complete checkpoint. Refused while an attempt still runs."""
    import fcntl

    from hpctrain.errors import HpcUsageError, bad_value
    from hpctrain.fault import policy as pol
    from hpctrain.fault import supervisor as sup
    from hpctrain.runs import folder as runs_mod
    from hpctrain.spec.model import read_resolved
    from hpctrain.states import JobState, is_final

    if max_retries is not None and max_retries < 0:
        raise bad_value("--max-retries", max_retries, "cannot be negative", "pass --max-retries 0 or more")
    if time_limit is not None:
        from hpctrain.slurm.dispatch import time_minutes

        try:
            time_minutes(time_limit)
        except ValueError:
            raise bad_value("--time", time_limit, "not a SLURM time", "write MM, HH:MM:SS or D-HH:MM") from None
    run_dir, jobs = _run_dir(run)
    if not jobs:
        raise HpcUsageError(f"RUN = {run!r}: no attempt was ever submitted. Fix: use `hpctrain submit`")
    last_job = jobs[-1]
    with open(run_dir / ".supervise.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # never alongside the supervisor deciding the same job
        done = sup.already_decided(run_dir, last_job)
        if done and done["decision"].get("action") == "retry" and done.get("next"):
            nxt = done["next"]
            raise HpcUsageError(f"RUN = {run!r}: the supervisor already resubmitted job {last_job} as attempt "
                                f"{nxt['attempt']} (job {nxt['job_id']}). Fix: wait for it, or `hpctrain cancel` "
                                "the run first")
        hist, summary = sup.history(run_dir, last_job)
        row = summary["attempts"][-1] if summary["attempts"] else None
        # The last row is the job's current state: a REQUEUED job runs again, so it is not over yet.
        if row is not None and not is_final(row["state"]):
            raise HpcUsageError(f"RUN = {run!r}: attempt {row['attempt']} (job {row['job_id']}) is still "
                                f"{row['state']}. Fix: wait for it to end, or `hpctrain cancel {run}` first")
        if row is not None and row["state"] == JobState.COMPLETED and not row.get("failure_class"):
            raise HpcUsageError(
                f"RUN = {run!r}: attempt {row['attempt']} (job {row['job_id']}) COMPLETED at step "
                f"{row.get('last_step')}: training is done, a resubmission would resume at its last step and "
                "train nothing. Fix: to train longer, submit a new run with more --steps (`hpctrain submit "
                "RUN.toml --steps N`); to export the model, `hpctrain export`")
        spec = read_resolved(run_dir)
        exclude = list(spec.resources.exclude)
        exclude += [h.strip() for h in extra_exclude.split(",") if h.strip() and h.strip() not in exclude]
        notes: list[str] = []
        if exclude_failed_nodes and hist:
            import dataclasses

            last = dataclasses.replace(hist[-1], excluded=tuple(exclude))
            grown, added, kept, notes = pol.exclusions(last, pol.Policy(), sup.fit_of(spec))
            exclude = list(grown)
            if not added and not kept:
                cls = hist[-1].failure_class or "none"
                named = [h for h in hist[-1].implicated if h]
                notes.append(f"--exclude-failed-nodes: the last failure (attempt {hist[-1].attempt}, class {cls}) "
                             + (f"implicates {', '.join(named)}, already excluded" if named else "implicates no host")
                             + "; nothing more is excluded")
        elif exclude_failed_nodes:
            notes.append("--exclude-failed-nodes: no failed attempt to take hosts from; nothing more is excluded")
        ck = sup.latest_checkpoint(run_dir)
        out = sup.resubmit_run(run_dir, exclude=tuple(exclude), time_limit=time_limit, retries=max_retries,
                               record={"manual": True, "resubmitted_after": last_job,
                                       "reason": "hpctrain resubmit (by hand)"})
        runs_mod.RunFolder(run_dir).append_attempt({
            "job_id": last_job, "checkpoint_step": ck,
            "decision": {"action": "manual", "reason": f"resubmitted by hand as attempt {out['attempt']}"},
            "next": {"attempt": out["attempt"], "job_id": out["job_id"], "supervisor": out["supervisor"]}})
    out.update(resume_step=ck, notes=notes)
    _print(out, as_json)


def _print(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    resume = "the start" if out["resume_step"] is None else f"checkpoint step {out['resume_step']}"
    click.echo(f"resubmitted {out['run_id']}: attempt {out['attempt']}, job {out['job_id']}, resuming from {resume}")
    if out["excluded"]:
        click.echo(f"excluding {', '.join(out['excluded'])}")
    if out["supervisor"]:
        click.echo(f"supervisor job {out['supervisor']} (automatic retries on failure)")
    for n in out["notes"]:
        click.echo(f"note: {n}")


@click.command("supervise", short_help="(runs in the supervisor job) Decide what follows a finished attempt.")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--job", "job_id", required=True, help="The training job that ended.")
@click.option("--json", "as_json", is_flag=True, help="Print the decision as JSON.")
def supervise_cmd(run_dir: str, job_id: str, as_json: bool) -> None:
    """Collect the attempt that ended, apply the retry policy, and resubmit (new job + new supervisor)
    or stop with the reason. Submitted by `hpctrain submit` as `sbatch --dependency=afterany:JOB`;
    safe to run by hand and more than once (a job is decided once)."""
    from hpctrain.fault import supervisor as sup

    decision = sup.supervise(Path(run_dir), job_id)
    if as_json:
        click.echo(json.dumps(decision, indent=2))
