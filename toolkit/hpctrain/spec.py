"""The job request: typed, frozen, validated.

A spec is what the user asked for, merged from four layers (later wins):
defaults < site profile < run file (TOML) < CLI flags.  Everything else (world size, batch
arithmetic, memory) is *derived* from it once, in `hpctrain.plan`.

The run file mirrors these dataclasses: top-level `name`, then one table per section
(`[resources]`, `[launch]`, `[model]`, `[data]`, `[train]`, `[parallel]`, `[checkpoint]`,
`[container]`, `[env]`), plus optional `[sites.NAME]` tables that define site profiles inline.

This module is pure Python (no torch): the login node and the compute node both read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

Zero = Union[int, Literal["auto"]]  # 0, 1, 2, 3 or "auto"
Offload = Literal["none", "optimizer", "param", "all"]
OffloadDevice = Literal["cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]
Launcher = Literal["srun", "deepspeed"]
ExecutorName = Literal["slurm", "local", "auto"]
Runtime = Literal["none", "apptainer", "pyxis", "podman", "charliecloud"]


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What SLURM allocates. Every count below derives from these once (see plan.py)."""

    nodes: int = 1
    gpus_per_node: int = 0  # 0 = CPU ranks (DS_ACCELERATOR=cpu, gloo)
    tasks_per_node: int = 0  # 0 = derive: gpus_per_node, or 1 on CPU
    cpus_per_task: int = 1
    mem: str = ""  # SLURM --mem, e.g. "64G"; "" = site/cluster default
    time: str = "01:00:00"  # SLURM --time
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    exclude: tuple[str, ...] = ()  # hosts never to run on (grows on resubmit)
    signal_seconds: int = 90  # USR2 this long before the time limit -> checkpoint + requeue


@dataclass(frozen=True, kw_only=True)
class Launch:
    executor: ExecutorName = "auto"  # auto = slurm if `sbatch` is on PATH, else local
    launcher: Launcher = "srun"  # srun: one task per rank; deepspeed: its runner with our hostfile
    retries: int = 3  # automatic resubmissions (capped in resubmit policy)
    preflight_timeout_s: int = 60  # rendezvous + all-reduce must finish within this
    modules: tuple[str, ...] = ()  # `module load` lines (site profiles set these)


@dataclass(frozen=True, kw_only=True)
class Model:
    """Exactly one of `path` (from_pretrained on a local folder) or `config` (from_config)."""

    path: str = ""  # local HF folder (compute nodes are offline: never a hub id)
    config: str = ""  # path to a config.json, or a built-in preset name such as "llama-tiny"
    overrides: dict[str, object] = field(default_factory=dict)  # config.json keys to override
    freeze: tuple[str, ...] = ()  # fnmatch patterns of parameter names to freeze


@dataclass(frozen=True, kw_only=True)
class Data:
    source: str = "synthetic"  # "synthetic", or a path: .jsonl/.txt file, folder of them, or load_from_disk folder
    format: Literal["auto", "jsonl", "text", "arrow", "synthetic"] = "auto"
    text_field: str = "text"
    tokenizer: str = "byte"  # "byte" (no files) or a local tokenizer folder
    seq_len: int = 512
    dynamic_batching: bool = False  # fill batches to a token budget instead of padding to seq_len
    tokens_per_batch: int = 0  # 0 = micro_batch * seq_len
    pack: bool = False  # pack documents into seq_len with per-document attention boundaries


@dataclass(frozen=True, kw_only=True)
class Train:
    steps: int = 100  # optimizer steps
    micro_batch: int = 0  # per rank; 0 = derive from global_batch
    grad_accum: int = 0  # 0 = derive
    global_batch: int = 0  # 0 = derive: micro_batch * grad_accum * dp
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1234
    precision: Precision = "bf16"
    activation_checkpointing: bool = False
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = unknown (no MFU reported)


@dataclass(frozen=True, kw_only=True)
class Parallel:
    zero: Zero = 3
    offload: Offload = "none"
    offload_device: OffloadDevice = "cpu"
    nvme_path: str = ""  # required when offload_device == "nvme"
    pp: int = 1
    tp: int = 1


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    every_steps: int = 0  # 0 = off
    every_minutes: float = 0.0  # 0 = off
    keep: int = 2  # complete checkpoints kept
    export_hf: bool = True  # consolidated HF folder at the end


@dataclass(frozen=True, kw_only=True)
class Container:
    runtime: Runtime = "none"
    image: str = ""
    mounts: tuple[str, ...] = ()  # extra "SRC[:DST]" binds; run folder, data and model are bound automatically


@dataclass(frozen=True, kw_only=True)
class Spec:
    name: str = "hpctrain"
    site: str = ""  # site profile name ("" = none)
    resources: Resources = field(default_factory=Resources)
    launch: Launch = field(default_factory=Launch)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    train: Train = field(default_factory=Train)
    parallel: Parallel = field(default_factory=Parallel)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    container: Container = field(default_factory=Container)
    env: dict[str, str] = field(default_factory=dict)  # plain env for every rank (rendered into sbatch.sh)
    # Names of env vars that are secret: passed through from the submitting environment by name,
    # never written into a rendered file, a log or the registry. HF_TOKEN/WANDB_API_KEY always are.
    secret_env: tuple[str, ...] = ()
