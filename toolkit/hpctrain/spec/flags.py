"""The command-line flags that set spec keys: one table for the CLI's options, the "how to set" half of
every refusal (spec.rules.how_to_set), `--set` and docs/flags.md (a test keeps that page in sync).

Stdlib only: `hpctrain --help` builds its options from this table at import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args


@dataclass(frozen=True)
class Flag:
    """`flag` sets the dotted spec `key`; `kind` is int, str, or the accepted words (a choice)."""

    flag: str
    key: str
    kind: type | tuple[str, ...]
    help: str


FLAGS: tuple[Flag, ...] = (
    Flag("--nodes", "resources.nodes", int, "Nodes to allocate."),
    Flag("--gpus-per-node", "resources.gpus_per_node", int, "GPUs per node (0 = CPU ranks)."),
    Flag("--cpus-per-task", "resources.cpus_per_task", int, "CPU cores per rank."),
    Flag("--mem", "resources.mem", str, "Memory per node, SLURM syntax (64G)."),
    Flag("--time", "resources.time", str, "Time limit (HH:MM:SS or D-HH:MM)."),
    Flag("--partition", "resources.partition", str, "SLURM partition."),
    Flag("--account", "resources.account", str, "SLURM account."),
    Flag("--qos", "resources.qos", str, "SLURM QOS."),
    Flag("--job-name", "name", str, "Run / job name."),
    Flag("--zero", "parallel.zero", ("0", "1", "2", "3", "auto"), "ZeRO stage, or auto."),
    Flag("--offload", "parallel.offload", ("none", "optimizer", "param", "all"), "What to offload."),
    Flag("--offload-ratio", "parallel.offload_ratio", str,
         "ZeRO-3 optimizer offload: fraction of the optimizer state on the CPU, 0 < r <= 1, or auto."),
    Flag("--offload-device", "parallel.offload_device", ("cpu", "nvme"), "Offload target."),
    Flag("--nvme-path", "parallel.nvme_path", str, "Local NVMe folder for --offload-device nvme."),
    Flag("--precision", "train.precision", ("bf16", "fp16", "fp32"), "Training precision."),
    Flag("--micro-batch", "train.micro_batch", int, "Micro-batch per rank."),
    Flag("--grad-accum", "train.grad_accum", int, "Gradient accumulation steps."),
    Flag("--global-batch", "train.global_batch", int, "Global batch (micro x accum x dp)."),
    Flag("--pp", "parallel.pp", int, "Pipeline-parallel degree."),
    Flag("--tp", "parallel.tp", int, "Tensor-parallel degree."),
    Flag("--launcher", "launch.launcher", ("srun", "torchrun", "deepspeed", "accelerate"),
         "How ranks start (torchrun, accelerate: a user script only)."),
    Flag("--script", "launch.script", str, "Run your own training script instead of hpctrain's trainer."),
    Flag("--module", "launch.module", str, "Run your own module (python -m pkg.mod) instead of the trainer."),
    Flag("--executor", "launch.executor", ("slurm", "local", "auto"), "Where the job runs."),
    Flag("--steps", "train.steps", int, "Optimizer steps."),
    Flag("--spare-nodes", "resources.spare_nodes", int,
         "Extra nodes to allocate; a lost node is replaced by one within the same job (0 = off)."),
    Flag("--retries", "launch.retries", int, "Automatic resubmissions after a failure (0 = off; capped at 10)."),
    Flag("--data", "data.source", str, "Data: 'synthetic', a prepared folder, a .jsonl/.txt file or a folder."),
    Flag("--lora-r", "lora.r", int, "LoRA adapter rank: train adapters on a frozen model (0 = off, full fine-tune)."),
    Flag("--eval-every", "train.eval_every", int, "Evaluate the validation split every N steps (0 = off)."),
    Flag("--mail-type", "slurm.mail_type", str, "SLURM mail types, e.g. END,FAIL (sbatch --mail-type)."),
    Flag("--mail-user", "slurm.mail_user", str, "Where SLURM sends the mail (sbatch --mail-user)."),
    Flag("--track", "tracking.backends", str,
         "Trackers, comma-separated: tensorboard (the default), wandb, csv, mlflow; 'none' for none."),
)

# Flags the CLI declares itself (one flag for two keys, a switch, the site layer), for the hints.
OTHER_FLAGS: dict[str, str] = {
    "site": "--site", "model.path": "--model", "model.config": "--model",
    "train.activation_checkpointing": "--activation-checkpointing",
    "slurm.extra": "--sbatch-arg", "code.snapshot": "--snapshot",
    "launch.pass_ds_config": "--pass-ds-config", "launch.args": "-- ARGS", "fault.health_check": "--health-check",
}

FLAG_FOR: dict[str, str] = {**{f.key: f.flag for f in FLAGS}, **OTHER_FLAGS}


def markdown_table() -> str:
    """docs/flags.md's table: every flag and the spec key it sets."""
    rows = ["| flag | spec key | values | what |", "| --- | --- | --- | --- |"]
    for f in FLAGS:
        values = " \\| ".join(f.kind) if isinstance(f.kind, tuple) else f.kind.__name__
        rows.append(f"| `{f.flag}` | `{f.key}` | {values} | {f.help} |")
    rows += [f"| `{flag}` | `{key}` | | see `hpctrain submit --help` |" for key, flag in OTHER_FLAGS.items()]
    return "\n".join(rows) + "\n"


