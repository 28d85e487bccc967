"""What the node reads from the run folder: the resolved spec, the DeepSpeed config, the paths.

Torch-free on purpose: the input checks in `main.py` run before any heavy import, so a bad path fails
in a second on every rank instead of after a minute of imports and a hung collective.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import tomllib

from hpctrain.spec import model as specmod
from hpctrain.spec.model import Spec


class NodeInputError(Exception):
    """Bad user input found on the node. The message names the file and says how to fix it."""


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """The run folder layout (DESIGN.md). Kept local so the node does not depend on runs.py internals."""

    root: Path

    @property
    def spec(self) -> Path:
        return self.root / "spec.toml"

    @property
    def ds_config(self) -> Path:
        return self.root / "ds_config.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "hf"

    @property
    def hostfile(self) -> Path:
        return self.root / "hostfile"


def read_spec(run_dir: Path) -> Spec:
    """The resolved spec of a run: CONTROL's `read_resolved` when present, else a local TOML reader."""
    path = Path(run_dir) / "spec.toml"
    if not path.is_file():
        raise NodeInputError(f"{path}: no spec.toml in the run folder; create the run with `hpctrain submit`.")
    reader = getattr(specmod, "read_resolved", None)
    if reader is not None:
        try:
            return typing.cast(Spec, reader(Path(run_dir)))
        except Exception as exc:
            # CONTROL's validation errors (HpcUsageError, a click.UsageError) name the field and the fix.
            if hasattr(exc, "format_message"):
                raise NodeInputError(f"{path}: {exc.format_message()}") from exc
            raise
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise NodeInputError(f"{path}: not valid TOML ({exc}); re-create the run with `hpctrain submit`.") from exc
    return typing.cast(Spec, _build(Spec, data, str(path)))


def _build(cls: Any, data: dict[str, Any], where: str) -> Any:
    """Dataclass from a TOML table (lists -> tuples, nested tables -> nested dataclasses)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            if key == "sites":  # inline site profiles are resolved on the login node already
                continue
            raise NodeInputError(f"{where}: unknown key {key!r}; valid keys: {', '.join(sorted(names))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            kwargs[key] = _build(hint, value, f"{where} [{key}]")
        elif isinstance(value, list):
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def read_ds_config(paths: RunPaths) -> dict[str, Any] | None:
    """The rendered ds_config.json, or None when the run folder has none (tests build one from the spec)."""
    if not paths.ds_config.is_file():
        return None
    try:
        return typing.cast(dict[str, Any], json.loads(paths.ds_config.read_text()))
    except json.JSONDecodeError as exc:
        raise NodeInputError(f"{paths.ds_config}: not valid JSON ({exc}); re-render it with `hpctrain submit`.") from exc


def read_planned(run_dir: Path, spec: Spec) -> dict[str, Any]:
    """The plan's choices: RUN_DIR/plan.json, or, when the folder has none (tests), the plan derived again
    from the spec (the planner is pure arithmetic, so it gives the answer `hpctrain submit` would have)."""
    path = Path(run_dir) / "plan.json"
    if path.is_file():
        try:
            return typing.cast(dict[str, Any], json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise NodeInputError(f"{path}: not valid JSON ({exc}); re-create the run with `hpctrain submit`.") from exc
    from hpctrain.plan.planner import make_plan

    return typing.cast(dict[str, Any], json.loads(make_plan(spec).to_json()))


def activation_checkpointing(spec: Spec, plan: dict[str, Any] | None) -> bool:
    """Recompute activations? The spec's true/false, or for "auto" the plan's choice."""
    ac = spec.train.activation_checkpointing
    if ac == "auto":
        return bool((plan or {}).get("activation_checkpointing", False))
    return bool(ac)


def zero_stage(spec: Spec) -> int:
    """The ZeRO stage to run: an explicit spec value, or for "auto" the plan's choice (3 if unknown)."""
    if spec.parallel.zero != "auto":
        return int(spec.parallel.zero)
    return 3


def build_ds_config(spec: Spec, dp: int, stage: int | None = None,
                    plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """A DeepSpeed config from the spec (and the plan's automatic choices, when given), used when the run
    folder has no rendered ds_config.json."""
    t, p = spec.train, spec.parallel
    if stage is None:
        stage = int(plan["zero_stage"]) if plan and spec.parallel.zero == "auto" else zero_stage(spec)
    if p.pp > 1:
        stage = min(stage, 1)  # DeepSpeed's pipeline engine supports ZeRO 0 and 1 only
    micro = int(plan["micro_batch"]) if plan else t.micro_batch or 1
    gas = int(plan["grad_accum"]) if plan else t.grad_accum or 1
    # The plan's offload and ratio where it chose them (zero/ratio auto), else the spec's.
    offload = str(plan.get("offload", p.offload)) if plan else p.offload
    ratio = plan.get("offload_ratio", 1.0) if plan else p.offload_ratio
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if offload in ("optimizer", "all"):
        zero["offload_optimizer"] = _offload(spec)
        if stage == 3 and isinstance(ratio, float) and ratio < 1:
            from hpctrain.plan.memory import SUB_GROUP_SIZE  # the split the plan's estimate assumed

            zero["offload_optimizer"]["ratio"] = ratio
            zero["sub_group_size"] = SUB_GROUP_SIZE
    if offload in ("param", "all") and stage == 3:
        zero["offload_param"] = _offload(spec)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp,
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": t.weight_decay}},
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 100, "hysteresis": 2, "min_loss_scale": 1},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return cfg


def _offload(spec: Spec) -> dict[str, Any]:
    if spec.parallel.offload_device == "nvme":
        return {"device": "nvme", "nvme_path": spec.parallel.nvme_path, "pin_memory": True}
    return {"device": "cpu", "pin_memory": True}
