"""`hpctrain registry rebuild|check`: the run registry's own maintenance commands.

Only click at module level (the CLI path stays light); the registry loads inside the commands.
"""

from __future__ import annotations

from pathlib import Path

import click


def register(group: click.Group) -> None:
    group.add_command(registry)


@click.group(short_help="Check or rebuild the run registry.")
def registry() -> None:
    """The run registry is an index of the run folders; these commands check and rebuild it."""


@registry.command(short_help="Rebuild the registry from the run folders on disk.")
@click.option("--runs-dir", "runs_dirs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder holding run folders (repeatable; default: $HPCTRAIN_RUNS_DIR or ./runs).")
def rebuild(runs_dirs: tuple[Path, ...]) -> None:
    """Add every run folder (spec.toml + attempts.jsonl or submitit job files) the registry lacks.
    A damaged registry file is moved aside first; rows of a healthy one are all kept. Then every
    submission of unknown outcome (a submitter killed after sbatch) is looked up in SLURM by its tag."""
    from hpctrain.runs.rebuild import rebuild_registry
    from hpctrain.runs.registry import Registry
    from hpctrain.slurm.uncertain import reconcile_all

    reg = Registry()
    for line in rebuild_registry(reg, runs_dirs=list(runs_dirs) or None):
        click.echo(line)
    for line in reconcile_all(reg):
        click.echo(line)


@registry.command(short_help="Check the registry file.")
def check() -> None:
    """Run SQLite's integrity check and say where the registry is."""
    from hpctrain.runs.registry import Registry

    reg = Registry()
    verdict = reg.integrity_check()
    for w in reg.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"{reg.path}: {verdict}")
    if verdict != "ok":
        raise click.ClickException(f"the run registry {reg.path} is damaged ({verdict}). "
                                   "Fix: `hpctrain registry rebuild`")
