"""`submit`'s escape hatches and reproducibility options: --sbatch-arg, --after, --snapshot; --health-check.

Only click at module level. --sbatch-arg adds to the spec's `slurm.extra` (the flags layer: merged with the
site's and the run file's, a later layer's option replacing an earlier one of the same name); --after becomes
sbatch's --dependency for this submission only (hpctrain.slurm.after); --snapshot sets `code.snapshot`, and
hpctrain.slurm.submission copies the code into each run folder before dispatch and writes every run's repro bundle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def hatch_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Attach --sbatch-arg, --after, --snapshot and --health-check to `submit`."""
    opts = [
        click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="--OPTION[=VALUE]",
                     help="One more sbatch option, e.g. --sbatch-arg=--exclusive (repeatable; [slurm] extra)."),
        click.option("--after", "after", multiple=True, metavar="RUN[:ok|any]",
                     help="Start only after RUN's job succeeded (ok, the default) or ended (any); repeatable."),
        click.option("--snapshot", is_flag=True, default=None,
                     help="Copy the code into the run folder; the job runs that copy ([code] snapshot)."),
        click.option("--health-check/--no-health-check", "health_check", default=None,
                     help="Test every node (GPUs or CPU, network) before training; replace or exclude a failing "
                          "one ([fault] health_check)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


MAX_AFTER = 100  # --after given this many times at most (SLURM's dependency list is one line of the job)


def dependency(opts: dict[str, Any]) -> str:
    """--after -> sbatch's --dependency value ("" when none is left to wait for); notes on stderr."""
    refs = list(opts.get("after") or ())
    if not refs:
        return ""
    if len(refs) > MAX_AFTER:  # each is a registry lookup and a sacct query before anything is refused
        from hpctrain.errors import bad_value

        raise bad_value("--after", " ".join(refs), f"{len(refs):,} runs to wait for, more than the limit of "
                        f"{MAX_AFTER}", "wait for fewer runs (e.g. --after on the last run of a chain)")
    from hpctrain.slurm import after

    waits = after.resolve_waits(refs)
    for w in waits:
        if w.note:
            click.echo(f"note: --after {w.ref}: {w.note}", err=True)
    return after.dependency(waits)
