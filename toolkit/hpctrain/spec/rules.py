"""Validation of spec fields: types, per-section rules, secrets, and the wording of refusals.

Kept apart from spec/model.py so the dataclasses stay readable. Every dataclass's __post_init__ calls
`check(self)`; each refusal names the field, the bad value and the fix (the CLI flag when there is
one, and the run-file spelling).
"""

from __future__ import annotations

import functools
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any, Literal, Union

from hpctrain.errors import bad_value, check_path, did_you_mean, toml_value
from hpctrain.runs.folder import SBATCH_SH
from hpctrain.runs.tracking import TRACKERS
from hpctrain.spec.flags import FLAG_FOR

if TYPE_CHECKING:
    from hpctrain.spec.model import (
        Checkpoint,
        Code,
        Container,
        Data,
        Fault,
        Launch,
        Lora,
        Model,
        Parallel,
        Resources,
        Slurm,
        Spec,
        Tracking,
        Train,
    )

# Run-file sections are the dataclass names in lower case: Resources -> [resources].
SECTION_CLASSES = ("Resources", "Launch", "Fault", "Model", "Lora", "Data", "Train", "Parallel", "Checkpoint",
                   "Container", "Slurm", "Code", "Tracking")

from hpctrain.secret import (
    ALWAYS_SECRET,
    looks_secret,
    secret_values,
)

# Every validation pattern is used with fullmatch: `$` also matches before a final newline, so
# "WANDB_API_KEY\n" passed `re.match(r"^...$")` (issue 14, class 2).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MEM = re.compile(r"(\d+)([KMGT]?)")
_TIME = re.compile(r"\d{1,9}|\d{1,9}:\d{1,2}|\d{1,9}:\d{1,2}:\d{1,2}|\d{1,7}-\d{1,2}(:\d{1,2}(:\d{1,2})?)?")


def time_limit_s(text: str) -> int:
    """A SLURM time limit ("MM", "MM:SS", "HH:MM:SS", "D-HH[:MM[:SS]]", checked by _TIME) in seconds: the
    dispatcher's --time and the node's "how much time was left when the signal came" both read it."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        h, (m, s) = 0, (parts + [0])[:2]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,:@+\-\[\]|&*!()]*")
_HOSTLIST = re.compile(r"[A-Za-z0-9_.\-\[\],]+")
_SITE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def how_to_set(key: str, example: object) -> str:
    """The fix half of a message: the CLI flag (spec.flags) or `--set`, and the run-file spelling."""
    section, _, name = key.rpartition(".")
    where = f"[{section}] {name} = {example}" if section else f"{name} = {example}"
    flag = FLAG_FOR.get(key)
    return f"pass {flag} {example} or set {where} in the run file" if flag else (
        f"pass --set {key}={example} or set {where} in the run file")


def secret_names(spec: Spec) -> tuple[str, ...]:
    """Every variable treated as secret for this spec: the always-secret ones plus the site's."""
    return tuple(dict.fromkeys((*ALWAYS_SECRET, *spec.secret_env)))



# --------------------------------------------------------------------------------------------------
# Secret values: never in a rendered file, never in a message (issue 14, class 8).



def check_rendered(files: Mapping[str, str], spec: Spec) -> None:
    """The one check of rendered run files before they are written (dry run) or submitted.

    No secret's value may appear in any of them (the refusal names the variable, never the value),
    and the batch script holds no CR or other control character: sbatch refuses "DOS line breaks"
    and the refusal would otherwise read like a problem with the resources asked for.
    """
    from hpctrain.errors import HpcUsageError

    found = secret_values(secret_names(spec))
    for fname, text in files.items():
        for name, value in found.items():
            if value in text:
                raise HpcUsageError(
                    f"{fname}: the rendered file contains the value of the secret variable {name}. Fix: do not "
                    f"put secrets in [env], flags or paths; export {name} in the submitting shell and list it in "
                    "secret_env: it reaches the ranks through the environment")
    script = files.get(SBATCH_SH, "")
    for lineno, line in enumerate(script.split("\n"), 1):
        bad = _control_char(line.replace("\t", " "))
        if bad:
            raise bad_value("launch.template_dir", spec.launch.template_dir or "(shipped templates)",
                            f"the rendered sbatch.sh has {bad} on line {lineno}, which sbatch refuses",
                            "save the templates with Unix (LF) line endings and no control characters")




# --------------------------------------------------------------------------------------------------
# Type checks shared by every section (run in each dataclass's __post_init__).

@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (cached: __post_init__ runs for every instance)."""
    return dict(typing.get_type_hints(cls))


def _section_of(obj: object) -> str:
    name = type(obj).__name__
    return f"{name.lower()}." if name in SECTION_CLASSES else ""


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


def describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin is Union:
        return " or ".join(describe(h) for h in typing.get_args(hint))
    if origin is tuple:
        return "a list of strings"
    if origin is dict:
        return "a table"
    return f"a {getattr(hint, '__name__', hint)}"


def check(obj: Any) -> None:
    """Validate types, then the section's own rules; normalise ints given for float fields."""
    prefix = _section_of(obj)
    for f in fields(obj):
        value = getattr(obj, f.name)
        hint = field_types(typing.cast(type, type(obj)))[f.name]
        if not _type_ok(value, hint):
            _refuse_type(prefix + f.name, value, hint, f.default)
        if hint is float and isinstance(value, int):
            object.__setattr__(obj, f.name, float(value))
        check_items_bound(prefix + f.name, value)  # first: the walks below visit every entry
        check_strings(prefix + f.name, value, _secret_keys(obj, f.name))
        check_int_bounds(prefix + f.name, value)
    _paths_fit(obj)  # before any rule or check stats one
    rule = _RULES.get(type(obj).__name__)
    if rule:
        rule(obj)
    _no_leading_dash(obj)


