"""Prototype: a faster deepspeed.initialize for ZeRO-3 with optimizer offload on GPU ranks (issue 26 item 1).

Where the 8B full fine-tune's engine phase went (cProfile of train.build_engine on the H200, 2026-12-03 call 1,
67.3 s): 17.7 s in `Tensor.pin_memory` (ZeRO-3's bf16 flat gradient buffer, 16 GB, and every sub-group's fp32
gradient buffer, 4 GB each, the GPU sub-groups' too, each first made pageable then copied into a block of
torch's pinned allocator, rounded up to a power of two: 64 GiB of cudaHostAlloc); 16.0 s in
`zero.utils.defragment` (all bf16 partitions copied tensor by tensor to a pageable host buffer and back, so
the flat buffer is contiguous on the GPU); 10.7 s reading the weights; ~9 s of torch.library/inductor imports.

`install()` changes two things, for the engine's lifetime:
- `defragment` on the device when the GPU has room for a second copy of the partitions (device-to-device
  copies into the flat buffer; DeepSpeed's host round trip otherwise);
- `_setup_for_real_optimizer` runs with pinning off, then page-locks the buffers that stay on the host (the
  flat gradient buffer and the CPU sub-groups' gradients) where they lie: touched by a parallel fill, then
  cudaHostRegister (hpctrain.node.model.pinned), at their exact size. The GPU sub-groups' temporary host buffers
  are never pinned.
"""

from __future__ import annotations

import time
from typing import Any

TIMES: dict[str, float] = {}


def _defragment_on_device(orig: Any) -> Any:
    def defragment(tensors: list[Any]) -> Any:
        import torch
        from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

        t0 = time.perf_counter()
        dev = tensors[0].device
        total = sum(t.numel() for t in tensors)
        nbytes = total * tensors[0].element_size()
        if dev.type != "cuda" or torch.cuda.mem_get_info(dev)[0] < nbytes + (2 << 30):
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


def _setup_pinned_in_place(orig: Any) -> Any:
    def setup(self: Any) -> Any:
        from hpctrain.node.model.pinned import pin_in_place

        t0 = time.perf_counter()
        pin = bool(self.offload_optimizer_pin_memory)
        self.offload_optimizer_pin_memory = False
        try:
            out = orig(self)
        finally:
            self.offload_optimizer_pin_memory = pin
        TIMES["setup_unpinned_s"] = time.perf_counter() - t0
        if pin and self.offload_optimizer:
            t1 = time.perf_counter()
            to_dev = getattr(self, "subgroup_to_device", {})
            bufs = [self.grad_partitions_flat_buffer] + [
                g.grad for i, g in enumerate(self.fp32_partitioned_groups_flat)
                if to_dev.get(i, "cpu") == "cpu" and g.grad is not None and g.grad.device.type == "cpu"]
            for b in bufs:
                if b.device.type == "cpu" and not b.is_pinned():
                    b.zero_()  # fault the pages in on every core before the (single-threaded) registration
                    pin_in_place(b)
            TIMES["pin_in_place_s"] = time.perf_counter() - t1
            TIMES["pinned_gb"] = sum(b.numel() * b.element_size() for b in bufs if b.is_pinned()) / 1e9
        return out

    return setup


def install() -> None:
    import deepspeed.runtime.zero.stage3 as s3

    if getattr(s3, "_hpctrain_fast_init", False):
        return
    s3.defragment = _defragment_on_device(s3.defragment)
    cls = s3.DeepSpeedZeroOptimizer_Stage3
    cls._setup_for_real_optimizer = _setup_pinned_in_place(cls._setup_for_real_optimizer)
    s3._hpctrain_fast_init = True
