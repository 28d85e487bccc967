"""`submit`'s escape hatches and reproducibility options: --sbatch-arg, --after, --snapshot; --health-check.

Only click at module level. --sbatch-arg adds to the spec's `slurm.extra` (the flags layer: merged with the
site's and the run file's, a later layer's option replacing an earlier one of the same name); --after becomes
sbatch's --dependency for this submission only (hpctrain.slurm.after); --snapshot sets `code.snapshot`, and
`prepare_runs` copies the code into each run folder before dispatch and writes every run's repro bundle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from hpctrain.plan.planner import Plan
    from hpctrain.spec.model import Spec


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


def prepare_runs(points: list[tuple[Spec, Plan]], run_dirs: list[Path]) -> list[tuple[Spec, Plan]]:
    """Before dispatch: the snapshot (when asked; one for a sweep, which has one launch line) and every run's
    repro bundle. Returns the points with `code.dir` set when a snapshot was made (spec.toml rewritten)."""
    from hpctrain.render.containers import image_identity
    from hpctrain.runs import folder as runs
    from hpctrain.runs import repro, snapshot
    from hpctrain.spec.model import to_toml

    spec = points[0][0]
    # The code is the user's script's (submit --script), else the submit directory's.
    script = Path(spec.launch.script) if spec.launch.script else None
    src = script.parent if script is not None else Path.cwd()
    snap_info = None
    if spec.code.snapshot:
        workdir = snapshot.snapshot_code(src, run_dirs[0], spec.secret_env)
        snap_info = snapshot.describe(src, run_dirs[0], workdir)

        def moved(s: Spec) -> Spec:
            launch = s.launch
            if script is not None:  # the job runs the copy of the script: edits after submit do not reach it
                launch = dataclasses.replace(launch, script=str(workdir / script.name))
            return dataclasses.replace(s, code=dataclasses.replace(s.code, dir=str(workdir)), launch=launch)

        points = [(moved(s), p) for s, p in points]
        for d, (s, _) in zip(run_dirs, points):
            runs.write_private(runs.RunFolder(d).spec_toml, to_toml(s))
    doc, diff = repro.manifest(src, image_identity(spec), snap_info, spec.secret_env)  # git once, also for a sweep
    for d in run_dirs:
        try:
            repro.write_manifest(d, doc, diff)
        except OSError as exc:  # the bundle informs; it never stops a submission
            click.echo(f"warning: {d}: could not write the repro bundle: {exc}", err=True)
    return points