# --------------------------------------------------------------------------------------------------
# One rule for every string of the spec (issue 14, class 2): no control characters.
#
# Every string field, every item of a list field and every key and value of a table reaches a
# script, a `#SBATCH` line, sbatch's command line or spec.toml, where a newline starts a new line
# of shell or header and a CR makes sbatch refuse the whole script ("DOS line breaks").
# The walk is driven by the dataclass fields, so a new field is covered without being listed here.
# The one exception is TEXT_VALUES: a model.overrides value is config.json content (a prompt or
# template string may well hold newlines); it reaches only spec.toml (escaped) and the model's config,
# never a script or sbatch. Its keys are still checked.
# launch.args are the user script's arguments: they reach the script's argv as a list (never a shell) and the
# batch script only in a comment, written with $'...' escapes (hpctrain.spec.launch.shell_word).
TEXT_VALUES = frozenset({"model.overrides"})
ARGV_VALUES = frozenset({"launch.args"})

def _control_char(text: str) -> str | None:
    """The first C0 control character or DEL in text, as a readable name; None when clean."""
    for ch in text:
        if ord(ch) < 32 or ord(ch) == 127:
            return {"\n": "a newline (LF)", "\r": "a carriage return (CR)", "\t": "a tab",
                    "\x00": "a NUL byte"}.get(ch, f"the control character {ch!r}")
    return None


def check_strings(key: str, value: object, secret_keys: frozenset[str] = frozenset()) -> None:
    """Refuse control characters anywhere in VALUE: strings, list items, table keys and values."""
    if isinstance(value, str):
        bad = _control_char(value)
        need(bad is None, key, shown(key, value, secret_keys), f"contains {bad}; this value reaches the batch script, "
             "an #SBATCH line or sbatch, where it would break the line",
             "remove it (a run file saved with Windows line endings is fine; a CR or LF inside a value is not)")
    elif isinstance(value, (tuple, list)):
        for item in value:
            if key in ARGV_VALUES:  # any text but NUL, which no argv can hold
                need("\x00" not in str(item), key, shown(key, item), "contains a NUL byte, which no command "
                     "argument can hold", "remove it from the script's arguments")
                continue
            check_strings(key, item, secret_keys)
    elif isinstance(value, dict):
        for k, v in value.items():
            name = f"{key}.{k}" if _control_char(str(k)) is None else f"{key}.{str(k)!r}"
            check_strings(name, str(k))
            if key not in TEXT_VALUES:
                check_strings(name, v, secret_keys)


def _secret_keys(obj: object, name: str) -> frozenset[str]:
    """Names whose values are secret, for the [env] table (secret_env may not be type-checked yet)."""
    if name != "env" or type(obj).__name__ != "Spec":
        return frozenset()
    listed = getattr(obj, "secret_env", ())
    return frozenset((*ALWAYS_SECRET, *(n for n in listed if isinstance(n, str)))) if isinstance(
        listed, tuple) else frozenset(ALWAYS_SECRET)


# Whole numbers beyond this are refused in every int field: 2**53 is exact as a float (the planner's
# arithmetic, plan.json readers) and fits SQLite's integers, and no count of a training run nears it.
INT_LIMIT = 2**53


def check_int_bounds(key: str, value: object) -> None:
    """Refuse ints so large that arithmetic on them overflows or a loop over them never ends."""
    if isinstance(value, int) and not isinstance(value, bool):
        need(abs(value) <= INT_LIMIT, key, shown(key, value), f"beyond the limit of {INT_LIMIT} for any number",
             how_to_set(key, 1) + " with a realistic value")


# Every list and table of the spec is bounded: each entry becomes a line, an argument or a mount of every
# run folder and batch script, and a request of a million entries only writes megabytes before it fails.
MAX_ITEMS = 1_000


def check_items_bound(key: str, value: object) -> None:
    """Refuse a list or table field of more than MAX_ITEMS entries (what a user can multiply stays bounded)."""
    if isinstance(value, (tuple, list, dict)):
        need(len(value) <= MAX_ITEMS, key, f"<{len(value):,} entries>", f"more than the limit of {MAX_ITEMS:,} "
             "entries", "list fewer (a file read by your script can hold the rest)")


def shown(key: str, value: object, secrets: frozenset[str] = frozenset()) -> object:
    """VALUE as an error message may show it: secrets redacted, huge values cut (never a 400-digit echo).

    KEY's last part is the variable name for [env] entries; SECRETS adds the spec's secret_env names.
    """
    name = key.rpartition(".")[2]
    secret_name = name in ALWAYS_SECRET or name in secrets or looks_secret(name, "")
    if secret_name or (isinstance(value, str) and looks_secret("", value)):
        return "<redacted>"
    text = repr(value)
    if len(text) > 80:
        return f"{text[:40]}... ({len(text)} characters)"
    return value


def _refuse_type(key: str, value: object, hint: Any, default: object) -> None:
    """The type refusal, naming the entry of a list that is wrong (`secret_env[1] = 3`), the fix in TOML."""
    if typing.get_origin(hint) is tuple:
        section, _, name = key.rpartition(".")
        where = f"[{section}] {name}" if section else name
        flag = FLAG_FOR.get(key) or f"--set {key}="
        fix = (f'set {where} = ["A", "B"] in the run file, or pass {flag}{"" if flag.endswith("=") else " "}A,B '
               "(an empty list: [])")
        if isinstance(value, tuple):
            i, item = next((i, v) for i, v in enumerate(value) if not isinstance(v, str))
            raise bad_value(f"{key}[{i}]", shown("entry", item), f"must be a string: {key} is {describe(hint)}", fix)
        raise bad_value(key, shown(key, value), f"must be {describe(hint)}", fix)
    raise bad_value(key, shown(key, value), f"must be {describe(hint)}", how_to_set(key, _example(hint, default)))


