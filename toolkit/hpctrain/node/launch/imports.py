"""Keeping a rank's start-up imports to what training uses.

`import deepspeed` imports its autotuner, whose module imports mlflow when it is installed (hpctrain's
mlflow extra, or an image that has it), only to log tuning experiments; the node never runs the autotuner.
That import cost every rank ~1 s of its start-up on this project's 2-core test machine (`import deepspeed`
1.9-2.4 s with it against 1.1-1.2 s without, 2026-12-02), on every start and every restart. The finder below refuses
mlflow to that one module while it is being imported (DeepSpeed then records has_mlflow = False); any other
`import mlflow`, before or after (the node's MLflow tracker), is untouched.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

AUTOTUNER = "deepspeed.autotuning.autotuner"


class _NoMlflowForTheAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> ModuleSpec | None:
        if fullname != "mlflow" and not fullname.startswith("mlflow."):
            return None
        importer = sys.modules.get(AUTOTUNER)
        if importer is not None and getattr(importer.__spec__, "_initializing", False):
            raise ImportError("mlflow is not loaded for DeepSpeed's autotuner on hpctrain's ranks")
        return None


def install() -> None:
    """Once per process, before deepspeed is imported (later it changes nothing)."""
    if not any(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())
