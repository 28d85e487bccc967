"""The `hpctrain` command line. Nothing heavy is imported at module level (see DESIGN.md)."""

from __future__ import annotations

import click

from hpctrain import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpctrain")
def cli() -> None:
    """Launch DeepSpeed training on SLURM clusters."""


def main() -> None:
    cli()
