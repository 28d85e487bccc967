"""The command-line flags that set spec keys: one table for the CLI's options, the "how to set" half of
every refusal (spec.rules.how_to_set), `--set` and docs/flags.md (a test keeps that page in sync).

Stdlib only: `hpctrain --help` builds its options from this table at import time.
"""

from __future__ import annotations

from dataclasses import dataclass


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
