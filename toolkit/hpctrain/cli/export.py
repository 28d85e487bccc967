"""`hpctrain export RUN`: a consolidated Hugging Face folder from the run's latest complete checkpoint.

Runs on a machine with the node extra (torch, deepspeed, transformers): the login node usually has
none, so the message says which install is missing instead of failing with an ImportError.
"""

from __future__ import annotations

from pathlib import Path

import click


def register(group: click.Group) -> None:
    group.add_command(export_cmd)


@click.command("export")
@click.argument("run")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder to write (default: RUN_FOLDER/hf).")
@click.option("--tag", default=None, help="Checkpoint to export, e.g. step-20 (default: the latest complete one).")
def export_cmd(run: str, out: str | None, tag: str | None) -> None:
    """Write a from_pretrained-loadable folder from RUN (a run id or a run folder)."""
    from hpctrain.errors import HpcUsageError

    run_dir = _run_dir(run)
    try:
        from hpctrain.node.export import export_hf
        from hpctrain.node.runconf import NodeInputError
    except ImportError as exc:  # torch/deepspeed/transformers absent: the base install
        raise HpcUsageError(f"export needs the node extra ({exc.name} is not installed). "
                            "Fix: run it where `pip install 'hpctrain[node]'` (make install) is done") from None
    try:
        folder = export_hf(run_dir, out, tag)
    except NodeInputError as exc:
        raise HpcUsageError(str(exc)) from None
    click.echo(f"exported {run_dir.name} -> {folder}")


def _run_dir(ref: str) -> Path:
    """A path to a run folder is taken as is; anything else is looked up in the registry."""
    from hpctrain.runs.folder import RunFolder

    if RunFolder(ref).spec_toml.is_file():
        return Path(ref).resolve()
    from hpctrain.cli.runs import _find, _registry

    return Path(_find(_registry(), ref).folder)
