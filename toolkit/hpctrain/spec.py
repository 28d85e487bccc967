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

import functools
import itertools
import math
import re
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Union

import tomllib

from hpctrain.errors import HpcUsageError, bad_value, unknown_key

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
    gpu_mem_gb: float = 0.0  # memory of one GPU for the plan's fit check; 0 = assume 80 (A100/H100 80GB)

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True, kw_only=True)
class Launch:
    executor: ExecutorName = "auto"  # auto = slurm if `sbatch` is on PATH, else local
    launcher: Launcher = "srun"  # srun: one task per rank; deepspeed: its runner with our hostfile
    retries: int = 3  # automatic resubmissions (capped in resubmit policy)
    preflight_timeout_s: int = 60  # rendezvous + all-reduce must finish within this
    modules: tuple[str, ...] = ()  # `module load` lines (site profiles set these)
    template_dir: str = ""  # folder whose *.j2 override the shipped templates ("" = config dir's templates/)

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True, kw_only=True)
class Model:
    """Exactly one of `path` (from_pretrained on a local folder) or `config` (from_config)."""

    path: str = ""  # local HF folder (compute nodes are offline: never a hub id)
    config: str = ""  # path to a config.json, or a built-in preset name such as "llama-tiny"
    overrides: dict[str, object] = field(default_factory=dict)  # config.json keys to override
    freeze: tuple[str, ...] = ()  # fnmatch patterns of parameter names to freeze

    def __post_init__(self) -> None:
        _check(self)


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

    def __post_init__(self) -> None:
        _check(self)


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

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True, kw_only=True)
class Parallel:
    zero: Zero = 3
    offload: Offload = "none"
    offload_device: OffloadDevice = "cpu"
    nvme_path: str = ""  # required when offload_device == "nvme"
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    every_steps: int = 0  # 0 = off
    every_minutes: float = 0.0  # 0 = off
    keep: int = 2  # complete checkpoints kept
    export_hf: bool = True  # consolidated HF folder at the end

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True, kw_only=True)
class Container:
    runtime: Runtime = "none"
    image: str = ""
    mounts: tuple[str, ...] = ()  # extra "SRC[:DST]" binds; run folder, data and model are bound automatically

    def __post_init__(self) -> None:
        _check(self)


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

    def __post_init__(self) -> None:
        _check(self)


# --------------------------------------------------------------------------------------------------
# Field metadata: sections, CLI flags (for fix messages), secrets.

SECTIONS: dict[str, type] = {
    "resources": Resources,
    "launch": Launch,
    "model": Model,
    "data": Data,
    "train": Train,
    "parallel": Parallel,
    "checkpoint": Checkpoint,
    "container": Container,
}
TOP_SCALARS = ("name", "site", "secret_env")
# These variables are secret whatever the site says: they reach ranks by name through --export=ALL.
ALWAYS_SECRET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
# A sweep makes one job array, and an array has one allocation shape and one launch line.
UNSWEEPABLE = ("resources.", "launch.", "container.", "site", "secret_env", "env.")

FLAG_FOR: dict[str, str] = {
    "resources.nodes": "--nodes", "resources.gpus_per_node": "--gpus-per-node",
    "resources.cpus_per_task": "--cpus-per-task", "resources.mem": "--mem", "resources.time": "--time",
    "resources.partition": "--partition", "resources.account": "--account", "resources.qos": "--qos",
    "name": "--job-name", "parallel.zero": "--zero", "parallel.offload": "--offload",
    "parallel.offload_device": "--offload-device", "parallel.nvme_path": "--nvme-path",
    "train.precision": "--precision", "train.micro_batch": "--micro-batch", "train.grad_accum": "--grad-accum",
    "train.global_batch": "--global-batch", "parallel.pp": "--pp", "parallel.tp": "--tp",
    "launch.launcher": "--launcher", "launch.executor": "--executor", "site": "--site",
    "train.steps": "--steps", "model.path": "--model", "data.source": "--data",
}

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_NAME_PARTS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS"}
_SECRET_VALUE = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|(sk|pk|ghp|gho|ghs|github_pat|xox[abpr])[-_][A-Za-z0-9_-]{16,}"
    r"|[0-9a-f]{40}|AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----.*)$",
    re.DOTALL,
)
_MEM = re.compile(r"^\d+[KMGT]?$")
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}(:\d{1,2})?)?)$")
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:@+\-\[\]|&*!()]*$")