def _example(hint: Any, default: object) -> str:
    """A value to suggest, as the run file spells it (TOML: [] and true, never Python's () and True)."""
    if typing.get_origin(hint) is Literal:
        return str(typing.get_args(hint)[0])
    if default is not MISSING:
        return repr(default) if isinstance(default, str) else toml_value(default)
    return "..."


def need(ok: bool, key: str, value: object, why: str, fix: str) -> None:
    if not ok:
        raise bad_value(key, value, why, fix)


def _rules_resources(r: Resources) -> None:
    need(r.nodes >= 1, "resources.nodes", r.nodes, "a job needs at least one node", how_to_set("resources.nodes", 1))
    need(r.gpus_per_node >= 0, "resources.gpus_per_node", r.gpus_per_node, "cannot be negative",
          how_to_set("resources.gpus_per_node", 0) + " (0 = CPU ranks)")
    need(r.tasks_per_node >= 0, "resources.tasks_per_node", r.tasks_per_node, "cannot be negative",
          "set [resources] tasks_per_node = 0 (derive) or a positive count")
    need(not (r.gpus_per_node and r.tasks_per_node and r.gpus_per_node != r.tasks_per_node),
          "resources.tasks_per_node", r.tasks_per_node,
          f"one rank drives one GPU, but gpus_per_node is {r.gpus_per_node}",
          f"set [resources] tasks_per_node = {r.gpus_per_node} or 0 (derive)")
    need(r.spare_nodes >= 0, "resources.spare_nodes", r.spare_nodes, "cannot be negative",
         how_to_set("resources.spare_nodes", 1) + " (0 = no spares)")
    need(r.cpus_per_task >= 1, "resources.cpus_per_task", r.cpus_per_task, "must be at least 1",
          how_to_set("resources.cpus_per_task", 1))
    need(r.mem == "" or bool(_MEM.fullmatch(r.mem)), "resources.mem", r.mem, "not a SLURM memory size",
          how_to_set("resources.mem", "64G") + " (digits with K/M/G/T, or empty for the default)")
    _mem_bound(r.mem)
    need(bool(_TIME.fullmatch(r.time)), "resources.time", r.time, "not a SLURM time limit",
          how_to_set("resources.time", "04:00:00") + " (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(r, key)
        need(bool(_SLURM_WORD.fullmatch(value)), f"resources.{key}", value,
              "contains characters SLURM does not accept here (space, quote, $, ;, newline, ...)",
              how_to_set(f"resources.{key}", "NAME") + " with a plain name")
    for host in r.exclude:
        need(bool(_HOSTLIST.fullmatch(host)), "resources.exclude", host,
              "not a host name or hostlist", "list plain host names such as 'node3'")
    _rules_bounds(r)
    need(r.signal_seconds >= 1, "resources.signal_seconds", r.signal_seconds, "must be at least 1",
          "set [resources] signal_seconds = 90")
    _rules_time_bounds(r)
    need(r.gpu_mem_gb >= 0, "resources.gpu_mem_gb", r.gpu_mem_gb, "cannot be negative",
          "set [resources] gpu_mem_gb = 80 (or 0 to assume 80)")


# SLURM takes any of these, and a job asked for so would never start or never be warned: bounded at submit.
MAX_TIME_S = 365 * 86400  # a year: no partition allows more, and sbatch takes up to 9,999,999 days
MAX_SIGNAL_S = 6 * 3600  # the warning before the time limit: enough for the largest checkpoint


def _rules_time_bounds(r: Resources) -> None:
    """--time at most a year; signal_seconds at most MAX_SIGNAL_S and below the time limit (a warning due
    before the job starts is sent at once, and the run checkpoints and requeues in a loop)."""
    if not _TIME.fullmatch(r.time):
        return  # refused above
    limit = time_limit_s(r.time)
    need(limit <= MAX_TIME_S, "resources.time", r.time, f"{limit / 86400:,.0f} days, more than the limit of "
         f"{MAX_TIME_S // 86400} days", how_to_set("resources.time", "7-00:00:00") + " (D-HH:MM:SS)")
    need(r.signal_seconds <= MAX_SIGNAL_S, "resources.signal_seconds", r.signal_seconds,
         f"more than the limit of {MAX_SIGNAL_S:,} seconds ({MAX_SIGNAL_S // 3600} hours) before the time limit",
         "set [resources] signal_seconds = 90 (or as long as the largest checkpoint takes to write)")
    need(limit == 0 or r.signal_seconds < limit, "resources.signal_seconds", r.signal_seconds,
         f"the warning would come {r.signal_seconds} s before the end of a job that lasts {limit} s "
         f"(resources.time = {r.time!r}), that is before it starts",
         f"set [resources] signal_seconds below {limit} (e.g. {max(1, min(90, limit // 4))}), or pass a longer --time")


MEM_LIMIT_BYTES = 2**60  # 1 EiB: more than any node has; beyond it SLURM's own counters overflow
_MEM_UNIT = {"K": 2**10, "M": 2**20, "": 2**20, "G": 2**30, "T": 2**40}  # SLURM: no suffix = megabytes


def mem_bytes(mem: str) -> int | None:
    """SLURM's --mem ("64G", "512M", "4000": no suffix means megabytes) in bytes: the one reading of
    resources.mem (the planner's host capacity, the bound below). None when empty, not a size, or more than 19
    digits (beyond any node, and int() of a long string is slow)."""
    m = _MEM.fullmatch(mem)
    if m is None or len(m.group(1)) > 19:
        return None
    return int(m.group(1)) * _MEM_UNIT[m.group(2)]


def _mem_bound(mem: str) -> None:
    if _MEM.fullmatch(mem):
        size = mem_bytes(mem)
        need(size is not None and size <= MEM_LIMIT_BYTES,
             "resources.mem", shown("resources.mem", mem), "more than the limit of 1 EiB (2**60 bytes) per node",
             how_to_set("resources.mem", "64G") + " with the node's real memory")


# Counts that the planner searches over or expands (divisors of the world size and of the global
# batch, hostlists): bounded so that no request makes a search or an expansion run for minutes.
MAX_NODES = 100_000  # beyond the largest machines built; also the hostlist expansion limit
MAX_RANKS_PER_NODE = 1024
MAX_BATCH = 2**24  # sequences per global batch, micro-batch or accumulation steps


def _rules_bounds(r: Resources) -> None:
    need(r.nodes <= MAX_NODES, "resources.nodes", r.nodes, f"more than the limit of {MAX_NODES} nodes",
         how_to_set("resources.nodes", 4))
    for key in ("gpus_per_node", "tasks_per_node"):
        need(getattr(r, key) <= MAX_RANKS_PER_NODE, f"resources.{key}", getattr(r, key),
             f"more than the limit of {MAX_RANKS_PER_NODE} ranks per node", how_to_set(f"resources.{key}", 8))


def _rules_launch(x: Launch) -> None:
    need(x.retries >= 0, "launch.retries", x.retries, "cannot be negative", "set [launch] retries = 3")
    need(x.hang_timeout_s == 0 or x.hang_timeout_s >= 10, "launch.hang_timeout_s", x.hang_timeout_s,
         "must be 0 (watchdog off) or at least 10 seconds", "set [launch] hang_timeout_s = 300")
    need(x.preflight_timeout_s >= 1, "launch.preflight_timeout_s", x.preflight_timeout_s,
          "must be at least 1 second", "set [launch] preflight_timeout_s = 60")
    for m in x.modules:
        need(bool(m.strip()), "launch.modules", m, "empty module name", "remove the empty entry")
    _rules_user_script(x)


_PY_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _rules_user_script(x: Launch) -> None:
    """`submit --script/--module`: one of them; the per-node launchers and the arguments belong to them."""
    need(not (x.script and x.module), "launch.script", x.script,
         f"both launch.script and launch.module ({x.module!r}) are set; a run starts one program",
         "keep --script PATH or --module pkg.mod, not both")
    need(not x.module or bool(_PY_MODULE.fullmatch(x.module)), "launch.module", x.module,
         "not a Python module name", "pass --module with a dotted name such as mypkg.train")
    own = bool(x.script or x.module)
    need(own or x.launcher in ("srun", "deepspeed"), "launch.launcher", x.launcher,
         "starts a user script's ranks; hpctrain's trainer runs under srun or deepspeed",
         "pass --script PATH (or --module pkg.mod), or use --launcher srun")
    need(own or not x.args, "launch.args", list(x.args), "arguments for a user script, but no script is set",
         "pass --script PATH (or --module pkg.mod) before `-- ARGS`, or drop the arguments")
    need(own or not x.pass_ds_config, "launch.pass_ds_config", x.pass_ds_config,
         "hands ds_config.json to a user script, but no script is set",
         "pass --script PATH (or --module pkg.mod), or drop --pass-ds-config")


def _rules_model(m: Model) -> None:
    need(not (m.path and m.config), "model.path", m.path,
          f"both model.path and model.config ({m.config!r}) are set; a run starts from exactly one",
          "keep path (pretrained weights) or config (fresh init), not both")
    for key, value in m.overrides.items():
        check_model_key(f"model.overrides.{key}", key, value)


# config.json keys the planner and the node size the model from: positive whole numbers (at most
# 2**31 - 1, the size type torch and the HF configs assume). The relations between them (heads
# divide hidden size, ...) need the whole config and are checked by plan.planner.model_arch.
MODEL_SHAPE_KEYS = frozenset({
    "hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_hidden_layers", "n_layer",
    "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "vocab_size", "max_position_embeddings",
    "n_positions"})
MODEL_BOOL_KEYS = frozenset({"tie_word_embeddings", "attention_bias"})
MODEL_INT_MAX = 2**31 - 1
# The memory model walks every layer's tensors (as DeepSpeed cuts sub-groups): the layer count is
# bounded far above real models (Llama 3 405B has 126 layers) so that the walk stays milliseconds.
MODEL_KEY_MAX = {"num_hidden_layers": 1024, "n_layer": 1024}


def check_model_key(field: str, key: str, value: object) -> None:
    """One config.json entry (an override, or a key of the model's config.json): typed per key."""
    if key in MODEL_SHAPE_KEYS:
        top = MODEL_KEY_MAX.get(key, MODEL_INT_MAX)
        need(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= top, field,
             shown(field, value), f"a model dimension is a whole number from 1 to {top}",
             f"set [model.overrides] {key} = 64 (or remove it to keep the config's value)")
    elif key in MODEL_BOOL_KEYS:
        need(isinstance(value, bool), field, shown(field, value), "must be true or false",
             f"set [model.overrides] {key} = true")
    elif key == "model_type":
        need(isinstance(value, str) and bool(value), field, value, "must be a model type name such as 'llama'",
             "set [model.overrides] model_type = 'llama'")
    else:
        _finite_everywhere(field, value)


def _finite_everywhere(field: str, value: object) -> None:
    """Any other override is free-form TOML, but NaN and inf cannot be written to spec.toml or JSON."""
    if isinstance(value, float):
        need(math.isfinite(value), field, value, "not a finite number", "use a finite value")
    elif isinstance(value, (list, tuple)):
        for v in value:
            _finite_everywhere(field, v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _finite_everywhere(f"{field}.{k}", v)


def _rules_data(d: Data) -> None:
    need(d.seq_len >= 1, "data.seq_len", d.seq_len, "must be at least 1", "set [data] seq_len = 512")
    need(d.tokens_per_batch >= 0, "data.tokens_per_batch", d.tokens_per_batch, "cannot be negative",
          "set [data] tokens_per_batch = 0 (micro_batch * seq_len)")
    need(d.max_raw_bytes >= 0, "data.max_raw_bytes", d.max_raw_bytes, "cannot be negative",
          "set [data] max_raw_bytes = 64000000 (0 = no limit)")


def _rules_lora(lo: Lora) -> None:
    need(0 <= lo.r <= 4096, "lora.r", lo.r, "must lie in [0, 4096] (0 = off)", how_to_set("lora.r", 16))
    need(lo.alpha >= 0, "lora.alpha", lo.alpha, "cannot be negative", "set [lora] alpha = 0 (2 x r)")
    need(0 <= lo.dropout < 1, "lora.dropout", lo.dropout, "must lie in [0, 1)", "set [lora] dropout = 0.05")
    for name in lo.target_modules:
        need(bool(name) and name.replace("_", "").replace(".", "").replace("*", "").isalnum(), "lora.target_modules",
             list(lo.target_modules), f"{name!r} is not a module name",
             'set [lora] target_modules = ["q_proj", "v_proj"] (or [] for every linear layer)')
    need(lo.quantize == "none" or lo.r > 0, "lora.quantize", lo.quantize, "QLoRA needs adapters (lora.r > 0)",
         how_to_set("lora.r", 16))


def _rules_lora_with(s: Spec) -> None:
    """[lora] against the other sections: what PEFT + DeepSpeed + bitsandbytes can run (node/model/lora.py)."""
    lo, p = s.lora, s.parallel
    if not lo.r:
        return
    off = 'set [lora] r = 0 (a full fine-tune)'
    need(not (s.launch.script or s.launch.module), "lora.r", lo.r,
         "[lora] wraps hpctrain's own trainer's model; a user script builds its own",
         f"apply PEFT in your script and {off}")
    need(bool(s.model.path), "lora.r", lo.r, "LoRA adapts a pretrained model and [model] has no path",
         f"pass --model DIR (a local save_pretrained folder), or {off}")
    need(p.pp == 1, "parallel.pp", p.pp, "LoRA runs without pipeline parallelism", how_to_set("parallel.pp", 1))
    need(p.tp == 1, "parallel.tp", p.tp, "LoRA runs without tensor parallelism (the base is frozen: ZeRO shards it)",
         how_to_set("parallel.tp", 1))
    need(not s.model.freeze, "model.freeze", list(s.model.freeze), "LoRA already freezes every weight but the adapters",
         "remove [model] freeze (choose what trains with [lora] target_modules)")
    if lo.quantize != "4bit":
        return
    need(p.zero != 3, "parallel.zero", p.zero, "ZeRO-3 cannot partition QLoRA's 4-bit base weights",
         'pass --zero 2 (or auto; the base is small once quantized), or set [lora] quantize = "none"')
    need(p.offload == "none", "parallel.offload", p.offload,
         "QLoRA's 4-bit base weights cannot be offloaded (and its adapters' optimizer state is small)",
         'pass --offload none, or set [lora] quantize = "none"')


def _rules_train(t: Train) -> None:
    need(t.steps >= 1, "train.steps", t.steps, "must be at least 1", how_to_set("train.steps", 100))
    for key in ("micro_batch", "grad_accum", "global_batch"):
        need(getattr(t, key) >= 0, f"train.{key}", getattr(t, key), "cannot be negative",
              how_to_set(f"train.{key}", 1) + " (or 0 to derive it)")
        need(getattr(t, key) <= MAX_BATCH, f"train.{key}", getattr(t, key), f"more than the limit of {MAX_BATCH}",
             how_to_set(f"train.{key}", 64) + " (or 0 to derive it)")
    need(t.lr > 0, "train.lr", t.lr, "must be positive", "set [train] lr = 3e-4")
    need(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must lie in [0, lr={t.lr}]",
          f"set [train] min_lr = {t.lr / 10:g}")
    need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "cannot be negative", "set it to 0")
    need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "cannot be negative", "set it to 0.0")
    need(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "cannot be negative", "set it to 1.0 (0 = off)")
    need(t.peak_tflops >= 0, "train.peak_tflops", t.peak_tflops, "cannot be negative", "set it to 0 (unknown)")
    need(t.eval_every >= 0, "train.eval_every", t.eval_every, "cannot be negative", how_to_set("train.eval_every", 0)
         + " (0 = off)")
    need(t.eval_tokens >= 0, "train.eval_tokens", t.eval_tokens, "cannot be negative",
          "set [train] eval_tokens = 262144 (0 = the whole validation split)")


