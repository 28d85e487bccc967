"""The job request: typed, frozen, validated.

A spec is what the user asked for, merged from five layers (later wins): defaults < fine-tuning defaults
(hpctrain.spec.finetune) < site profile < run file (TOML) < CLI flags.  Everything else (world size, batch arithmetic,
memory) is *derived* from it once, in `hpctrain.plan.planner`.

The run file mirrors these dataclasses: top-level `name`, then one table per section (`[resources]`, `[launch]`,
`[model]`, `[lora]`, `[data]`, `[train]`, `[parallel]`, `[checkpoint]`, `[container]`, `[slurm]`, `[code]`,
`[tracking]`, `[env]`), plus optional `[sites.NAME]` tables that define site profiles inline.

This module is pure Python (no torch): the login node and the compute node both read it.
"""

from __future__ import annotations

import itertools
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import tomli_w
import tomllib

from hpctrain.errors import HpcUsageError, bad_value, unknown_key
from hpctrain.spec import finetune
from hpctrain.spec.finetune import Default
from hpctrain.spec.flags import Runtime  # with its values, RUNTIMES
from hpctrain.spec.rules import check, describe, field_types, how_to_set, need

Zero = int | Literal["auto"]  # 0, 1, 2, 3 or "auto"
OffloadRatio = float | Literal["auto"]  # 0 < r <= 1, or "auto" (0 also means auto)
Switch = bool | Literal["auto"]  # true, false, or "auto" (the planner / the node decides)
AsyncSave = Switch
Offload = Literal["none", "optimizer", "param", "all"]
OffloadDevice = Literal["cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]
Launcher = Literal["srun", "torchrun", "deepspeed", "accelerate"]
ExecutorName = Literal["slurm", "local", "auto"]
# "auto": transformers' "sdpa" with torch's SDPA backends in the order measured fastest on the rank's GPU
# (hpctrain.node.model.attention); "sdpa-<backend>": that backend first; the rest are transformers' own names.
Attention = Literal["auto", "sdpa", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "eager", "flash_attention_2",
                    "flash_attention_3", "flex_attention"]
# "liger": Liger Kernel's fused RMSNorm, RoPE, SwiGLU and linear cross-entropy on GPU ranks (CPU ranks: off, the
# plan says why; hpctrain.node.model.kernels); "none": transformers' own modules.
Kernels = Literal["none", "liger"]


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What SLURM allocates. Every count below derives from these once (see plan/planner.py)."""

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
    gpu_mem_gb: float = 0.0  # memory of one GPU for the plan's fit check; 0 = assume 80 (A100/H100 80GB)
    # Extra nodes allocated beside `nodes` (training runs on `nodes`): a lost node is replaced by a spare in a
    # new srun step of the same job (hpctrain.fault.injob) instead of a resubmission through the queue.
    spare_nodes: int = 0

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Launch:
    executor: ExecutorName = "auto"  # auto = slurm if `sbatch` is on PATH, else local
    launcher: Launcher = "srun"  # srun: one task per rank; deepspeed: its runner with our hostfile (torchrun and
    # accelerate: one task per node starting the ranks, for a user script only)
    script: str = ""  # the user's own training script (`submit --script`) instead of hpctrain's trainer
    module: str = ""  # or a module run as `python -m pkg.mod` (`submit --module`)
    args: tuple[str, ...] = ()  # the script's arguments, passed exactly (the words after `--`)
    pass_ds_config: bool = False  # append `--deepspeed_config RUN/ds_config.json` to the script's arguments
    retries: int = 3  # automatic resubmissions (capped in resubmit policy)
    hang_timeout_s: int = 300  # hang watchdog: no rank advances this long -> cancel + retry (0 = off)
    preflight_timeout_s: int = 60  # rendezvous + all-reduce must finish within this
    modules: tuple[str, ...] = ()  # `module load` lines (site profiles set these)
    template_dir: str = ""  # folder whose *.j2 override the shipped templates ("" = config dir's templates/)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Recovery inside the allocation (hpctrain.fault.injob); resubmission is launch.retries."""

    # New srun steps within one job after a lost node, a hang or a retryable rank crash. 0 (the default): one
    # per spare node (none without spares: every failure ends the job and the supervisor resubmits). Set
    # without spares, a retryable crash restarts in place; with spares, a step replaces the failing node.
    in_job_restarts: int = 0
    # Straggler exclusion, with a spare left: a node whose ranks' compute time per step stays at least
    # straggler_ratio x the other ranks' median (heartbeats) for straggler_patience_s is replaced (0 = off).
    straggler_patience_s: int = 0
    straggler_ratio: float = 1.2
    # Health check before training (SLURM jobs; hpctrain.node.launch.health measures, hpctrain.fault.health judges):
    # every node of the job, spares too, runs a short test in an srun step of its own: GPUs (NVML errors and
    # throttling, a few seconds of bf16 matmul against the measured rate) or the CPU's matmul rate, and the
    # network (an all-reduce across the nodes, each node against its ring neighbours). A node that fails is
    # replaced by a spare before any training; without one left, the job ends and the supervisor resubmits
    # with that node excluded. summary says which node failed and why.
    health_check: bool = False
    health_matmul_ratio: float = 0.8  # a GPU (CPU) below this x its kind's measured rate (the nodes' median)
    health_net_ratio: float = 0.5  # a node whose best ring link is below this x the median node's best link
    health_min_busbw_gbps: float = 0.0  # all-reduce bus bandwidth floor, GB/s (a note when below; 0 = none)
    health_timeout_s: int = 300  # the health step's limit; a node without a complete report by then fails

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Model:
    """Exactly one of `path` (from_pretrained on a local folder) or `config` (from_config)."""

    path: str = ""  # local HF folder (compute nodes are offline: never a hub id)
    config: str = ""  # path to a config.json, or a built-in preset name such as "llama-tiny"
    overrides: dict[str, object] = field(default_factory=dict)  # config.json keys to override
    freeze: tuple[str, ...] = ()  # fnmatch patterns of parameter names to freeze
    attention: Attention = "auto"  # the attention kernel (hpctrain.node.model.attention)
    kernels: Kernels = "none"  # fused Triton kernels for norms, RoPE, MLP and loss (hpctrain.node.model.kernels)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Data:
    # "synthetic", a prepared folder (`hpctrain data prepare`: memory-mapped, read lazily by every rank), or raw
    # text that every rank tokenizes in RAM: a .jsonl/.txt file, a folder of them, or a load_from_disk folder
    source: str = "synthetic"
    # auto: a manifest = prepared. "alpaca" (instruction/input/output records) and "chat" (OpenAI-style
    # `messages`, rendered with the tokenizer's chat_template) are SFT formats: the loss covers the responses only.
    format: Literal["auto", "prepared", "jsonl", "text", "arrow", "synthetic", "alpaca", "chat"] = "auto"
    text_field: str = "text"
    messages_field: str = "messages"  # format = "chat": the field holding the list of {role, content} messages
    # SFT examples longer than seq_len: "truncate" keeps the prompt and cuts the response, "drop" skips the example
    overlong: Literal["truncate", "drop"] = "truncate"
    tokenizer: str = "byte"  # "byte" (no files) or a local tokenizer folder
    seq_len: int = 512
    dynamic_batching: bool = False  # fill batches to a token budget instead of padding to seq_len
    tokens_per_batch: int = 0  # 0 = micro_batch * seq_len
    pack: bool = False  # pack documents into seq_len with per-document attention boundaries
    max_raw_bytes: int = 64_000_000  # raw text above this is refused (0 = no limit): prepare it once instead

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Lora:
    """LoRA adapters through PEFT (r = 0: off, the whole model trains). QLoRA: quantize = "4bit" (bitsandbytes)."""

    r: int = 0  # adapter rank; 0 = off
    alpha: float = 0.0  # scaling numerator; 0 = 2 x r
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ()  # module names to adapt; () = every linear layer but the output head
    quantize: Literal["none", "4bit"] = "none"  # "4bit": QLoRA (NF4 base weights, bf16 compute)

    def __post_init__(self) -> None:
        check(self)


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
    # Recompute activations in the backward pass: ~25% more compute, far less activation memory.
    # "auto": the planner turns it on only when the run does not fit without it (plan.json says which).
    activation_checkpointing: Switch = False
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = unknown (no MFU reported)
    eval_every: int = 0  # evaluate the prepared folder's validation split every N steps (and at the end); 0 = off
    eval_tokens: int = 262_144  # tokens per evaluation, shared by the data-parallel ranks; 0 = the whole split

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Parallel:
    zero: Zero = 3
    offload: Offload = "none"
    offload_device: OffloadDevice = "cpu"
    # DeepSpeed's partial optimizer offload (ZeRO-3 only): the fraction of the optimizer state kept on
    # the CPU. 1.0 = all of it (classic ZeRO-Offload); "auto" (or 0) = the planner picks the smallest
    # fraction that fits the GPU, because the GPU's Adam is far faster than CPU Adam.
    offload_ratio: OffloadRatio = 1.0
    nvme_path: str = ""  # required when offload_device == "nvme"
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    every_steps: int = 0  # 0 = off
    every_minutes: float = 0.0  # 0 = off
    keep: int = 2  # complete checkpoints kept
    export_hf: bool = True  # consolidated HF folder at the end
    # Write checkpoints in the background (training waits only for a host copy of the state). "auto": on
    # for GPU ranks whose state fits in half the free host memory, else synchronous.
    async_save: AsyncSave = "auto"

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Container:
    runtime: Runtime = "none"
    image: str = ""
    mounts: tuple[str, ...] = ()  # extra "SRC[:DST]" binds; run folder, data and model are bound automatically

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Slurm:
    """sbatch options beyond what hpctrain derives (hpctrain.spec.sbatch_args says what is allowed)."""

    extra: tuple[str, ...] = ()  # e.g. ["--exclusive", "--reservation=R", "--gres=gpu:a100:8"]
    mail_type: str = ""  # SLURM --mail-type, e.g. "END,FAIL"
    mail_user: str = ""  # SLURM --mail-user

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Code:
    """Where the job's code comes from (hpctrain.runs.snapshot)."""

    snapshot: bool = False  # copy the code into the run folder at submit (`submit --snapshot`)
    dir: str = ""  # set by submit when it made the copy: the batch script cds here and puts it on PYTHONPATH

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Tracking:
    """The trackers rank 0 writes to through DeepSpeed's monitor (ds_config.json's tensorboard, wandb and
    csv_monitor blocks; MLflow through hpctrain's monitor of the same interface). Files go to the run
    folder's metrics/. The W&B run id is the hpctrain run id, so every attempt appends to one W&B run."""

    backends: tuple[str, ...] = ("tensorboard",)  # any of tensorboard, wandb, csv, mlflow; [] or "none" = off
    project: str = "hpctrain"  # W&B project, MLflow experiment
    entity: str = ""  # W&B team or user ("" = the API key's default)
    group: str = ""  # W&B group ("" = none)
    mlflow_uri: str = ""  # MLflow tracking URI ("" = a file store in the run folder: metrics/mlruns)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class Spec:
    name: str = "hpctrain"
    site: str = ""  # site profile name ("" = none)
    resources: Resources = field(default_factory=Resources)
    launch: Launch = field(default_factory=Launch)
    fault: Fault = field(default_factory=Fault)
    model: Model = field(default_factory=Model)
    lora: Lora = field(default_factory=Lora)
    data: Data = field(default_factory=Data)
    train: Train = field(default_factory=Train)
    parallel: Parallel = field(default_factory=Parallel)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    container: Container = field(default_factory=Container)
    slurm: Slurm = field(default_factory=Slurm)
    code: Code = field(default_factory=Code)
    tracking: Tracking = field(default_factory=Tracking)
    env: dict[str, str] = field(default_factory=dict)  # plain env for every rank (rendered into sbatch.sh)
    # Names of env vars that are secret: passed through from the submitting environment by name,
    # never written into a rendered file, a log or the registry. HF_TOKEN/WANDB_API_KEY always are.
    secret_env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self)