def how_to_set(key: str, example: object) -> str:
    """The fix half of a message: the CLI flag if there is one, and the run-file spelling."""
    section, _, name = key.rpartition(".")
    where = f"[{section}] {name} = {example}" if section else f"{name} = {example}"
    flag = FLAG_FOR.get(key)
    return f"pass {flag} {example} or set {where} in the run file" if flag else f"set {where} in the run file"


def secret_names(spec: Spec) -> tuple[str, ...]:
    """Every variable treated as secret for this spec: the always-secret ones plus the site's."""
    return tuple(dict.fromkeys((*ALWAYS_SECRET, *spec.secret_env)))


def looks_secret(name: str, value: str) -> bool:
    """Guess whether an [env] entry carries a credential, by its name or the shape of its value."""
    parts = set(name.upper().split("_"))
    return bool(parts & _SECRET_NAME_PARTS) or name.upper().endswith("API_KEY") or bool(
        _SECRET_VALUE.match(value.strip()))


# --------------------------------------------------------------------------------------------------
# Type checks shared by every section (run in each dataclass's __post_init__).

@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_of(obj: object) -> str:
    for name, cls in SECTIONS.items():
        if type(obj) is cls:
            return f"{name}."
    return ""


def _type_ok(value: object, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin is Literal:
        return value in typing.get_args(hint) and not isinstance(value, bool)
    if origin is Union:
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if origin is tuple:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return True


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin is Union:
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if origin is tuple:
        return "a list of strings"
    if origin is dict:
        return "a table"
    return f"a {getattr(hint, '__name__', hint)}"


def _check(obj: Any) -> None:
    """Validate types, then the section's own rules; normalise ints given for float fields."""
    prefix = _section_of(obj)
    for f in fields(obj):
        value = getattr(obj, f.name)
        hint = _hints(typing.cast(type, type(obj)))[f.name]
        if not _type_ok(value, hint):
            raise bad_value(prefix + f.name, value, f"must be {_describe(hint)}",
                            how_to_set(prefix + f.name, _example(hint, f.default)))
        if hint is float and isinstance(value, int):
            object.__setattr__(obj, f.name, float(value))
        if isinstance(value, str) and "\x00" in value:
            raise bad_value(prefix + f.name, value, "contains a NUL byte", "remove it")
    rule = _RULES.get(type(obj).__name__)
    if rule:
        rule(obj)


def _example(hint: Any, default: object) -> str:
    if typing.get_origin(hint) is Literal:
        return str(typing.get_args(hint)[0])
    if default is not MISSING:
        return repr(default) if isinstance(default, str) else str(default).lower()
    return "..."


def _need(ok: bool, key: str, value: object, why: str, fix: str) -> None:
    if not ok:
        raise bad_value(key, value, why, fix)


def _no_controls(key: str, value: str, allow_newline: bool = False) -> None:
    bad = [c for c in value if ord(c) < 32 and not (allow_newline and c in "\n\t")]
    _need(not bad, key, value, "contains control characters (newline, tab, ...)", "remove them")


def _rules_resources(r: Resources) -> None:
    _need(r.nodes >= 1, "resources.nodes", r.nodes, "a job needs at least one node", how_to_set("resources.nodes", 1))
    _need(r.gpus_per_node >= 0, "resources.gpus_per_node", r.gpus_per_node, "cannot be negative",
          how_to_set("resources.gpus_per_node", 0) + " (0 = CPU ranks)")
    _need(r.tasks_per_node >= 0, "resources.tasks_per_node", r.tasks_per_node, "cannot be negative",
          "set [resources] tasks_per_node = 0 (derive) or a positive count")
    _need(not (r.gpus_per_node and r.tasks_per_node and r.gpus_per_node != r.tasks_per_node),
          "resources.tasks_per_node", r.tasks_per_node,
          f"one rank drives one GPU, but gpus_per_node is {r.gpus_per_node}",
          f"set [resources] tasks_per_node = {r.gpus_per_node} or 0 (derive)")
    _need(r.cpus_per_task >= 1, "resources.cpus_per_task", r.cpus_per_task, "must be at least 1",
          how_to_set("resources.cpus_per_task", 1))
    _need(r.mem == "" or bool(_MEM.match(r.mem)), "resources.mem", r.mem, "not a SLURM memory size",
          how_to_set("resources.mem", "64G") + " (digits with K/M/G/T, or empty for the default)")
    _need(bool(_TIME.match(r.time)), "resources.time", r.time, "not a SLURM time limit",
          how_to_set("resources.time", "04:00:00") + " (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(r, key)
        _need(bool(_SLURM_WORD.match(value)), f"resources.{key}", value,
              "contains characters SLURM does not accept here (space, quote, $, ;, newline, ...)",
              how_to_set(f"resources.{key}", "NAME") + " with a plain name")
    for host in r.exclude:
        _need(bool(re.match(r"^[A-Za-z0-9_.\-\[\],]+$", host)), "resources.exclude", host,
              "not a host name or hostlist", "list plain host names such as 'node3'")
    _need(r.signal_seconds >= 1, "resources.signal_seconds", r.signal_seconds, "must be at least 1",
          "set [resources] signal_seconds = 90")
    _need(r.gpu_mem_gb >= 0, "resources.gpu_mem_gb", r.gpu_mem_gb, "cannot be negative",
          "set [resources] gpu_mem_gb = 80 (or 0 to assume 80)")


def _rules_launch(x: Launch) -> None:
    _need(x.retries >= 0, "launch.retries", x.retries, "cannot be negative", "set [launch] retries = 3")
    _need(x.preflight_timeout_s >= 1, "launch.preflight_timeout_s", x.preflight_timeout_s,
          "must be at least 1 second", "set [launch] preflight_timeout_s = 60")
    for m in x.modules:
        _no_controls("launch.modules", m)
        _need(bool(m.strip()), "launch.modules", m, "empty module name", "remove the empty entry")


def _rules_model(m: Model) -> None:
    _need(not (m.path and m.config), "model.path", m.path,
          f"both model.path and model.config ({m.config!r}) are set; a run starts from exactly one",
          "keep path (pretrained weights) or config (fresh init), not both")


def _rules_data(d: Data) -> None:
    _need(d.seq_len >= 1, "data.seq_len", d.seq_len, "must be at least 1", "set [data] seq_len = 512")
    _need(d.tokens_per_batch >= 0, "data.tokens_per_batch", d.tokens_per_batch, "cannot be negative",
          "set [data] tokens_per_batch = 0 (micro_batch * seq_len)")


def _rules_train(t: Train) -> None:
    _need(t.steps >= 1, "train.steps", t.steps, "must be at least 1", how_to_set("train.steps", 100))
    for key in ("micro_batch", "grad_accum", "global_batch"):
        _need(getattr(t, key) >= 0, f"train.{key}", getattr(t, key), "cannot be negative",
              how_to_set(f"train.{key}", 1) + " (or 0 to derive it)")
    _need(t.lr > 0, "train.lr", t.lr, "must be positive", "set [train] lr = 3e-4")
    _need(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must lie in [0, lr={t.lr}]",
          f"set [train] min_lr = {t.lr / 10:g}")
    _need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "cannot be negative", "set it to 0")
    _need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "cannot be negative", "set it to 0.0")
    _need(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "cannot be negative", "set it to 1.0 (0 = off)")
    _need(t.peak_tflops >= 0, "train.peak_tflops", t.peak_tflops, "cannot be negative", "set it to 0 (unknown)")