# --------------------------------------------------------------------------------------------------
# ZeRO and offload: what DeepSpeed implements. The spec checks, the planner's choices (zero auto) and the
# DeepSpeed config all use these, so a rule is changed here or nowhere.

ZERO_STAGES = (0, 1, 2, 3)
PIPELINE_ZERO = (0, 1)  # DeepSpeed's pipeline engine (pp > 1) supports ZeRO 0 and 1 only
# A ratio < 1 splits the optimizer state between GPU and CPU: DeepSpeed implements it only at ZeRO-3, for
# optimizer offload to the CPU (stages 1-2 ignore the ratio; NVMe offload does not split).
PARTIAL_OFFLOAD_ZERO, PARTIAL_OFFLOAD_DEVICE = 3, "cpu"

Kind = tuple[int, str, "float | str"]  # (zero stage, offload, offload ratio or "auto")


def offload_stages(offload: str) -> tuple[int, ...]:
    """The ZeRO stages at which DeepSpeed can offload `offload` (parameters only at stage 3)."""
    return {"none": ZERO_STAGES, "optimizer": (1, 2, 3)}.get(offload, (3,))


def zero_fits_pipeline(zero: int, pp: int) -> bool:
    return pp == 1 or zero in PIPELINE_ZERO


def partial_offload_ok(zero: int, offload: str, device: str) -> bool:
    return zero == PARTIAL_OFFLOAD_ZERO and offload == "optimizer" and device == PARTIAL_OFFLOAD_DEVICE