# --------------------------------------------------------------------------------------------------
# Sections of the run file (each a dataclass above) and keys that a sweep may not vary.

SECTIONS: dict[str, type] = {
    "resources": Resources,
    "launch": Launch,
    "fault": Fault,
    "model": Model,
    "lora": Lora,
    "data": Data,
    "train": Train,
    "parallel": Parallel,
    "checkpoint": Checkpoint,
    "container": Container,
    "slurm": Slurm,
    "code": Code,
    "tracking": Tracking,
}
TOP_SCALARS = ("name", "site", "secret_env")
# A sweep makes one job array, and an array has one allocation shape and one launch line.
UNSWEEPABLE = ("resources.", "launch.", "fault.", "container.", "slurm.", "code.", "site", "secret_env", "env.")


# --------------------------------------------------------------------------------------------------
# Building a Spec from nested dicts (run file, spec.toml) and from dotted overrides (site, flags).

def _field_hint(key: str) -> Any:
    """Type hint of a dotted key such as 'train.lr', or raise listing the valid keys."""
    section, _, name = key.partition(".")
    if section in SECTIONS and name:
        hints = field_types(SECTIONS[section])
        if name in hints:
            return hints[name]
        if "." in name and typing.get_origin(hints.get(name.split(".")[0])) is dict:
            return object  # model.overrides.rope_theta: any TOML value
        raise unknown_key(f"[{section}]", name, hints)
    if section == "env" and name:
        return str
    if key in TOP_SCALARS:
        return field_types(Spec)[key]
    valid = [*TOP_SCALARS, *(f"{s}.{f}" for s, c in SECTIONS.items() for f in field_types(c)), "env.NAME"]
    raise unknown_key("override key", key, valid)


