"""The plan's data class: what `hpctrain.plan.planner.make_plan` decides, as `plan.json` holds it.

Apart from the planner so that the rank side reads the plan (`Plan.from_json`) without importing the planner:
contract rank-side in pyproject.toml forbids `hpctrain.plan.planner` there (the node never plans again).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Plan:
    """Everything derived from a spec; rendered into plan.json and used by render and dispatch."""

    world_size: int
    nodes: int
    ranks_per_node: int
    dp: int
    pp: int
    tp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    zero_stage: int
    offload: str
    param_count: int
    memory: dict[str, Any]
    reasons: list[str]
    device: str = "gpu"  # "gpu" or "cpu" (DS_ACCELERATOR=cpu, gloo)
    precision: str = "bf16"
    model: dict[str, Any] = field(default_factory=dict)
    options: list[dict[str, Any]] = field(default_factory=list)  # the best estimate of every choice
    offload_ratio: float = 1.0  # zero_optimization.offload_optimizer.ratio (ZeRO-3 optimizer offload)
    activation_checkpointing: bool = False  # what the node does (spec true/false, or the planner's auto pick)
    spare_nodes: int = 0  # allocated beside `nodes`, idle until one replaces a failing node (fault.injob)
    in_job_restarts: int = 0  # srun steps after the first within one job (spec fault.in_job_restarts, or spares)
    predicted_step_s: float = 0.0  # hpctrain.plan.timemodel's step of the chosen option (0: no time model)
    # The fine-tuning defaults resolution applied ({key, value, reason}; hpctrain.spec.finetune), also in reasons
    defaults: list[dict[str, Any]] = field(default_factory=list)
    kernels: str = "none"  # fused kernels the ranks apply: "liger" ([model] kernels on GPU ranks) or "none"

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys) for plan.json and `hpctrain plan --json`."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The Plan that `to_json` wrote. Raises ValueError naming what is wrong (not JSON, unknown or
        missing keys, wrong types), so a reader can say which file to re-create."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")  # noqa: TRY004 - one error type
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; valid keys: {', '.join(sorted(known))}")
        try:
            plan = cls(**data)
        except TypeError as exc:  # a required key missing
            raise ValueError(str(exc)) from None
        for name, f in known.items():
            value = getattr(plan, name)
            want = _JSON_TYPES[str(f.type)]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{name} = {value!r}: expected {f.type!s}")
        return plan


# Plan's field annotations (strings under `from __future__ import annotations`) -> JSON value types.
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "str": str, "bool": bool, "float": (int, float),
    "dict[str, Any]": dict, "list[str]": list, "list[dict[str, Any]]": list,
}