def kind_allowed(kind: Kind, pp: int, device: str) -> bool:
    """Whether DeepSpeed can run this (zero, offload, ratio) choice with pipeline degree `pp`."""
    zero, offload, ratio = kind
    return (zero in offload_stages(offload) and zero_fits_pipeline(zero, pp)
            and (ratio == 1.0 or partial_offload_ok(zero, offload, device)))


def zero_choices(p: Parallel, gpu: bool) -> list[Kind]:
    """What `zero` may resolve to, in order of speed: no offload by rising stage, then ZeRO-3 with part of
    the optimizer on the CPU (the GPU's Adam is far faster than CPU Adam), then full optimizer offload,
    then all. An explicit offload restricts the list to it; an explicit zero puts the asked choice first
    (the planner keeps it and shows the others for comparison). On CPU ranks offload moves nothing, so
    zero auto never chooses it. Only choices DeepSpeed allows (kind_allowed) are added.
    """
    partial: float | str = p.offload_ratio if p.offload_ratio == "auto" or p.offload_ratio < 1 else "auto"
    order: list[Kind] = [(z, "none", 1.0) for z in ZERO_STAGES]
    if gpu:
        order += [(1, "optimizer", 1.0), (2, "optimizer", 1.0), (3, "optimizer", 1.0), (3, "all", 1.0)] \
            if p.pp > 1 else [(3, "optimizer", partial), (2, "optimizer", 1.0), (3, "optimizer", 1.0), (3, "all", 1.0)]
    if p.offload == "optimizer" and p.offload_ratio != 1.0:  # partial first: it beats any full offload
        order = [(3, "optimizer", p.offload_ratio), (1, "optimizer", 1.0), (2, "optimizer", 1.0), (3, "optimizer", 1.0)]
    elif p.offload != "none":
        order = [(z, p.offload, 1.0) for z in offload_stages(p.offload)]
    order = [k for k in order if kind_allowed(k, p.pp, p.offload_device)]
    if p.zero != "auto":  # validated above (_rules_parallel): DeepSpeed allows it
        asked: Kind = (int(p.zero), p.offload, p.offload_ratio)
        order = [asked, *(k for k in order if k != asked)]
    return order