# Container runtimes a request may name (`--container RUNTIME:IMAGE`, `container.runtime`); "none" runs on the host.
# The type of spec.model.Container.runtime and its values, written once.
Runtime = Literal["none", "apptainer", "pyxis", "podman", "charliecloud"]
RUNTIMES: tuple[str, ...] = get_args(Runtime)

# The options that are not one row of FLAGS, by their Python name (click's parameter name, and the keyword of
# hpctrain.submit / hpctrain.plan): `set` is --set's SECTION.KEY=VALUE items (or, from Python, a mapping).
OTHER_OPTIONS: tuple[str, ...] = ("set", "site", "container", "model", "activation_checkpointing", "pass_ds_config",
                                  "script_args", "sbatch_args", "snapshot", "health_check")


def option_name(flag: str) -> str:
    """`--gpus-per-node` -> `gpus_per_node`: click's parameter name, and the API's keyword."""
    return flag.lstrip("-").replace("-", "_")


OPTION_NAMES: tuple[str, ...] = (*(option_name(f.flag) for f in FLAGS), *OTHER_OPTIONS)


def keys_from_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    """Option values by Python name (click's, or hpctrain.submit's keywords) -> dotted spec keys. None is "not
    given", so lower layers stay. The one translation the CLI's flags and the Python API share: a key the API
    passes means exactly what the flag of that name means."""
    from hpctrain.errors import bad_value
    from hpctrain.spec.presets import PRESETS

    keys: dict[str, Any] = {}
    for f in FLAGS:
        value = opts.get(option_name(f.flag))
        if value is not None:
            keys[f.key] = value
    for name, key in (("activation_checkpointing", "train.activation_checkpointing"),
                      ("pass_ds_config", "launch.pass_ds_config")):
        if opts.get(name) is not None:
            keys[key] = opts[name]
    if opts.get("script_args") is not None:  # the words after `--`: the script's arguments, exactly
        keys["launch.args"] = list(opts["script_args"])
    model = opts.get("model")
    if model:  # one flag, two fields: a preset or config.json starts fresh, a folder loads weights
        fresh = model in PRESETS or str(model).endswith(".json")
        keys["model.config"], keys["model.path"] = (str(model), "") if fresh else ("", str(model))
    container = opts.get("container")
    if container:
        runtime, _, image = str(container).partition(":")
        if runtime not in RUNTIMES:
            raise bad_value("--container", container, f"unknown runtime {runtime!r}",
                            "write RUNTIME:IMAGE with RUNTIME one of " + ", ".join(RUNTIMES[1:]))
        keys["container.runtime"], keys["container.image"] = runtime, image
    keys.update(_set_items(opts.get("set")))
    if opts.get("sbatch_args"):
        keys["slurm.extra"] = tuple(opts["sbatch_args"])
    if opts.get("snapshot"):
        keys["code.snapshot"] = True
    if opts.get("health_check") is not None:
        keys["fault.health_check"] = bool(opts["health_check"])
    return keys


def _set_items(items: Mapping[str, Any] | Iterable[str] | None) -> dict[str, Any]:
    """--set SECTION.KEY=VALUE items (or the API's mapping of dotted keys) -> dotted spec keys."""
    from hpctrain.errors import bad_value

    if isinstance(items, Mapping):
        return {str(k).strip(): v for k, v in items.items()}
    keys: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise bad_value("--set", item, "expected SECTION.KEY=VALUE", "write e.g. --set train.lr=1e-4")
        keys[key.strip()] = value
    return keys


def keys_from_keywords(where: str, keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The Python API's keywords -> dotted spec keys: a name of OPTION_NAMES means what its flag means (nodes=2
    is --nodes 2), a dotted name is a spec key itself (**{"train.lr": 1e-4} is --set train.lr=1e-4). Any other
    name is refused, listing the valid ones, as a misspelt flag is."""
    from hpctrain.errors import unknown_key

    options = {k: v for k, v in keywords.items() if "." not in k}
    for name in options:
        if name not in OPTION_NAMES:
            raise unknown_key(where, name, [*OPTION_NAMES, "SECTION.KEY"])
    dotted = {k: v for k, v in keywords.items() if "." in k}
    return {**keys_from_options(options), **dotted}
