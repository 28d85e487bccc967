"""The planner's time model: a predicted optimizer-step time for one rank's choice, from measured rates.

Pure arithmetic (no torch), like the memory model beside it (hpctrain.plan.memory). A step is

    compute + pcie + cpu_adam + copy_back + unscale + gpu_adam

- compute: model FLOPs of the step's tokens (6 N' + 12 L H S per token, N' without the input-embedding
  lookup) x 4/3 with activation checkpointing (one more forward), at `efficiency(hidden)` x the measured bf16
  matmul rate. The efficiency is what a whole Llama forward+backward reached on this machine, by hidden size.
- pcie, the part of the gradient offload that the backward does not hide: ZeRO-3 with optimizer offload keeps
  the gradient partition of *every* parameter in pinned host memory (stage3.py partition_grads). The last
  micro-step of a step (the accumulation boundary) copies it out, back, and the CPU share out again in fp32,
  in one chain that does not overlap the backward: one 4 N-byte copy's time, exposed. Every other micro-step
  copies the buffer in, adds on the GPU and copies it out (`duplex` x a 4 N copy: the directions overlap in
  part) beside that micro-step's backward (overlap_comm), which hides up to its own length: 3/4 of the
  micro-step's compute with recompute (recompute + backward), 2/3 without. So small micro-batches with many
  accumulation steps pay for the offload, large ones do not: 8B at 2 x 8 ran 1.4 s slower than at 4 x 4.
- cpu_adam: DeepSpeedCPUAdam over the parameters of the CPU sub-groups (memory.cpu_share).
- copy_back: the updated CPU master weights back to the GPU: hpctrain.node.model.zero_offload casts them on the GPU,
  asynchronously, behind the next sub-group's CPU Adam, so only the last sub-group's fp32 flight shows; plain
  DeepSpeed's own blocking copy from pageable memory (`pageable_copy_back`) costs all of it.
- unscale: gradient clipping multiplies every CPU gradient (bf16: whenever the norm exceeds the clip).
- gpu_adam: torch's fused AdamW on the GPU's share, memory-bound (~32 bytes per parameter).
Communication between ranks is not modelled (the figures are one GPU's); nor is ZeRO-3's per-layer fetch
(one rank holds every parameter). Checked against every measured step (tests/test_timemodel.py): within 15%.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hpctrain.plan.memory import SUB_GROUP_SIZE, Estimate, Shape

RECOMPUTE_FACTOR = 4.0 / 3.0  # activation checkpointing runs the forward twice: 8 N instead of 6 N per token
GPU_ADAM_BYTES = 32  # fused AdamW: read p, g, m, v (fp32) + write p, m, v + the bf16 copy, per parameter
# Share of a micro-step's compute that runs its backward (where the gradient offload can hide): recompute +
# backward = 6 N of 8 N with activation checkpointing, backward = 4 N of 6 N without.
BACKWARD_SHARE = {True: 0.75, False: 2.0 / 3.0}


@dataclass(frozen=True)
class Machine:
    """Measured rates of one GPU kind and its host, with where they came from."""

    name: str
    matmul_tflops: float  # dense bf16 8192^3
    efficiency: tuple[tuple[int, float], ...]  # (hidden size, achieved fraction of matmul_tflops), ascending
    pcie_gbps: float  # pinned host <-> device, one direction, GB/s
    duplex: float  # time of a 4 N copy in + 4 N copy out, in units of one 4 N copy (1 = full duplex, 2 = none)
    cpu_adam_gparams: float  # DeepSpeedCPUAdam, all host cores, G params/s
    gpu_mem_tbps: float  # device memory bandwidth reached by streaming kernels, TB/s
    pageable_copy_back_ns: float  # DeepSpeed's blocking pageable copy-back, ns per parameter
    unscale_ns: float  # CPU multiply of one fp32 gradient (read + write), ns per parameter
    measured: str  # date, machine and command of the figures


# One H200 (143,771 MiB), 16 host cores, DeepSpeed 0.19.8, torch 2.11 + CUDA 13 (BENCHMARKS.md, December).
H200 = Machine(
    name="H200 (one GPU, 16 host cores)",
    matmul_tflops=788.0,  # 2026-11-29, bf16 8192^3
    # hidden 2048: Llama-1B, between ZeRO-3 micro-batch 4 + recompute (33,465 tok/s, 2026-12-01,
    #   bench/gpu/bucket_sweep.py: 0.51) and the planner's ZeRO-0 8 x 2 without (49,143 tok/s, 2026-12-02,
    #   bench/gpu_suite.py: 0.56); 3072: Llama-3B forward+backward alone, micro-batch 4 + recompute,
    #   0.958-0.975 s (2026-12-01b/02, bench/gpu/offload_parts.py --parts); 4096: Llama-8B ZeRO-3 ratio 0.5,
    #   4 x 4 + recompute, 287 model TFLOPS, less its modelled offload and CPU tail (issue 18's plain runs).
    efficiency=((2048, 0.53), (3072, 0.67), (4096, 0.714)),
    pcie_gbps=55.0,  # 2026-12-01b/02: 12.85 GB fp32 in 0.233-0.239 s both ways (offload_parts.py --parts)
    duplex=1.55,  # fitted to issue 18's 8B ratio-0.4 1 x 16 run (17.84 s), then checked at 2 x 8 (three runs)
    cpu_adam_gparams=4.2,  # 3.83, 4.52 (2026-12-01b) and 3.64 (2026-12-02) G params/s over 3.21 B, 1e9 sub-groups
    gpu_mem_tbps=3.0,
    # 2026-12-01b/02: 2.431, 1.682, 2.177 s for 3.21 B alone (offload_parts.py); 0.5 fits plain DeepSpeed's
    # whole 3B and 8B steps (the copy overlaps in part with the host's other work there).
    pageable_copy_back_ns=0.5,
    unscale_ns=0.062,  # 2026-12-01b: 0.206 / 0.192 s for 3.21 B (0.231 s on 2026-12-02)
    measured="2026-11-29 .. 2026-12-02, one H200 (device kind nvidia-h200); bench/gpu/offload_parts.py --parts, "
             "bench/gpu/bucket_sweep.py, bench/gpu_suite.py, issue 18's 8B runs (BENCHMARKS.md, December)",
)

MACHINES = {"h200": H200}


@dataclass(frozen=True)
class Work:
    """What one rank does in one optimizer step."""

    params: int  # N, all parameters of the model (one rank holds all at dp 1)
    flops_per_token: float  # model FLOPs: 6 N' + 12 L H S
    tokens: int  # micro_batch x grad_accum x seq on this rank
    hidden: int
    micro_steps: int  # grad_accum
    recompute: bool
    offload: bool  # the optimizer (all or some sub-groups) on the CPU
    cpu_fraction: float  # of the optimizer state on the CPU (memory.cpu_share)
    zero3_offload: bool = True  # ZeRO-3's pinned gradient buffer (stage 1/2 copy per micro-step too: same cost)
    pageable_copy_back: bool = False  # plain DeepSpeed's ZeRO-3 copy-back (no hpctrain.node.model.zero_offload)
    clipping: bool = True  # gradient clipping active (the norm above the clip: early training, random data)


@dataclass(frozen=True)
class StepTime:
    """The predicted step and its terms, seconds."""

    compute: float
    pcie: float
    cpu_adam: float
    copy_back: float
    unscale: float
    gpu_adam: float

    @property
    def total(self) -> float:
        return self.compute + self.pcie + self.cpu_adam + self.copy_back + self.unscale + self.gpu_adam

    def describe(self) -> str:
        parts = [f"compute {self.compute:.2f}"]
        if self.pcie:
            parts.append(f"gradient offload {self.pcie:.2f} (not hidden by the backward)")
        for name, v in (("CPU Adam", self.cpu_adam), ("copy-back", self.copy_back), ("unscale", self.unscale),
                        ("GPU Adam", self.gpu_adam)):
            if v >= 0.005:
                parts.append(f"{name} {v:.2f}")
        return f"{self.total:.2f} s ({', '.join(parts)})"


def efficiency(m: Machine, hidden: int) -> float:
    """Achieved fraction of the matmul rate at this hidden size: linear between the measured sizes, the
    nearest measured one outside them."""
    pts = m.efficiency
    if hidden <= pts[0][0]:
        return pts[0][1]
    for (h0, e0), (h1, e1) in itertools.pairwise(pts):
        if hidden <= h1:
            return e0 + (e1 - e0) * (hidden - h0) / (h1 - h0)
    return pts[-1][1]


def model_flops_per_token(params: int, vocab: int, hidden: int, layers: int, seq: int, tied: bool) -> float:
    """6 N' + 12 L H S, N' = N without the input-embedding lookup (a tied lm_head counted once)."""
    emb = vocab * hidden
    n = params - (0 if tied else emb)
    return 6.0 * n + 12.0 * layers * hidden * seq


def step_time(m: Machine, w: Work) -> StepTime:
    """Predicted optimizer-step time of one rank (see the module docstring for the terms)."""
    flops = w.flops_per_token * w.tokens * (RECOMPUTE_FACTOR if w.recompute else 1.0)
    compute = flops / (m.matmul_tflops * 1e12 * efficiency(m, w.hidden))
    pcie = cpu_adam = copy_back = unscale = 0.0
    on_cpu = w.params * w.cpu_fraction if w.offload else 0.0
    if w.offload:
        one_way = 4.0 * w.params / (m.pcie_gbps * 1e9)
        hidden = BACKWARD_SHARE[w.recompute] * compute / max(1, w.micro_steps)  # one micro-step's backward
        pcie = one_way + (w.micro_steps - 1) * max(0.0, m.duplex * one_way - hidden)
        cpu_adam = on_cpu / (m.cpu_adam_gparams * 1e9)
        if w.pageable_copy_back and w.zero3_offload:
            copy_back = on_cpu * m.pageable_copy_back_ns * 1e-9
        else:  # the last CPU sub-group's fp32 crossing PCIe: the others hide behind the next one's CPU Adam
            copy_back = 4.0 * min(on_cpu, SUB_GROUP_SIZE) / (m.pcie_gbps * 1e9)
        unscale = on_cpu * m.unscale_ns * 1e-9 if w.clipping else 0.0
    gpu_adam = (w.params - on_cpu) * GPU_ADAM_BYTES / (m.gpu_mem_tbps * 1e12)
    return StepTime(compute, pcie, cpu_adam, copy_back, unscale, gpu_adam)


def work_of(sh: Shape, e: Estimate, accum: int, offload_fix: bool = True) -> Work:
    """The Work of one memory estimate (hpctrain.plan.memory) at `accum` micro-steps per optimizer step."""
    a, split = sh.arch, sh.tp * sh.pp
    fpt = model_flops_per_token(sh.params, int(a["vocab"]), int(a["hidden"]), int(a["layers"]), sh.seq,
                                bool(a["tied"]))
    offload = e.offload in ("optimizer", "all")
    return Work(params=sh.params // (split * (sh.dp if e.zero >= 1 else 1)), flops_per_token=fpt / split,
                tokens=e.micro_batch * accum * sh.seq, hidden=int(a["hidden"]), micro_steps=accum,
                recompute=e.activation_checkpointing, offload=offload, cpu_fraction=e.cpu_fraction if offload else 0.0,
                zero3_offload=e.zero == 3, pageable_copy_back=not offload_fix)


def predict(sh: Shape, e: Estimate, accum: int, machine: Machine = H200) -> StepTime:
    """Predicted step of the entrypoint (with hpctrain.node.model.zero_offload) for this estimate."""
    return step_time(machine, work_of(sh, e, accum))