def _rules_offload_ratio(p: Parallel) -> None:
    """Partial optimizer offload: a fraction in (0, 1], or auto; only where DeepSpeed implements it."""
    r = p.offload_ratio
    if not isinstance(r, str) and r == 0:
        object.__setattr__(p, "offload_ratio", "auto")  # 0 = "planner picks", stored one way
        r = "auto"
    if isinstance(r, (int, float)) and not isinstance(r, bool):
        object.__setattr__(p, "offload_ratio", float(r))
        need(0 < r <= 1, "parallel.offload_ratio", r, "the fraction of optimizer state on the CPU lies in (0, 1]",
             how_to_set("parallel.offload_ratio", 0.5) + " (1 = all of it, auto = the planner picks)")
        if r == 1:
            return
    what = r
    need(p.zero in (PARTIAL_OFFLOAD_ZERO, "auto"), "parallel.offload_ratio", what,
         f"partial optimizer offload exists only at ZeRO stage 3 (zero is {p.zero}); DeepSpeed ignores the ratio "
         "at stages 1 and 2", "pass --zero 3, or --offload-ratio 1")
    need(p.offload in ("optimizer", "none") and (p.offload == "optimizer" or p.zero == "auto"),
         "parallel.offload_ratio", what,
         "a ratio splits the optimizer state between GPU and CPU, so it needs --offload optimizer "
         f"(offload is {p.offload!r})", "pass --offload optimizer (or --zero auto), or --offload-ratio 1")
    need(zero_fits_pipeline(PARTIAL_OFFLOAD_ZERO, p.pp), "parallel.offload_ratio", what,
         f"partial optimizer offload needs ZeRO stage 3, which DeepSpeed's pipeline engine (pp={p.pp}) does not "
         "support", "pass --offload-ratio 1, or --pp 1")
    need(p.offload_device == PARTIAL_OFFLOAD_DEVICE, "parallel.offload_ratio", what,
         "partial offload keeps part of the state in CPU RAM; DeepSpeed does not split it with NVMe",
         "pass --offload-device cpu, or --offload-ratio 1")


