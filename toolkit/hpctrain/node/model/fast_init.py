"""A faster deepspeed.initialize for ZeRO-3 with optimizer offload on GPU ranks (issue 26: start-up to step 1).

Where the 8B full fine-tune's engine phase went (cProfile of train.build_engine on one H200, 2026-12-03, 67.3 s):
17.7 s in `Tensor.pin_memory` (ZeRO-3's bf16 flat gradient buffer, 16 GB, and every sub-group's fp32 gradient
buffer, 4 GB each, the GPU sub-groups' too, each first made pageable then copied into a block of torch's pinned
allocator, rounded up to a power of two: 64 GiB of cudaHostAlloc); 16.0 s in `zero.utils.defragment` (all bf16
partitions copied tensor by tensor to a pageable host buffer and back, so that the flat buffer is contiguous on
the GPU). The prototype of this module (bench/gpu/fast_init.py) cut that phase 54.2 -> 30.6 s there.

`install()` changes two things in DeepSpeed's ZeRO-3 module, for the process:
- `defragment` runs on the device when the GPU has room for a second copy of the partitions (device-to-device
  copies into the flat buffer); DeepSpeed's host round trip otherwise, and always on a CPU tensor;
- `_setup_for_real_optimizer` runs with pinning off, then page-locks the buffers that stay on the host (the flat
  gradient buffer and the CPU sub-groups' fp32 gradients) where they lie: touched by a fill first (the pages
  fault in before the single-threaded registration), then cudaHostRegister (node/model/pinned.py) at their
  exact size. The GPU sub-groups' temporary host buffers are never pinned.
Both leave every value as DeepSpeed's code would. HPCTRAIN_FAST_INIT=0 turns it off (A/B runs).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("hpctrain.node")

TIMES: dict[str, float] = {}  # seconds by part, for the log line and the benchmarks
HEADROOM = 2 << 30  # bytes left free on the GPU beside the second copy defragment makes there


def wanted(ds_config: Mapping[str, Any], use_gpu: bool, env: Mapping[str, str] | None = None) -> str:
    """"" when `install` should run for this engine, else why not (for the log)."""
    env = os.environ if env is None else env
    if env.get("HPCTRAIN_FAST_INIT", "1") == "0":
        return "off (HPCTRAIN_FAST_INIT=0)"
    zero = ds_config.get("zero_optimization", {})
    if not use_gpu or int(zero.get("stage", 0)) != 3 or "offload_optimizer" not in zero:
        return "only for ZeRO-3 with optimizer offload on GPU ranks"
    return ""


def install() -> None:
    """Patch DeepSpeed's ZeRO-3 module (once per process)."""
    import deepspeed.runtime.zero.stage3 as s3

    if getattr(s3, "_hpctrain_fast_init", False):
        return
    s3.defragment = _defragment_on_device(s3.defragment)
    cls = s3.DeepSpeedZeroOptimizer_Stage3
    cls._setup_for_real_optimizer = _setup_pinned_in_place(cls._setup_for_real_optimizer)
    s3._hpctrain_fast_init = True


def _defragment_on_device(orig: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def defragment(tensors: list[Any]) -> Any:
        import torch
        from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

        t0 = time.perf_counter()
        dev = tensors[0].device
        total = sum(t.numel() for t in tensors)
        nbytes = total * tensors[0].element_size()
        if dev.type != "cuda" or torch.cuda.mem_get_info(dev)[0] < nbytes + HEADROOM:
            out = orig(tensors)
        else:
            out = torch.empty(total, dtype=tensors[0].dtype, device=dev)
            for tensor, offset, numel in get_mapping_to_flat_buffer(tensors):
                out.narrow(0, offset, numel).copy_(tensor)
                tensor.data = out.narrow(0, offset, numel)
            torch.cuda.synchronize(dev)
        TIMES["defragment_s"] = TIMES.get("defragment_s", 0.0) + time.perf_counter() - t0
        return out

    return defragment


def _setup_pinned_in_place(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def setup(self: Any) -> Any:
        t0 = time.perf_counter()
        pin = bool(self.offload_optimizer_pin_memory)
        self.offload_optimizer_pin_memory = False
        try:
            out = orig(self)
        finally:
            self.offload_optimizer_pin_memory = pin
        TIMES["setup_unpinned_s"] = time.perf_counter() - t0
        if pin and self.offload_optimizer:
            _pin_host_buffers(self)
        return out

    return setup


def _pin_host_buffers(opt: Any) -> None:
    from hpctrain.node.model.pinned import pin_in_place

    t0 = time.perf_counter()
    to_dev = getattr(opt, "subgroup_to_device", {})
    bufs = [opt.grad_partitions_flat_buffer] + [
        g.grad for i, g in enumerate(opt.fp32_partitioned_groups_flat)
        if to_dev.get(i, "cpu") == "cpu" and g.grad is not None and g.grad.device.type == "cpu"]
    unpinned = 0
    for b in bufs:
        if b.device.type == "cpu" and not b.is_pinned():
            b.zero_()  # fault the pages in (torch's fill is multi-threaded) before the registration
            if not pin_in_place(b):
                unpinned += 1  # then DeepSpeed's copies use it pageable: slower, still correct
    TIMES["pin_in_place_s"] = time.perf_counter() - t0
    TIMES["pinned_gb"] = sum(b.numel() * b.element_size() for b in bufs if b.is_pinned()) / 1e9
    if unpinned:
        log.warning("fast init: %d host buffer(s) could not be page-locked; their copies run pageable", unpinned)
