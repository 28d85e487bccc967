"""Two fixes to DeepSpeed 0.19.8's ZeRO-3 optimizer step when the optimizer lives on the CPU.

Found against the step's parts measured alone (bench/gpu/offload_parts.py, BENCHMARKS.md December): at 3B the
ZeRO-3 offload step spent ~1.5 s beyond forward+backward, CPU Adam and the copies. DeepSpeed's stage3.py does,
for every CPU sub-group of the optimizer, after CPU Adam:

1. `_reassign_or_swap_out_partitioned_parameters`: `gpu_bf16.copy_(cpu_fp32)`, a blocking copy with a dtype
   change. torch converts blocking cross-device copies on the CPU (aten/native/cuda/Copy.cu: "for blocking
   transfers conversions are performed on CPU"), into a fresh pageable bf16 tensor of the sub-group's size
   (2 GB per 1e9 elements, page-faulted anew every step), then copies that pageable tensor to the GPU at the
   driver's staged pace. ZeRO-1/2 (stage_1_and_2.py) keep a pinned bf16 buffer for the same copy; ZeRO-3 does
   not. Here, in the order tried:
   - `DeviceCast` (the default): the CPU fp32 master weights are page-locked where they lie (cudaHostRegister
     at install, no copy), so each sub-group's copy-back is queued on a side stream as fp32 chunks crossing
     PCIe into one GPU scratch buffer and cast to bf16 on the GPU. The host returns at once and runs CPU Adam
     of the next sub-group while the copy flies; the step waits for the copies once, before its epilogue
     (`_post_step` gathers persistent parameters from these buffers, and the next forward reads them). Twice
     the PCIe bytes of a bf16 copy, but no CPU work at all: the copy hides behind CPU Adam, except the last
     sub-group's.
   - `PinnedStager` (when the master weights cannot be page-locked): two small pinned bf16 buffers, reused;
     the CPU converts one chunk while the previous chunk crosses PCIe, near the pinned rate, blocking.
   Both round as the CPU's fp32 -> bf16 cast does (round to nearest even, as the GPU's), so the parameters
   are bit-identical to DeepSpeed's.
2. `unscale_and_clip_grads`: `fp32_grad.mul_(1 / combined_scale)` over every CPU gradient (12.8 GB at 3B), also
   when the combined scale is 1 (bf16 has no loss scale; the gradient norm is below the clip). ZeRO-1/2 skip
   it only when clipping is off. Here: skipped when the scale is exactly 1.0 (a multiply by 1.0 changes no
   bit), the original otherwise.

`install` patches one optimizer instance (not DeepSpeed's class), checks that the attributes it relies on
exist (another DeepSpeed version may differ: then nothing is patched and the reason is returned), and is
turned off with HPCTRAIN_ZERO3_OFFLOAD_FIX=0 (for A/B runs). Only the node imports this module.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
from typing import Any

import torch

from hpctrain.node.model.pinned import pin_in_place

log = logging.getLogger("hpctrain.node")

CHUNK_ELEMENTS = 64 << 20  # 64 Mi elements: 128 MiB of bf16 per pinned buffer, two buffers
NEEDED = ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat", "subgroup_to_device", "clip_grad",
          "loss_scale", "offload_optimizer", "_unflatten_partitioned_parameters", "unscale_and_clip_grads",
          "_reassign_or_swap_out_partitioned_parameters", "_post_step")


class DeviceCast:
    """CPU fp32 (page-locked) -> GPU 16-bit, queued on a side stream: fp32 chunks cross PCIe into one GPU
    scratch buffer and are cast there. `copy` returns at once; `wait` blocks until every queued copy is done."""

    def __init__(self, chunk: int = CHUNK_ELEMENTS) -> None:
        self.chunk = chunk
        self.stream = torch.cuda.Stream()
        # One buffer is enough: the copies and casts of one stream run in order, and a cast of 64 Mi elements
        # takes ~0.1 ms against ~5 ms for the chunk's flight.
        self.scratch = torch.empty(chunk, dtype=torch.float32, device=torch.cuda.current_device())
        self.done = torch.cuda.Event()
        self.pending = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue dst (flat, on the GPU) = src (flat, pinned CPU fp32), cast on the GPU."""
        # Whatever the compute stream queued before (the backward's last reads of these parameters) first.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for start in range(0, src.numel(), self.chunk):
                m = min(self.chunk, src.numel() - start)
                self.scratch[:m].copy_(src[start:start + m], non_blocking=True)
                dst[start:start + m].copy_(self.scratch[:m])
        self.done.record(self.stream)
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            self.done.synchronize()
            self.pending = False