def _rules_parallel(p: Parallel) -> None:
    _rules_offload_ratio(p)
    need(p.zero == "auto" or p.zero in ZERO_STAGES, "parallel.zero", p.zero,
          "DeepSpeed ZeRO stages are 0, 1, 2 and 3", how_to_set("parallel.zero", 3) + " (or auto)")
    need(p.pp >= 1, "parallel.pp", p.pp, "pipeline degree must be at least 1", how_to_set("parallel.pp", 1))
    need(p.tp >= 1, "parallel.tp", p.tp, "tensor degree must be at least 1", how_to_set("parallel.tp", 1))
    if p.offload in ("param", "all"):
        need(p.zero == "auto" or p.zero in offload_stages(p.offload), "parallel.offload", p.offload,
              f"parameter offload needs ZeRO stage 3 (zero is {p.zero})",
              "pass --zero 3, or --offload optimizer")
        need(any(zero_fits_pipeline(z, p.pp) for z in offload_stages(p.offload)), "parallel.offload", p.offload,
             f"parameter offload needs ZeRO stage 3, which DeepSpeed's pipeline engine (pp={p.pp}) does not support",
             "pass --offload optimizer, or --pp 1")
    if p.offload == "optimizer":
        need(p.zero == "auto" or p.zero in offload_stages(p.offload), "parallel.offload", p.offload,
              "optimizer offload needs ZeRO stage 1, 2 or 3", "pass --zero 1 (or higher), or --offload none")
    if p.offload != "none" and p.offload_device == "nvme":
        need(bool(p.nvme_path), "parallel.nvme_path", p.nvme_path, "NVMe offload needs a local NVMe folder",
              how_to_set("parallel.nvme_path", "/local/nvme"))
    need(p.zero == "auto" or zero_fits_pipeline(p.zero, p.pp), "parallel.zero", p.zero,
          f"DeepSpeed's pipeline engine (pp={p.pp}) supports ZeRO 0 and 1 only",
          "pass --zero 1, or --pp 1")


def _rules_checkpoint(c: Checkpoint) -> None:
    need(c.every_steps >= 0, "checkpoint.every_steps", c.every_steps, "cannot be negative", "set it to 0 (off)")
    need(c.every_minutes >= 0, "checkpoint.every_minutes", c.every_minutes, "cannot be negative",
          "set it to 0 (off)")
    need(c.keep >= 1, "checkpoint.keep", c.keep, "at least one checkpoint must be kept to resume",
          "set [checkpoint] keep = 2")


def _rules_container(c: Container) -> None:
    need(c.runtime == "none" or bool(c.image), "container.image", c.image,
          f"runtime {c.runtime!r} needs an image", f"pass --container {c.runtime}:IMAGE")
    need(c.runtime != "none" or not c.image, "container.runtime", c.runtime,
          f"an image ({c.image!r}) is set but no runtime", "pass --container RUNTIME:IMAGE "
          "(apptainer, pyxis, podman or charliecloud)")
    for m in c.mounts:
        need(bool(m) and "," not in m and m.count(":") <= 2, "container.mounts", m,
              "a mount is SRC[:DST[:OPTS]] without commas", "write one mount per list entry")


_TRACK_FIX = ('pass --track tensorboard,wandb or set [tracking] backends = ["tensorboard", "wandb"] in the run file '
              "(--track none, or backends = []: no tracker)")


def _rules_tracking(t: Tracking) -> None:
    if t.backends == ("none",):  # --track none: no tracker at all
        object.__setattr__(t, "backends", ())
    seen: set[str] = set()
    for name in t.backends:
        need(name in TRACKERS, "tracking.backends", name,
             f"not a tracker hpctrain knows{did_you_mean(name, TRACKERS)}; it knows {', '.join(TRACKERS)}",
             _TRACK_FIX)
        need(name not in seen, "tracking.backends", name, "listed twice", "list each tracker once: " + _TRACK_FIX)
        seen.add(name)
    if {"wandb", "mlflow"} & seen:
        need(bool(t.project.strip()), "tracking.project", t.project, "W&B and MLflow need a project name",
             how_to_set("tracking.project", "'my-project'"))


def check_site_name(name: str) -> None:
    """A site profile name is a file name in $HPCTRAIN_CONFIG_DIR/sites: no '/', no control characters."""
    check_path("site", name + ".toml", "give the name of a site profile, or the path of a site file")
    need(bool(_SITE_NAME.fullmatch(name)), "site", shown("site", name),
         "site profile names are letters, digits, '_', '.', '-'", "rename the profile")


def _rules_spec(s: Spec) -> None:
    need(bool(s.name.strip()), "name", s.name, "a run needs a name", how_to_set("name", "'my-run'"))
    _rules_eval(s)
    _rules_lora_with(s)
    need(len(s.name) <= 200, "name", s.name[:40] + "...", "longer than 200 characters", "shorten it")
    if s.site:
        check_site_name(s.site)
    from hpctrain.spec.sbatch_args import check_gres

    check_gres(s.slurm.extra, s.resources.gpus_per_node)
    secrets = secret_names(s)
    for i, name in enumerate(s.secret_env):
        # Shown unless it looks like a credential pasted in place of a name ("secret" in the key is no reason).
        need(bool(_ENV_NAME.fullmatch(name)), f"secret_env[{i}]", shown("entry", name),
             "secret_env lists the NAMES of variables exported in the submitting shell, and this is not a variable "
             "name", "use letters, digits and '_' (not starting with a digit), e.g. secret_env = [\"MY_TOKEN\"]")
    hidden = frozenset(secrets)
    for key, value in s.env.items():
        need(bool(_ENV_NAME.fullmatch(key)), f"env.{key}", shown(f"env.{key}", value, hidden),
             "not an environment variable name", "use letters, digits and '_' (not starting with a digit)")
        need(isinstance(value, str), f"env.{key}", shown(f"env.{key}", value, hidden), "env values are strings",
             f'write {key} = "..." in [env] (or, for a secret, export it and list it in secret_env)')
        need(key not in secrets and not looks_secret(key, value), f"env.{key}", "<redacted>",
              "looks like a secret, and [env] is written into spec.toml and sbatch.sh",
              f"remove it from [env], export {key} in the submitting shell, and list it in secret_env "
              f"(HF_TOKEN and WANDB_API_KEY always pass this way)")


def _rules_slurm(x: Slurm) -> None:
    from hpctrain.spec import sbatch_args

    sbatch_args.check_extra(x.extra)
    sbatch_args.check_mail(x.mail_type, x.mail_user)
    object.__setattr__(x, "mail_type", sbatch_args.normal_mail_type(x.mail_type))