def coerce(key: str, value: object) -> object:
    """Turn a string from the command line (--set, --sweep) into the field's type.

    Values already of the right Python type (click options, TOML) pass through unchanged.
    """
    hint = _field_hint(key)
    if not isinstance(value, str):
        return tuple(value) if isinstance(value, list) and typing.get_origin(hint) is tuple else value
    text = value.strip()
    try:
        if hint is bool:
            return _bool_text(text)
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint == Zero:
            return "auto" if text == "auto" else int(text)
        if hint == OffloadRatio:
            return "auto" if text == "auto" else float(text)
        if hint == Switch:
            if text.lower() == "auto":
                return "auto"
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if typing.get_origin(hint) is tuple:
            return _list_text(text)
        if hint is object:
            try:
                return tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                return value
    except ValueError:
        raise bad_value(key, value, f"must be {describe(hint)}", how_to_set(key, "...")) from None
    return value


def _list_text(text: str) -> tuple[str, ...]:
    """A list from the command line: `a,b` or the run file's own TOML array `["a", "b"]` (what the refusals of a
    list field show as the fix, so a user pastes it into --set)."""
    if text.startswith("["):
        try:
            items = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            raise ValueError(text) from None
        if not all(isinstance(i, str) for i in items):
            raise ValueError(text)
        return tuple(items)
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _bool_text(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _flatten(data: dict[str, Any], where: str) -> dict[str, Any]:
    """Nested run-file dict -> dotted keys; env and dict fields merge key by key."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise bad_value(key, value, "must be a table", f"write [{key}] in {where}")
            hints = field_types(SECTIONS[key])
            for name, v in value.items():
                if name not in hints:
                    raise unknown_key(f"{where} [{key}]", name, hints)
                if typing.get_origin(hints[name]) is dict:
                    if not isinstance(v, dict):
                        raise bad_value(f"{key}.{name}", v, "must be a table of keys and values",
                                        f"write [{key}.{name}] with one `key = value` per line in {where}")
                    out.update({f"{key}.{name}.{k}": x for k, x in v.items()})
                    out.setdefault(f"{key}.{name}", {})
                else:
                    out[f"{key}.{name}"] = v
        elif key == "env":
            if not isinstance(value, dict):
                raise bad_value("env", value, "must be a table", f"write [env] in {where}")
            out.update({f"env.{k}": v for k, v in value.items()})
        elif key in TOP_SCALARS:
            out[key] = value
        else:
            raise unknown_key(where, key, [*TOP_SCALARS, *SECTIONS, "env", "sites"])
    return out


def run_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A run file's content given as a mapping ({"name": ..., "resources": {...}}; the Python API's
    hpctrain.submit({...})) -> dotted keys, each checked as a run file's would be."""
    return _flatten(dict(data), where)


def _merge(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply dotted layers in order (later wins) into a nested dict ready for `_build`."""
    nested: dict[str, Any] = {"env": {}}
    secrets: list[str] = []
    for layer in layers:
        for key, raw in layer.items():
            value = coerce(key, raw)
            if key == "secret_env":
                secrets.extend(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))  # union
                continue
            if key == "slurm.extra" and isinstance(value, (list, tuple)):  # union; a later layer's option wins
                from hpctrain.spec.sbatch_args import merge_extra

                value = merge_extra(nested.get("slurm", {}).get("extra", ()), value)
            parts = key.split(".")
            if len(parts) == 3 or (parts[0] == "env" and len(parts) == 2):
                target = nested.setdefault(parts[0], {})
                if len(parts) == 3:
                    target = target.setdefault(parts[1], {})
                    if not isinstance(target, dict):  # e.g. --set model.overrides=3 then model.overrides.x=1
                        raise bad_value(".".join(parts[:2]), target, "must be a table of keys and values",
                                        f"set {key} alone, or give {'.'.join(parts[:2])} as a table")
                target[parts[-1]] = value
            elif len(parts) == 2:
                section = nested.setdefault(parts[0], {})
                if isinstance(value, dict):
                    section.setdefault(parts[1], {}).update(value)
                else:
                    section[parts[1]] = value
            else:
                nested[key] = value
    nested["secret_env"] = tuple(dict.fromkeys(secrets))
    return nested


def _build(data: dict[str, Any], where: str = "spec") -> Spec:
    """Nested dict -> Spec. Unknown keys are refused; lists become tuples for tuple fields."""
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS:
            cls = SECTIONS[key]
            hints = field_types(cls)
            sub: dict[str, Any] = {}
            for name, v in value.items():
                if name not in hints:
                    raise unknown_key(f"{where} [{key}]", name, hints)
                sub[name] = tuple(v) if isinstance(v, list) and typing.get_origin(hints[name]) is tuple else v
            kwargs[key] = cls(**sub)
        elif key in ("name", "site", "env"):
            kwargs[key] = value
        elif key == "secret_env":
            kwargs[key] = tuple(value) if isinstance(value, list) else value
        else:
            raise unknown_key(where, key, [*TOP_SCALARS, *SECTIONS, "env"])
    return Spec(**kwargs)


def load_run_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML run file into a dict (syntax errors name the file and line)."""
    from hpctrain.spec.site import read_toml

    return read_toml(Path(path), "run file")


def resolve(run_file: str | Path | None, flags: dict[str, Any], site: str | None = None, *,
            check: bool = True) -> Spec:
    """Merge defaults < fine-tuning defaults < site profile < run file < flags into a validated, frozen Spec.

    `flags` maps dotted keys ("resources.nodes", "train.lr", "env.NCCL_DEBUG", "name") to values;
    strings are converted to the field's type. The site comes from `site`, else the flags, else the
    run file's `site` key; the run file's `[sites.NAME]` tables define profiles inline.
    `check=False` skips the filesystem checks (`hpctrain plan` previews a run from anywhere).
    """
    return resolve_with_defaults(run_file, flags, site, check=check)[0]


def resolve_with_defaults(run_file: str | Path | None, flags: dict[str, Any], site: str | None = None, *,
                          check: bool = True) -> tuple[Spec, list[Default]]:
    """`resolve`, and the fine-tuning defaults it applied, each with its reason (hpctrain.spec.finetune):
    the plan records them and `hpctrain plan`/`submit` print them."""
    from hpctrain.spec import site as config

    data = load_run_file(run_file) if run_file else {}
    inline = data.pop("sites", {})
    if not isinstance(inline, dict):
        raise bad_value("sites", inline, "must hold tables", "write [sites.NAME] tables")
    run_layer = _flatten(data, f"run file {str(run_file)!r}" if run_file else "run file")
    flags = {k: v for k, v in flags.items() if v is not None}
    site_name = site or flags.get("site") or run_layer.get("site") or ""
    site_layer: dict[str, Any] = {}
    by_path = config.site_path(str(site_name)) if site_name else None
    if by_path is not None:  # --site path/to/NAME.toml: the profile NAME, read from that file
        site_name = by_path.stem
        site_layer = config.site_to_overrides(site_name, config.read_toml(by_path, f"site file {str(by_path)!r}"))
    elif site_name:
        near = Path(run_file).parent if run_file else None
        site_layer = config.site_to_overrides(site_name, config.load_site(str(site_name), inline, near))
    layers = [site_layer, run_layer, flags, {"site": site_name}]
    applied = finetune.defaults(*_lookup(_merge(layers)))
    try:
        spec = absolute_paths(_build(_merge([{d.key: d.value for d in applied}, *layers])))
    except HpcUsageError as exc:  # e.g. min_lr set above the default lr: say where the other value came from
        if not applied:
            raise
        chosen = ", ".join(f"{d.key} = {finetune.shown(d.value)}" for d in applied)
        raise HpcUsageError(f"{exc.message} (fine-tuning defaults for a pretrained [model] path applied here: "
                            f"{chosen}; a key set in the run file or with --set replaces its default)") from None
    if check:
        check_paths(spec)
    return spec, applied


def _lookup(nested: dict[str, Any]) -> tuple[Callable[[str], Any], frozenset[str]]:
    """(value of a dotted key in a merged request, else hpctrain's default; the keys a layer set)."""
    explicit = frozenset(f"{s}.{k}" for s, sub in nested.items() if s in SECTIONS for k in sub)

    def get(key: str) -> Any:
        section, _, name = key.partition(".")
        given = nested.get(section, {})
        return given[name] if name in given else getattr(SECTIONS[section](), name)
    return get, explicit


def absolute_paths(spec: Spec) -> Spec:
    """Relative model/data/tokenizer/template paths -> absolute (from the current directory).

    Ranks run in other directories, often in containers; spec.toml must not depend on where
    `hpctrain submit` was typed.
    """
    import dataclasses

    from hpctrain.spec.presets import PRESETS

    def absol(p: str) -> str:
        return str(Path(p).expanduser().absolute()) if p else p

    m, d, la = spec.model, spec.data, spec.launch
    model = dataclasses.replace(m, path=absol(m.path), config=m.config if m.config in PRESETS else absol(m.config))
    data = dataclasses.replace(d, source=d.source if d.source == "synthetic" else absol(d.source),
                               tokenizer=d.tokenizer if d.tokenizer == "byte" else absol(d.tokenizer))
    launch = dataclasses.replace(la, template_dir=absol(la.template_dir), script=absol(la.script))
    if spec.parallel.nvme_path and not spec.parallel.nvme_path.startswith("/"):
        raise bad_value("parallel.nvme_path", spec.parallel.nvme_path, "must be an absolute node-local path",
                        how_to_set("parallel.nvme_path", "/local/nvme"))
    return dataclasses.replace(spec, model=model, data=data, launch=launch)


def _exists(path: Path, kind: str = "") -> bool:
    """Path.exists/is_dir/is_file that answer False, not raise, for a name too long, a symlink loop, ..."""
    try:
        return path.is_dir() if kind == "dir" else path.is_file() if kind == "file" else path.exists()
    except (OSError, ValueError):  # ENAMETOOLONG, EACCES; ValueError: a NUL byte
        return False


def _check_lora_targets(spec: Spec, folder: Path) -> None:
    """[lora] target_modules of which none names a module of the model's weights: PEFT refused it on every rank,
    after the allocation. Matched as PEFT matches a list (the name, or its last dotted parts); '*' as a glob."""
    import fnmatch

    targets = spec.lora.target_modules if spec.lora.r else ()
    modules = _weight_modules(folder) if targets else None
    if not modules:
        return
    def hit(t: str) -> bool:
        if "*" in t:
            return any(fnmatch.fnmatchcase(m, t) or fnmatch.fnmatchcase(m, f"*.{t}") for m in modules)
        return any(m == t or m.endswith(f".{t}") for m in modules)

    leaves = sorted({m.rsplit(".", 1)[-1] for m in modules if not m.rsplit(".", 1)[-1].isdigit()})
    need(any(hit(t) for t in targets), "lora.target_modules", list(targets),
         f"none of them names a module of the model in {folder} (its weights' modules end in: "
         f"{', '.join(leaves[:16])}{', ...' if len(leaves) > 16 else ''})",
         'set [lora] target_modules to some of those (e.g. ["q_proj", "v_proj"]), or [] for every linear layer')


def _weight_modules(folder: Path) -> set[str] | None:
    """The module names of a model folder's weights, from the safetensors index or the files' headers (no torch);
    None when the folder does not say (pytorch_model.bin only, unreadable)."""
    import json
    import struct

    try:
        index = next(folder.glob("*.safetensors.index.json"), None)
        if index is not None:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        else:
            names = set()
            for f in folder.glob("*.safetensors"):
                with open(f, "rb") as fh:
                    (size,) = struct.unpack("<Q", fh.read(8))
                    if size > 100 << 20:  # a header is kilobytes to a few MB
                        return None
                    names |= set(json.loads(fh.read(size))) - {"__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return {n.rsplit(".", 1)[0] for n in names if "." in n} or None


WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def _has_weights(folder: Path) -> bool:
    """A model folder holds weight files transformers loads (the node reads safetensors under ZeRO-3; ZeRO 0-2's
    from_pretrained also reads .bin): a folder of config and tokenizer only failed every rank after allocation."""
    try:
        return any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_GLOBS)
    except (OSError, ValueError):
        return True  # unreadable here: the node says what it finds


def user_script(spec: Spec) -> bool:
    """The run launches the user's own script or module, not hpctrain's trainer."""
    return bool(spec.launch.script or spec.launch.module)


def check_paths(spec: Spec) -> None:
    """Submit-time checks that need the filesystem: model and data must exist on the shared FS.

    Kept out of __post_init__ so that the node can read spec.toml without re-checking.
    """
    from hpctrain.spec.presets import PRESETS

    m = spec.model
    if spec.launch.script:
        need(_exists(Path(spec.launch.script), "file"), "launch.script", spec.launch.script, "not a file",
             "pass --script with the path of your training script on the shared filesystem")
    if not m.path and not m.config and not user_script(spec):
        raise bad_value("model.path", "", "no model given",
                        "pass --model /shared/models/NAME (a local HF folder) or set [model] config = "
                        "'llama-tiny' (a preset or a config.json path)")
    if m.path:
        p = Path(m.path)
        need(_exists(p, "dir") and _exists(p / "config.json", "file"), "model.path", m.path,
              "not a local model folder with a config.json (compute nodes are offline: no hub ids)",
              "pass --model with the folder from `huggingface-cli download --local-dir DIR`")
        need(user_script(spec) or _has_weights(p), "model.path", m.path,
             "holds a config.json but no weights (*.safetensors, or pytorch_model*.bin for ZeRO 0-2)",
             "download the whole model folder (`huggingface-cli download ORG/NAME --local-dir DIR`), or set "
             "[model] config instead of path to train from random weights")
        _check_lora_targets(spec, p)
    if m.config and m.config not in PRESETS:
        need(_exists(Path(m.config), "file"), "model.config", m.config,
              "neither a preset nor an existing config.json", f"use a preset ({', '.join(PRESETS)}) or a path")
    src = spec.data.source
    if src != "synthetic":
        need(_exists(Path(src)), "data.source", src, "path does not exist",
              "pass --data with an existing .jsonl/.txt file or folder, or 'synthetic'")
    tok = spec.data.tokenizer
    if tok != "byte":
        need(_exists(Path(tok), "dir"), "data.tokenizer", tok, "not a local tokenizer folder",
              "set [data] tokenizer = 'byte' or a folder holding tokenizer.json")
    if spec.code.dir:  # the batch script cds there: a missing folder killed the job at its first line
        need(_exists(Path(spec.code.dir), "dir"), "code.dir", spec.code.dir, "not an existing folder (the job "
             "would die at its `cd`)", "leave code.dir to `hpctrain submit --snapshot`, which sets it to the "
             "snapshot it makes, or remove it to run in the submit folder")


# --------------------------------------------------------------------------------------------------
# spec.toml: an exact, deterministic round trip (tomllib reads, tomli-w writes).

_TOML_HEADER = ("# Resolved hpctrain spec: written at submit time, read by every rank. Do not edit;\n"
                "# change the run file or flags and submit again.\n")


def _as_dict(spec: Spec) -> dict[str, Any]:
    """The spec as nested plain data, in the field order of the dataclasses (so the text is stable)."""
    data: dict[str, Any] = {name: getattr(spec, name) for name in TOP_SCALARS}
    data["env"] = dict(spec.env)
    for section in SECTIONS:
        obj = getattr(spec, section)
        data[section] = {f.name: getattr(obj, f.name) for f in fields(obj)}
    return data


def to_toml(spec: Spec) -> str:
    """The resolved spec as TOML text; `from_toml_text(to_toml(s)) == s` for every valid spec.

    Secret values never appear: [env] refuses them at validation, and secret_env holds names only.
    """
    return _TOML_HEADER + tomli_w.dumps(_as_dict(spec))


def from_toml_text(text: str) -> Spec:
    """Parse spec.toml text back into a Spec (strict: unknown keys are errors)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HpcUsageError(f"spec.toml: invalid TOML ({exc}). Fix: re-render it with hpctrain submit") from None
    return _build(data, "spec.toml")


def read_resolved(run_dir: str | Path) -> Spec:
    """Read RUN_DIR/spec.toml, the request exactly as dispatched (used by the node)."""
    from hpctrain.runs.folder import RunFolder

    return from_toml_text(RunFolder(run_dir).spec_toml.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------------
# Sweeps

def parse_sweep(items: list[str]) -> list[dict[str, Any]]:
    """`["train.lr=1e-4,3e-4", "train.seed=1,2"]` -> one flag-override dict per grid point.

    Keys that change the allocation or the launch line are refused: a sweep is one job array, and
    an array has one shape. Values are type-checked here so a typo fails before anything is written.
    """
    axes: list[tuple[str, list[Any]]] = []
    _check_sweep_size(items)
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise bad_value("--sweep", item, "expected KEY=V1,V2", "write e.g. --sweep train.lr=1e-4,3e-4")
        if key.startswith(UNSWEEPABLE) or key == "name":
            raise bad_value("--sweep", key, "a sweep is one job array with one allocation shape and launch line",
                            "sweep train/parallel/data/model/checkpoint keys; submit other shapes separately")
        if any(k == key for k, _ in axes):
            raise bad_value("--sweep", key, "given twice", "merge the values into one --sweep")
        vals = [v.strip() for v in values.split(",")]
        if not vals or any(v == "" for v in vals):
            raise bad_value("--sweep", item, "empty value", "list values separated by commas")
        for v in vals:
            coerce(key, v)
        axes.append((key, vals))
    keys = [k for k, _ in axes]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in axes))]


# A sweep is one run folder (spec, plan, DeepSpeed config, a resolve and a render) per point: about 17 ms
# each here, so 1,000 points take ~17 s and 100,000 ran until killed. Both bounds are checked on the text,
# before a value is type-checked or the grid is built.
MAX_SWEEP_POINTS = 1_000
MAX_SWEEP_BYTES = 1 << 20  # the swept values of every point together, as spec.toml will hold them


def _check_sweep_size(items: list[str]) -> None:
    points, longest = 1, 0
    for item in items:
        key, _, values = item.partition("=")
        vals = values.split(",")
        points *= len(vals)
        longest += len(key) + max(len(v) for v in vals)
        if points > MAX_SWEEP_POINTS:
            total = math.prod(len(i.partition("=")[2].split(",")) for i in items)
            raise bad_value("--sweep", " ".join(items), f"{total:,} grid points, more than the limit of "
                            f"{MAX_SWEEP_POINTS:,} (one run folder and one job array task each)",
                            "sweep fewer values, or split the grid into several submissions")
    if points * longest > MAX_SWEEP_BYTES:
        raise bad_value("--sweep", " ".join(items), f"up to {points * longest:,} bytes of swept values over "
                        f"{points:,} points, more than the limit of {MAX_SWEEP_BYTES:,}",
                        "sweep shorter values (a path or a name, not file contents)")
