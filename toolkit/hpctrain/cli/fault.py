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


@click.command("resubmit", short_help="Run a failed run again from its latest checkpoint.")
@click.argument("run")
@click.option("--exclude-failed-nodes", is_flag=True,
              help="Add the host(s) implicated in the last failure to --exclude (capped so the job still fits).")
@click.option("--exclude", "extra_exclude", default="", metavar="HOSTS",
              help="More hosts to exclude, comma-separated.")
@click.option("--max-retries", type=int, default=None,
              help="Automatic retries after this attempt (default: the run's launch.retries; 0 = none).")
@click.option("--time", "time_limit", default=None, help="New time limit (SLURM syntax, e.g. 02:00:00).")
@click.option("--nodes", type=int, default=None,
              help="Another number of nodes: the ranks resume through a universal checkpoint.")
@click.option("--tasks-per-node", type=int, default=None,
              help="Another number of ranks a node (CPU ranks; one per GPU on GPUs).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def resubmit_cmd(run: str, exclude_failed_nodes: bool, extra_exclude: str, max_retries: int | None,
                 time_limit: str | None, nodes: int | None, tasks_per_node: int | None, as_json: bool) -> None:
    """Submit a new attempt of RUN: same spec and run folder, a new SLURM job recorded as the next
    attempt; the ranks resume from the latest complete checkpoint. Refused while an attempt still runs."""
    from hpctrain.api.resubmitting import resubmit

    done = resubmit(run, exclude_failed_nodes=exclude_failed_nodes, exclude=extra_exclude.split(","),
                    max_retries=max_retries, time_limit=time_limit, nodes=nodes, tasks_per_node=tasks_per_node)
    _print(done.to_dict(), as_json)


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