def _rules_code(c: Code) -> None:
    need(c.dir == "" or c.dir.startswith("/"), "code.dir", c.dir, "must be the absolute path of the snapshot",
         "leave it to `hpctrain submit --snapshot`, which sets it")


def _rules_fault(x: Fault) -> None:
    need(x.in_job_restarts >= 0, "fault.in_job_restarts", x.in_job_restarts, "cannot be negative",
         "set [fault] in_job_restarts = 3 (0 = one per spare node)")
    need(x.straggler_patience_s >= 0, "fault.straggler_patience_s", x.straggler_patience_s, "cannot be negative",
         "set [fault] straggler_patience_s = 120 (0 = off)")
    need(x.straggler_ratio > 1.0, "fault.straggler_ratio", x.straggler_ratio,
         "must be above 1 (slower than the others)", "set [fault] straggler_ratio = 1.2")
    for key, v in (("health_matmul_ratio", x.health_matmul_ratio), ("health_net_ratio", x.health_net_ratio)):
        need(0.0 < v <= 1.0, f"fault.{key}", v, "must be a fraction, 0 < r <= 1 (of the expected or median rate)",
             f"set [fault] {key} = {0.8 if 'matmul' in key else 0.5}")
    need(x.health_min_busbw_gbps >= 0, "fault.health_min_busbw_gbps", x.health_min_busbw_gbps, "cannot be negative",
         "set [fault] health_min_busbw_gbps = 0 (no floor)")
    need(x.health_timeout_s > 0, "fault.health_timeout_s", x.health_timeout_s, "must be positive",
         "set [fault] health_timeout_s = 300")


def _rules_eval(s: Spec) -> None:
    """Evaluation reads a prepared folder's validation split through the plain DeepSpeed engine."""
    if s.train.eval_every <= 0:
        return
    need(s.parallel.pp == 1, "train.eval_every", s.train.eval_every,
         f"evaluation is not built for pipeline-parallel runs (parallel.pp = {s.parallel.pp}): the pipeline "
         "engine's eval_batch is not wired into the node trainer", "set [train] eval_every = 0, or parallel.pp = 1")
    need(s.data.source != "synthetic" and s.data.format != "synthetic", "train.eval_every", s.train.eval_every,
         "synthetic data has no validation split", "point [data] source at a folder made by `hpctrain data "
         "prepare INPUT --tokenizer DIR --out DIR --val-fraction 0.01`, or set [train] eval_every = 0")


_RULES: dict[str, Any] = {
    "Resources": _rules_resources, "Launch": _rules_launch, "Fault": _rules_fault, "Model": _rules_model,
    "Lora": _rules_lora, "Data": _rules_data, "Train": _rules_train, "Parallel": _rules_parallel,
    "Checkpoint": _rules_checkpoint, "Container": _rules_container, "Slurm": _rules_slurm, "Code": _rules_code,
    "Tracking": _rules_tracking,
    "Spec": _rules_spec,
}


# --------------------------------------------------------------------------------------------------
# Option injection: values that become command arguments.

# Every field whose value reaches a command line as an argument of its own: `module load NAME`, the image and
# the binds of podman/apptainer/ch-run/enroot, the paths bound into the container (model, data, tokenizer, NVMe
# folder, template folder), the image's python. A leading '-' there is read as an option
# (`--container podman:--privileged` would run a privileged container). Flags hpctrain writes as `--flag=VALUE`
# (partition, account, pyxis' --container-*) cannot be misread and are checked by their own rules.
COMMAND_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "Launch": ("modules", "template_dir", "script"), "Model": ("path", "config"), "Data": ("source", "tokenizer"),
    "Parallel": ("nvme_path",), "Container": ("image", "mounts", "python"),
}
_DASH_FIX = {
    "launch.modules": "module names do not start with '-'; pass module options in the site's module setup",
    "container.image": "give the image's path or name (e.g. localhost/hpctrain:cpu, /images/train.sif)",
    "container.mounts": "write SRC[:DST] with absolute paths (e.g. /scratch:/scratch)",
    "container.python": "give the python's path or name inside the image (e.g. python3)",
}


# Every field that names a file or folder: each must be a path Linux can hold (errors.path_problem), or the
# first stat of it raised ENAMETOOLONG as a traceback (issue 27, item 6). The run folder's files go below it.
PATH_FIELDS: dict[str, tuple[str, ...]] = {
    "Launch": ("template_dir", "script"), "Model": ("path", "config"), "Data": ("source", "tokenizer"),
    "Parallel": ("nvme_path",), "Container": ("image", "mounts"), "Code": ("dir",),
}


def _paths_fit(obj: Any) -> None:
    cls = type(obj).__name__
    for name in PATH_FIELDS.get(cls, ()):
        key = f"{cls.lower()}.{name}"
        value = getattr(obj, name, "")
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, str):
                check_path(key, item, how_to_set(key, "PATH") + " with a shorter path")


def _no_leading_dash(obj: Any) -> None:
    """Refuse a leading '-' in every value listed in COMMAND_ARGUMENTS (each side of a mount's ':' too)."""
    cls = type(obj).__name__
    for name in COMMAND_ARGUMENTS.get(cls, ()):
        key = f"{cls.lower()}.{name}"
        value = getattr(obj, name, "")
        for item in value if isinstance(value, tuple) else (value,):
            parts = str(item).split(":") if key == "container.mounts" else [str(item)]
            need(not any(p.startswith("-") for p in parts), key, item,
                 "starts with '-', so the command it is passed to would read it as an option",
                 _DASH_FIX.get(key, "give an absolute path, or write ./NAME for a relative one"))