def _rules_parallel(p: Parallel) -> None:
    _need(p.zero == "auto" or p.zero in (0, 1, 2, 3), "parallel.zero", p.zero,
          "DeepSpeed ZeRO stages are 0, 1, 2 and 3", how_to_set("parallel.zero", 3) + " (or auto)")
    _need(p.pp >= 1, "parallel.pp", p.pp, "pipeline degree must be at least 1", how_to_set("parallel.pp", 1))
    _need(p.tp >= 1, "parallel.tp", p.tp, "tensor degree must be at least 1", how_to_set("parallel.tp", 1))
    if p.offload in ("param", "all"):
        _need(p.zero in (3, "auto"), "parallel.offload", p.offload,
              f"parameter offload needs ZeRO stage 3 (zero is {p.zero})",
              "pass --zero 3, or --offload optimizer")
    if p.offload == "optimizer":
        _need(p.zero != 0, "parallel.offload", p.offload, "optimizer offload needs ZeRO stage 1, 2 or 3",
              "pass --zero 1 (or higher), or --offload none")
    if p.offload != "none" and p.offload_device == "nvme":
        _need(bool(p.nvme_path), "parallel.nvme_path", p.nvme_path, "NVMe offload needs a local NVMe folder",
              how_to_set("parallel.nvme_path", "/local/nvme"))
    _need(p.pp == 1 or p.zero in (0, 1, "auto"), "parallel.zero", p.zero,
          f"DeepSpeed's pipeline engine (pp={p.pp}) supports ZeRO 0 and 1 only",
          "pass --zero 1, or --pp 1")
    _no_controls("parallel.nvme_path", p.nvme_path)


