"""From what a Python caller passes (a run file, a Spec or a mapping, plus keywords) to what the CLI's flags
become: a run file's path, dotted spec keys and a site, for the same layers and checks as `hpctrain plan`/`submit`
(defaults < site < run file < flags)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.plan.model import Plan
    from hpctrain.spec.model import Spec

# A run file's path, a resolved Spec (e.g. read from a run folder), a mapping shaped like a run file
# ({"name": ..., "resources": {...}}), or None: defaults, site and keywords alone.
RunSource = str | os.PathLike[str] | Mapping[str, Any] | None


def request(source: RunSource | Spec, overrides: Mapping[str, Any], *,
            where: str) -> tuple[str | None, dict[str, Any], str | None]:
    """(run file, dotted keys, site) for `source` and the keywords. A mapping or a Spec is read as a run file's
    content whose keys the keywords override (its keys are checked as a run file's: an unknown one is refused)."""
    import tomllib

    from hpctrain.spec.flags import keys_from_keywords
    from hpctrain.spec.model import Spec, run_keys, to_toml

    keys = keys_from_keywords(where, overrides)
    site = overrides.get("site")
    if isinstance(source, Spec):
        source = tomllib.loads(to_toml(source))
    if isinstance(source, Mapping):
        return None, {**run_keys(source, f"{where}'s run mapping"), **keys}, site
    return (os.fspath(source) if source is not None else None), keys, site


def plan(source: RunSource | Spec = None, /, **overrides: Any) -> Plan:
    """The plan `hpctrain plan SOURCE --flags` prints: world size, parallel degrees, batch arithmetic, the memory
    estimate of every ZeRO/offload choice and the chosen one, with reasons. Data and tokenizer paths are not
    checked (they may live only on the cluster); `submit` checks them.

    >>> hpctrain.plan("examples/tiny.toml", nodes=2).world_size
    4
    """
    from hpctrain.slurm.submission import Submission

    runfile, keys, site = request(source, overrides, where="hpctrain.plan")
    return Submission.prepare(runfile, keys, site=site, check=False).plan  # as `hpctrain plan` does
