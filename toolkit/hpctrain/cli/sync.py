"""`hpctrain sync RUN [--to tensorboard|wandb|mlflow]`: replay a run's metrics into a tracker, on the login node.

Only click at module level: the tracker libraries load inside hpctrain.collect.sync, when a sync runs.
"""

from __future__ import annotations

import json

import click

TARGETS = ("tensorboard", "wandb", "mlflow")  # hpctrain.collect.sync.SYNC_TARGETS (not imported: --help stays light)


def register(group: click.Group) -> None:
    group.add_command(sync_cmd)


@click.command("sync", short_help="Replay a run's metrics into TensorBoard, W&B or MLflow.")
@click.argument("run")
@click.option("--to", "to", type=click.Choice(TARGETS), default="tensorboard", show_default=True,
              help="The tracker to write to.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sync_cmd(run: str, to: str, as_json: bool) -> None:
    """Replay RUN's metrics.jsonl (and the attempt boundaries of its events.jsonl) into a tracker, for clusters
    whose compute nodes cannot reach it. Idempotent by step: a second sync writes nothing new; a sync after
    more training appends the new steps. The W&B run id is the run id (set WANDB_MODE=offline to write
    RUN/metrics/wandb for `wandb sync`); MLflow: [tracking] mlflow_uri, else RUN/metrics/mlruns."""
    from hpctrain.collect.sync import sync
    from hpctrain.runs.folder import RunFolder
    from hpctrain.runs.registry import Registry
    from hpctrain.runs.resolve import resolve_run
    from hpctrain.spec.model import read_resolved

    folder = RunFolder(resolve_run(Registry(), run).folder)
    result = sync(folder, read_resolved(folder.path), to)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    bounds = ", ".join(f"attempt {a} from step {s}" for a, s in result.attempts) or "none recorded"
    if result.steps:
        click.echo(f"synced {result.steps} steps ({result.events} values) of {folder.run_id} into {result.target}")
    else:
        click.echo(f"{folder.run_id}: nothing new to sync into {result.target}")
    click.echo(f"attempts: {bounds}")