def _rules_checkpoint(c: Checkpoint) -> None:
    _need(c.every_steps >= 0, "checkpoint.every_steps", c.every_steps, "cannot be negative", "set it to 0 (off)")
    _need(c.every_minutes >= 0, "checkpoint.every_minutes", c.every_minutes, "cannot be negative",
          "set it to 0 (off)")
    _need(c.keep >= 1, "checkpoint.keep", c.keep, "at least one checkpoint must be kept to resume",
          "set [checkpoint] keep = 2")


def _rules_container(c: Container) -> None:
    _need(c.runtime == "none" or bool(c.image), "container.image", c.image,
          f"runtime {c.runtime!r} needs an image", f"pass --container {c.runtime}:IMAGE")
    _need(c.runtime != "none" or not c.image, "container.runtime", c.runtime,
          f"an image ({c.image!r}) is set but no runtime", "pass --container RUNTIME:IMAGE "
          "(apptainer, pyxis, podman or charliecloud)")
    _no_controls("container.image", c.image)
    for m in c.mounts:
        _no_controls("container.mounts", m)
        _need(bool(m) and "," not in m and m.count(":") <= 2, "container.mounts", m,
              "a mount is SRC[:DST[:OPTS]] without commas", "write one mount per list entry")


def _rules_spec(s: Spec) -> None:
    _need(bool(s.name.strip()), "name", s.name, "a run needs a name", how_to_set("name", "'my-run'"))
    _need(len(s.name) <= 200, "name", s.name[:40] + "...", "longer than 200 characters", "shorten it")
    _no_controls("name", s.name)
    _need(s.site == "" or bool(re.match(r"^[A-Za-z0-9_.-]+$", s.site)), "site", s.site,
          "site profile names are letters, digits, '_', '.', '-'", "rename the profile")
    secrets = secret_names(s)
    for name in s.secret_env:
        _need(bool(_ENV_NAME.match(name)), "secret_env", name, "not an environment variable name",
              "use letters, digits and '_'")
    for key, value in s.env.items():
        _need(bool(_ENV_NAME.match(key)), f"env.{key}", value, "not an environment variable name",
              "use letters, digits and '_' (not starting with a digit)")
        _need(isinstance(value, str), f"env.{key}", value, "env values are strings",
              f'write {key} = "{value}" in [env]')
        _need(key not in secrets and not looks_secret(key, value), f"env.{key}", "<redacted>",
              "looks like a secret, and [env] is written into spec.toml and sbatch.sh",
              f"remove it from [env], export {key} in the submitting shell, and list it in secret_env "
              f"(HF_TOKEN and WANDB_API_KEY always pass this way)")


_RULES: dict[str, Any] = {
    "Resources": _rules_resources, "Launch": _rules_launch, "Model": _rules_model, "Data": _rules_data,
    "Train": _rules_train, "Parallel": _rules_parallel, "Checkpoint": _rules_checkpoint,
    "Container": _rules_container, "Spec": _rules_spec,
}


# --------------------------------------------------------------------------------------------------
# Building a Spec from nested dicts (run file, spec.toml) and from dotted overrides (site, flags).

