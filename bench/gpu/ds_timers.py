"""Timers around the pieces of DeepSpeed's ZeRO optimizer step, for bench/gpu/plain_ds.py --breakdown.

Each wrapped method is timed between two CUDA synchronisations, so a piece's figure is its own wall time
(the copies it issues included) and the overlap between pieces is lost: a breakdown run is slower than a
baseline run and is only read for where the step's time goes.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import torch

# ZeRO-3 (stage3.py) and ZeRO-1/2 (stage_1_and_2.py) methods called from their step(); a missing one is skipped.
PIECES = ("_pre_step", "_partition_all_parameters", "_get_norm_groups", "scaled_global_norm", "_prepare_sub_group",
          "unscale_and_clip_grads", "_optimizer_step", "_reassign_or_swap_out_partitioned_parameters",
          "_release_sub_group", "_post_step", "_wait_for_offload_copies")


def _timed(fn: Callable[..., Any], out: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)

    return wrapper


def wrap_step_pieces(optimizer: Any, pieces: dict[str, list[float]]) -> None:
    """Replace each method of PIECES on this optimizer instance by a timed one; durations go to pieces[name]."""
    for name in PIECES:
        fn = getattr(optimizer, name, None)
        if fn is None or not isinstance(fn, types.MethodType | types.FunctionType):
            continue
        pieces[name] = []
        setattr(optimizer, name, _timed(fn, pieces[name]))