class PinnedStager:
    """CPU fp32 -> GPU 16-bit through two reused pinned buffers: convert chunk k on the CPU while chunk k-1
    is in flight; a buffer is refilled only after its last copy's event has completed."""

    def __init__(self, dtype: torch.dtype, chunk: int = CHUNK_ELEMENTS) -> None:
        self.chunk = chunk
        self.bufs = [torch.empty(chunk, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (flat, on the GPU) = src (flat, on the CPU), converted to dst's dtype on the CPU."""
        n = src.numel()
        for k, start in enumerate(range(0, n, self.chunk)):
            i = k % 2
            self.events[i].synchronize()  # an event never recorded returns at once
            m = min(self.chunk, n - start)
            buf = self.bufs[i][:m]
            buf.copy_(src[start:start + m])
            dst[start:start + m].copy_(buf, non_blocking=True)
            self.events[i].record()
        # Done when it returns, as DeepSpeed's blocking copy was: ZeRO-3 fetches parameters on its own stream,
        # which does not wait for this one (costs the last chunk's flight, ~2-5 ms per sub-group).
        for event in self.events:
            event.synchronize()


def enabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Off only when HPCTRAIN_ZERO3_OFFLOAD_FIX is "0" (the A/B switch of the benchmarks)."""
    env = os.environ if env is None else env
    return env.get("HPCTRAIN_ZERO3_OFFLOAD_FIX", "1") != "0"


def applies(opt: Any) -> str:
    """"" when the fixes apply to this optimizer, else why not."""
    if type(opt).__name__ != "DeepSpeedZeroOptimizer_Stage3":
        return f"not ZeRO-3 ({type(opt).__name__})"
    missing = [a for a in NEEDED if not hasattr(opt, a)]
    if missing:
        return f"this DeepSpeed's ZeRO-3 optimizer lacks {', '.join(missing)}"
    if not opt.offload_optimizer:
        return "the optimizer is not offloaded"
    if getattr(opt, "swap_optimizer", False):
        return "the optimizer is swapped to NVMe (another copy path)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if "cpu" not in set(opt.subgroup_to_device.values()):
        return "no optimizer sub-group on the CPU"
    return ""


def install(opt: Any) -> str:
    """Patch this ZeRO-3 optimizer instance; returns what was done (or why nothing was), for the log."""
    if not enabled():
        return "off (HPCTRAIN_ZERO3_OFFLOAD_FIX=0)"
    why = applies(opt)
    if why:
        return f"not installed: {why}"
    groups = [g for g in opt.fp16_partitioned_groups_flat if g is not None]
    cpu_masters = [opt.fp32_partitioned_groups_flat[i] for i, d in opt.subgroup_to_device.items() if d == "cpu"]
    caster = DeviceCast() if all(pin_in_place(t.data) for t in cpu_masters) else None
    stagers: list[PinnedStager] = []  # the blocking path's pinned buffers, made when first needed

    def stager() -> PinnedStager:
        if not stagers:
            stagers.append(PinnedStager(groups[0].dtype))
        return stagers[0]
    reassign, unscale, post_step = (opt._reassign_or_swap_out_partitioned_parameters, opt.unscale_and_clip_grads,
                                    opt._post_step)

    def reassign_fast(self: Any, sub_group_id: int) -> None:
        dst = self.fp16_partitioned_groups_flat[sub_group_id]
        src = self.fp32_partitioned_groups_flat[sub_group_id]
        if dst is None or src.device.type != "cpu" or dst.device.type != "cuda":
            reassign(sub_group_id)
            return
        if caster is not None and src.data.is_pinned():  # a resume may have replaced the registered storage
            caster.copy(dst.data, src.data)
        else:
            stager().copy(dst.data, src.data)
        self._unflatten_partitioned_parameters(sub_group_id)

    def post_step_after_copies(self: Any, *args: Any, **kwargs: Any) -> Any:
        if caster is not None:
            caster.wait()  # the epilogue gathers persistent parameters from the copied buffers
        return post_step(*args, **kwargs)

    def unscale_unless_one(self: Any, sub_group_id: int, total_norm: Any) -> None:
        scale = combined_scale(float(self.loss_scale), float(self.clip_grad), total_norm)
        if scale != 1.0 or self.fp32_partitioned_groups_flat[sub_group_id].device.type != "cpu":
            unscale(sub_group_id, total_norm)

    opt._reassign_or_swap_out_partitioned_parameters = types.MethodType(reassign_fast, opt)
    opt.unscale_and_clip_grads = types.MethodType(unscale_unless_one, opt)
    opt._post_step = types.MethodType(post_step_after_copies, opt)
    how = ("copy-back cast on the GPU, asynchronous (master weights page-locked in place, "
           f"{len(cpu_masters)} sub-group(s), {sum(t.numel() for t in cpu_masters) * 4 / 1e9:.1f} GB)"
           if caster is not None else
           f"pinned chunked bf16 copy-back (2 x {CHUNK_ELEMENTS * groups[0].element_size() >> 20} MiB pinned; "
           "the master weights could not be page-locked)")
    return f"installed on {len(cpu_masters)} CPU sub-group(s): {how}, no multiply by 1.0"


def combined_scale(loss_scale: float, clip_grad: float, total_norm: Any) -> float:
    """DeepSpeed's combined_scale of stage3.unscale_and_clip_grads, as a float: the same tensor operations in
    the same order (so "exactly 1.0" here is exactly 1.0 there)."""
    if clip_grad <= 0.0:
        return loss_scale
    norm = total_norm if isinstance(total_norm, torch.Tensor) else torch.tensor(float(total_norm))
    clip = torch.clamp(((norm / loss_scale) + 1e-6) / clip_grad, min=1.0)
    return float(clip * loss_scale)


# --------------------------------------------------------------------------------------------- CPU Adam's build
def needs_cpu_adam(ds_config: dict[str, Any], use_gpu: bool) -> bool:
    """Whether deepspeed.initialize will build DeepSpeedCPUAdam: a GPU rank whose optimizer lives on the host
    without torch's AdamW (render/deepspeed.adam_implementation keeps DeepSpeed's CPU Adam for offload)."""
    zero = ds_config.get("zero_optimization") or {}
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    return use_gpu and (zero.get("offload_optimizer") or {}).get("device") == "cpu" and not params.get("torch_adam")


def prebuild_cpu_adam(ds_config: dict[str, Any], use_gpu: bool) -> threading.Thread | None:
    """Start DeepSpeedCPUAdam's JIT build on a thread (None when the run needs none).

    DeepSpeed builds the op on first use on a fresh node or container (46-50 s on the H200 host), inside
    deepspeed.initialize, after the model is built: on the critical path. Started when prepare knows the
    optimizer runs on the host, the compile (ninja in a subprocess: the GIL is free) overlaps the tokenizer,
    the data and the model build; a cached build loads in about a second. `join_cpu_adam` waits for it before
    deepspeed.initialize, whose DeepSpeedCPUAdam then finds the op loaded (OpBuilder._loaded_ops). A failure
    is only logged: DeepSpeed's own build then runs, and reports it, as without this."""
    if not needs_cpu_adam(ds_config, use_gpu):
        return None

    def build() -> None:
        t0 = time.perf_counter()
        try:
            from deepspeed.ops.op_builder import CPUAdamBuilder

            CPUAdamBuilder().load(verbose=False)
            log.info("CPU Adam op ready in %.1f s (built or loaded beside the model build)", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed's own load reports it again, with its traceback
            log.info("CPU Adam prebuild failed after %.1f s (%s); DeepSpeed builds it itself",
                     time.perf_counter() - t0, exc)

    thread = threading.Thread(target=build, name="hpctrain-cpu-adam", daemon=True)
    thread.start()
    return thread


def join_cpu_adam(thread: threading.Thread | None) -> float:
    """Wait for `prebuild_cpu_adam`'s thread; returns the seconds waited (0 when it had finished)."""
    if thread is None:
        return 0.0
    t0 = time.perf_counter()
    thread.join()
    return time.perf_counter() - t0
