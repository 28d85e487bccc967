"""Page-locking host memory that already exists (cudaHostRegister): asynchronous copies to and from it then run
at the pinned rate, without a second buffer. Used by the ZeRO-3 offload copy-back (node/model/zero_offload.py) and the
asynchronous checkpoint's host buffers (node/checkpointing/ckpt_async.py). Only the node imports this module."""

from __future__ import annotations

import torch


def pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock a CPU tensor's memory where it lies, at its exact size (torch's pinned allocator would round a
    new block up to a power of two). False when it cannot be (no CUDA, no cudart binding, refused): the caller
    keeps an unpinned or blocking path. The registration lasts as long as the process: callers keep the tensor
    alive as long."""
    if t.is_pinned():
        return True
    try:
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    except Exception:  # noqa: BLE001 - not registrable here: the caller's other path
        return False
    return bool(t.is_pinned())
