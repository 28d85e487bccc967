"""What the node reads from the run folder (the resolved spec, the plan, the DeepSpeed config) and the
one place where the allocation adjusts that config.

The node only reads what `hpctrain submit` wrote (hpctrain.render.runfolder): it never plans and never
builds a DeepSpeed config. Torch-free on purpose: the input checks in `main.py` run before any heavy
import, so a bad file fails in a second on every rank instead of after a minute of imports and a hung
collective.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpctrain.errors import HpcUsageError
from hpctrain.plan.model import Plan
from hpctrain.runs.folder import RunFolder, json_text, write_private
from hpctrain.spec.model import Spec, read_resolved

_RECREATE = "create the run with `hpctrain submit` (or `hpctrain submit --dry-run --out DIR`)"


class NodeInputError(Exception):
    """Bad user input found on the node. The message names the file and says how to fix it."""


def _require(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NodeInputError(f"{path}: no {path.name} in the run folder. Fix: {_RECREATE}.") from None


def read_spec(folder: RunFolder) -> Spec:
    """The resolved spec (spec.toml), validated as on the login side."""
    _require(folder.spec_toml)
    try:
        return read_resolved(folder.path)
    except HpcUsageError as exc:  # names the field and the fix
        raise NodeInputError(f"{folder.spec_toml}: {exc.format_message()}") from exc


def read_plan(folder: RunFolder) -> Plan:
    """The plan written at submit (plan.json), typed."""
    try:
        return Plan.from_json(_require(folder.plan_json))
    except ValueError as exc:  # json.JSONDecodeError included
        raise NodeInputError(f"{folder.plan_json}: not a plan ({exc}). Fix: {_RECREATE}.") from exc


def read_ds_config(folder: RunFolder) -> dict[str, Any]:
    """The DeepSpeed config written at submit (ds_config.json)."""
    try:
        cfg = json.loads(_require(folder.ds_config_json))
    except json.JSONDecodeError as exc:
        raise NodeInputError(f"{folder.ds_config_json}: not valid JSON ({exc}). Fix: {_RECREATE}.") from exc
    if not isinstance(cfg, dict) or not isinstance(cfg.get("zero_optimization"), dict):
        raise NodeInputError(f"{folder.ds_config_json}: not a DeepSpeed config (no zero_optimization block). "
                             f"Fix: {_RECREATE}.")
    for key in _NEEDED_INTS:  # the node sizes its data reader and the batch product from them
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] < 1:
            raise NodeInputError(f"{folder.ds_config_json}: {key} = {cfg.get(key)!r}: must be a positive integer. "
                                 f"Fix: set it, or {_RECREATE}.")
    return cfg


_NEEDED_INTS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def effective_ds_config(rendered: dict[str, Any], *, dp: int, universal: bool, use_gpu: bool,
                        env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The config `deepspeed.initialize` gets on this allocation, and one line per edit of `rendered`.

    Only what submit could not know is edited: the batch product when the data-parallel size differs
    from the plan's (a resume on another number of ranks), `checkpoint.load_universal` when the resume
    point was written at another size, and the AdamW implementation where the ranks run on other devices
    than planned or an env-var knob asks for DeepSpeed's own (HPCTRAIN_CPU_ADAM on CPU ranks,
    HPCTRAIN_DS_ADAM on GPU ranks). No edits: the config is `rendered`, unchanged.
    """
    env = os.environ if env is None else env
    cfg = copy.deepcopy(rendered)
    edits: list[str] = []
    micro, gas = int(cfg["train_micro_batch_size_per_gpu"]), int(cfg["gradient_accumulation_steps"])
    if "train_batch_size" in cfg and int(cfg["train_batch_size"]) != micro * gas * dp:
        edits.append(f"train_batch_size {cfg['train_batch_size']} -> {micro * gas * dp}: this allocation has "
                     f"dp {dp} (micro {micro} x accum {gas} x dp {dp})")
        cfg["train_batch_size"] = micro * gas * dp
    if universal:
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": True}
        edits.append("checkpoint.load_universal = true: the resume checkpoint was written at another "
                     "data-parallel size")
    edits += _adam_edits(cfg, use_gpu, env)
    return cfg, edits


def _adam_edits(cfg: dict[str, Any], use_gpu: bool, env: Mapping[str, str]) -> list[str]:
    params = cfg.get("optimizer", {}).get("params")
    if not isinstance(params, dict):
        return []
    drop: list[str] = []
    why = ""
    if not use_gpu and env.get("HPCTRAIN_CPU_ADAM"):
        drop, why = ["torch_adam", "fused"], "HPCTRAIN_CPU_ADAM is set: DeepSpeed's own CPU Adam"
    elif use_gpu and env.get("HPCTRAIN_DS_ADAM"):
        drop, why = ["torch_adam", "fused"], "HPCTRAIN_DS_ADAM is set: DeepSpeed's own Adam"
    elif not use_gpu and params.get("fused"):
        drop, why = ["fused"], "planned for GPUs, running on CPU ranks (DS_ACCELERATOR=cpu): torch's foreach AdamW"
    gone = [k for k in drop if k in params]
    for k in gone:
        del params[k]
    return [f"optimizer.params.{k} removed: {why}" for k in gone]


def record_effective(folder: RunFolder, cfg: dict[str, Any], edits: list[str]) -> None:
    """ds_config.effective.json next to ds_config.json when the allocation edited the config; a stale one
    from an earlier attempt is removed, so the file is there exactly when the two differ."""
    if edits:
        write_private(folder.ds_config_effective_json, json_text(cfg))
    else:
        folder.ds_config_effective_json.unlink(missing_ok=True)
