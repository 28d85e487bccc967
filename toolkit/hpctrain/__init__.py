"""hpctrain: launch DeepSpeed training of large language models on SLURM clusters.

From Python (docs/api.md; the functions live in hpctrain.api and load on first use, so `import hpctrain` and
`hpctrain --help` stay light):

    import hpctrain
    run = hpctrain.submit("run.toml", nodes=2)    # -> hpctrain.Run
    hpctrain.plan("run.toml", zero=3)             # -> hpctrain.Plan
    hpctrain.Run("last").wait(timeout=600)        # status(), wait(), summary(), logs(), cancel(), resubmit()
    hpctrain.runs()                               # the newest runs, as Run handles
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what mypy and editors see; at run time __getattr__ below loads them on first use
    from hpctrain.api import Run as Run
    from hpctrain.api import Status as Status
    from hpctrain.api import plan as plan  # at run time the callable subpackage (_StageAndFunction)
    from hpctrain.api import runs as runs  # type: ignore[no-redef]
    from hpctrain.api import submit as submit
    from hpctrain.plan.model import Plan as Plan

__all__ = ["Plan", "Run", "Status", "__version__", "plan", "runs", "submit"]

_LAZY = {"Run": "hpctrain.api", "Status": "hpctrain.api", "submit": "hpctrain.api",  # name -> module
         "Plan": "hpctrain.plan.model"}


class _StageAndFunction(types.ModuleType):
    """`hpctrain.plan` and `hpctrain.runs` are both a stage subpackage (hpctrain.plan.planner, hpctrain.runs.folder)
    and an API function (hpctrain.plan(...) -> Plan, hpctrain.runs() -> [Run]). Python binds a subpackage to its
    parent's attribute whenever it is imported, which would replace a function of the same name; so the
    subpackage itself is made callable, and calling it calls hpctrain.api's function of its name."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(_api(), self.__name__.rpartition(".")[2])(*args, **kwargs)


def _api() -> types.ModuleType:
    """hpctrain.api, imported by name: the rank side imports this package for __version__ (hpctrain.node,
    hpctrain.runs.repro) and must not be taken to depend on the login side's API, which it never calls."""
    import importlib

    return importlib.import_module("hpctrain.api")


def _make_callable() -> None:
    # Both package __init__s hold only a docstring: importing them costs microseconds, nothing else loads.
    # By name, as _api: a stage below `plan` that imports this package (data, for __version__) does not use them.
    import importlib

    for name in ("hpctrain.plan", "hpctrain.runs"):
        importlib.import_module(name).__class__ = _StageAndFunction


_make_callable()


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")