def _field_hint(key: str) -> Any:
    """Type hint of a dotted key such as 'train.lr', or raise listing the valid keys."""
    section, _, name = key.partition(".")
    if section in SECTIONS and name:
        hints = _hints(SECTIONS[section])
        if name in hints:
            return hints[name]
        if "." in name and typing.get_origin(hints.get(name.split(".")[0])) is dict:
            return object  # model.overrides.rope_theta: any TOML value
        raise unknown_key(f"[{section}]", name, hints)
    if section == "env" and name:
        return str
    if key in TOP_SCALARS:
        return _hints(Spec)[key]
    valid = [*TOP_SCALARS, *(f"{s}.{f}" for s, c in SECTIONS.items() for f in _hints(c)), "env.NAME"]
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
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint == Zero:
            return "auto" if text == "auto" else int(text)
        if typing.get_origin(hint) is tuple:
            return tuple(p.strip() for p in text.split(",") if p.strip())
        if hint is object:
            try:
                return tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                return value
    except ValueError:
        raise bad_value(key, value, f"must be {_describe(hint)}", how_to_set(key, "...")) from None
    return value


def _flatten(data: dict[str, Any], where: str) -> dict[str, Any]:
    """Nested run-file dict -> dotted keys; env and dict fields merge key by key."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise bad_value(key, value, "must be a table", f"write [{key}] in {where}")
            hints = _hints(SECTIONS[key])
            for name, v in value.items():
                if name not in hints:
                    raise unknown_key(f"{where} [{key}]", name, hints)
                if typing.get_origin(hints[name]) is dict and isinstance(v, dict):
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
            parts = key.split(".")
            if len(parts) == 3 or (parts[0] == "env" and len(parts) == 2):
                target = nested.setdefault(parts[0], {})
                if len(parts) == 3:
                    target = target.setdefault(parts[1], {})
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
            hints = _hints(cls)
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
    from hpctrain.config import read_toml

    return read_toml(Path(path), "run file")


def resolve(run_file: str | Path | None, flags: dict[str, Any], site: str | None = None, *,
            check: bool = True) -> Spec:
    """Merge defaults < site profile < run file < flags into a validated, frozen Spec.

    `flags` maps dotted keys ("resources.nodes", "train.lr", "env.NCCL_DEBUG", "name") to values;
    strings are converted to the field's type. The site comes from `site`, else the flags, else the
    run file's `site` key; the run file's `[sites.NAME]` tables define profiles inline.
    `check=False` skips the filesystem checks (`hpctrain plan` previews a run from anywhere).
    """
    from hpctrain import config

    data = load_run_file(run_file) if run_file else {}
    inline = data.pop("sites", {})
    if not isinstance(inline, dict):
        raise bad_value("sites", inline, "must hold tables", "write [sites.NAME] tables")
    run_layer = _flatten(data, f"run file {str(run_file)!r}" if run_file else "run file")
    flags = {k: v for k, v in flags.items() if v is not None}
    site_name = site or flags.get("site") or run_layer.get("site") or ""
    site_layer: dict[str, Any] = {}
    if site_name:
        site_layer = config.site_to_overrides(site_name, config.load_site(str(site_name), inline))
    spec = absolute_paths(_build(_merge([site_layer, run_layer, flags, {"site": site_name}])))
    if check:
        check_paths(spec)
    return spec


def absolute_paths(spec: Spec) -> Spec:
    """Relative model/data/tokenizer/template paths -> absolute (from the current directory).

    Ranks run in other directories, often in containers; spec.toml must not depend on where
    `hpctrain submit` was typed.
    """
    import dataclasses

    from hpctrain.presets import PRESETS

    def absol(p: str) -> str:
        return str(Path(p).expanduser().absolute()) if p else p

    m, d, la = spec.model, spec.data, spec.launch
    model = dataclasses.replace(m, path=absol(m.path), config=m.config if m.config in PRESETS else absol(m.config))
    data = dataclasses.replace(d, source=d.source if d.source == "synthetic" else absol(d.source),
                               tokenizer=d.tokenizer if d.tokenizer == "byte" else absol(d.tokenizer))
    launch = dataclasses.replace(la, template_dir=absol(la.template_dir))
    if spec.parallel.nvme_path and not spec.parallel.nvme_path.startswith("/"):
        raise bad_value("parallel.nvme_path", spec.parallel.nvme_path, "must be an absolute node-local path",
                        how_to_set("parallel.nvme_path", "/local/nvme"))
    return dataclasses.replace(spec, model=model, data=data, launch=launch)


def check_paths(spec: Spec) -> None:
    """Submit-time checks that need the filesystem: model and data must exist on the shared FS.

    Kept out of __post_init__ so that the node can read spec.toml without re-checking.
    """
    from hpctrain.presets import PRESETS

    m = spec.model
    if not m.path and not m.config:
        raise bad_value("model.path", "", "no model given",
                        "pass --model /shared/models/NAME (a local HF folder) or set [model] config = "
                        "'llama-tiny' (a preset or a config.json path)")
    if m.path:
        p = Path(m.path)
        _need(p.is_dir() and (p / "config.json").is_file(), "model.path", m.path,
              "not a local model folder with a config.json (compute nodes are offline: no hub ids)",
              "pass --model with the folder from `huggingface-cli download --local-dir DIR`")
    if m.config and m.config not in PRESETS:
        _need(Path(m.config).is_file(), "model.config", m.config,
              "neither a preset nor an existing config.json", f"use a preset ({', '.join(PRESETS)}) or a path")
    src = spec.data.source
    if src != "synthetic":
        _need(Path(src).exists(), "data.source", src, "path does not exist",
              "pass --data with an existing .jsonl/.txt file or folder, or 'synthetic'")
    tok = spec.data.tokenizer
    if tok != "byte":
        _need(Path(tok).is_dir(), "data.tokenizer", tok, "not a local tokenizer folder",
              "set [data] tokenizer = 'byte' or a folder holding tokenizer.json")


# --------------------------------------------------------------------------------------------------
# spec.toml: an exact, deterministic round trip (tomllib reads; this small writer writes).

def _toml_key(key: str) -> str:
    return key if re.match(r"^[A-Za-z0-9_-]+$", key) else _toml_str(key)


def _toml_str(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out) + '"'


def toml_value(value: object) -> str:
    """One TOML value (strings, ints, finite floats, bools, arrays, inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write non-finite float {value!r} to spec.toml")
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(spec: Spec) -> str:
    """The resolved spec as TOML text; `from_toml_text(to_toml(s)) == s` for every valid spec.

    Secret values never appear: [env] refuses them at validation, and secret_env holds names only.
    """
    lines = ["# Resolved hpctrain spec: written at submit time, read by every rank. Do not edit;",
             "# change the run file or flags and submit again.",
             f"name = {toml_value(spec.name)}", f"site = {toml_value(spec.site)}",
             f"secret_env = {toml_value(spec.secret_env)}", "", "[env]"]
    lines += [f"{_toml_key(k)} = {toml_value(v)}" for k, v in spec.env.items()]
    for section in SECTIONS:
        obj = getattr(spec, section)
        lines += ["", f"[{section}]"]
        tables = []
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, dict):
                tables.append((f.name, value))
            else:
                lines.append(f"{f.name} = {toml_value(value)}")
        for name, table in tables:
            lines += ["", f"[{section}.{name}]"]
            lines += [f"{_toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def from_toml_text(text: str) -> Spec:
    """Parse spec.toml text back into a Spec (strict: unknown keys are errors)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HpcUsageError(f"spec.toml: invalid TOML ({exc}). Fix: re-render it with hpctrain submit") from None
    return _build(data, "spec.toml")


def read_resolved(run_dir: str | Path) -> Spec:
    """Read RUN_DIR/spec.toml, the request exactly as dispatched (used by the node)."""
    return from_toml_text((Path(run_dir) / "spec.toml").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------------
# Sweeps

def parse_sweep(items: list[str]) -> list[dict[str, Any]]:
    """`["train.lr=1e-4,3e-4", "train.seed=1,2"]` -> one flag-override dict per grid point.

    Keys that change the allocation or the launch line are refused: a sweep is one job array, and
    an array has one shape. Values are type-checked here so a typo fails before anything is written.
    """
    axes: list[tuple[str, list[Any]]] = []
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
    return [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*(v for _, v in axes))]
