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
    """Write a from_pretrained-loadable folder from RUN (a run id or a run folder).

    \b
    A full fine-tune or pretraining run: the model's weights (safetensors), config and tokenizer.
    A LoRA/QLoRA run ([lora] r > 0): the adapters merged into the base model of [model] path, and the
    adapters alone in OUT/adapter/ (PEFT's adapter_config.json + adapter_model.safetensors, for
    PeftModel.from_pretrained on the same base).
    """
    from hpctrain.errors import HpcUsageError

    run_dir = _run_dir(run)
    missing = _missing_node_extra()
    if missing:  # the base install: hpctrain.node imports these only inside the functions that use them
        raise _needs_node_extra(missing)
    try:
        from hpctrain.node.checkpointing.export import export_hf
        from hpctrain.node.runconf import NodeInputError

        folder = export_hf(run_dir, out, tag)
    except NodeInputError as exc:
        raise HpcUsageError(str(exc)) from None
    except ImportError as exc:  # a package of the node extra (peft for a LoRA run, ...) missing or broken
        if (exc.name or "").partition(".")[0] not in NODE_EXTRA:
            raise
        raise _needs_node_extra(str(exc.name)) from None
    click.echo(f"exported {run_dir.name} -> {folder}")


# What `pip install 'hpctrain[node]'` brings that export loads (the import names, not the package names).
NODE_EXTRA = ("torch", "deepspeed", "transformers", "safetensors", "accelerate", "peft")


def _missing_node_extra() -> str:
    """The first of torch, deepspeed and transformers that cannot be imported here, or ''."""
    import importlib.util

    for name in NODE_EXTRA[:3]:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # ValueError: a module blocked as None in sys.modules
            return name
    return ""


def _needs_node_extra(name: str) -> click.ClickException:
    from hpctrain.errors import HpcUsageError

    return HpcUsageError(f"export needs the node extra ({name} is not installed here). Fix: run it where "
                         "`pip install 'hpctrain[node]'` (make install) is done, e.g. on a compute node")


def _run_dir(ref: str) -> Path:
    """The run folder `ref` names, by the one rule every run command follows (hpctrain.runs.resolve: an id, a
    prefix, a name, `last`, or a run folder's path, also one the registry never saw)."""
    from hpctrain.runs.registry import Registry
    from hpctrain.runs.resolve import resolve_run

    return resolve_run(Registry(), ref).folder.resolve()
