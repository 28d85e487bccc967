"""From what a Python caller passes (a run file, a Spec or a mapping, plus keywords) to a resolved Spec and Plan:
the same layers and checks as `hpctrain plan`/`submit` (defaults < site < run file < flags)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import tomllib

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.plan.planner import Plan
    from hpctrain.spec.finetune import Default
    from hpctrain.spec.model import Spec

# A run file's path, a resolved Spec (e.g. read from a run folder), a mapping shaped like a run file
# ({"name": ..., "resources": {...}}), or None: defaults, site and keywords alone.
RunSource = str | os.PathLike[str] | Mapping[str, Any] | None


def resolve(source: RunSource | Spec, overrides: Mapping[str, Any], *, where: str,
            check: bool) -> tuple[Spec, list[Default]]:
    """The spec `source` and the keywords ask for, and the fine-tuning defaults applied (with their reasons).
    `check=False` skips the filesystem checks, as `hpctrain plan` does."""
    from hpctrain.spec.flags import keys_from_keywords
    from hpctrain.spec.model import Spec, resolve_with_defaults, to_toml

    keys = keys_from_keywords(where, overrides)
    site = overrides.get("site")
    if isinstance(source, Spec):
        source = tomllib.loads(to_toml(source))
    if source is None or isinstance(source, Mapping):
        return resolve_with_defaults(None, keys, site, check=check, run_data=dict(source or {}))
    return resolve_with_defaults(os.fspath(source), keys, site, check=check)


def plan(source: RunSource | Spec = None, /, **overrides: Any) -> Plan:
    """The plan `hpctrain plan SOURCE --flags` prints: world size, parallel degrees, batch arithmetic, the memory
    estimate of every ZeRO/offload choice and the chosen one, with reasons. Data and tokenizer paths are not
    checked (they may live only on the cluster); `submit` checks them.

    >>> hpctrain.plan("examples/tiny.toml", nodes=2).world_size
    4
    """
    from hpctrain.plan.planner import make_plan

    spec, applied = resolve(source, overrides, where="hpctrain.plan", check=False)
    return make_plan(spec, applied)
