"""The planner's memory model: bytes per rank on the GPU and per host, term by term.

Pure arithmetic (no torch). Each term is a named constant or a short formula taken from how
DeepSpeed 0.19.8 allocates (runtime/zero/stage3.py, stage_1_and_2.py) and how Hugging Face's Llama
computes its loss; every term shows up in plan.json `memory.breakdown` (GiB) so that a measurement
can be laid next to it and one constant recalibrated at a time.

ZeRO-3, as DeepSpeed 0.19.8 allocates it (dp = data-parallel ranks, N = parameters):
- bf16 weights: 2 N/dp on the GPU (`offload_param`: pinned on the host instead).
- gradient partition: in the model's dtype (the engine passes `gradient_accumulation_dtype` = the
  `data_types.grad_accum_dtype` it is given, else the model dtype: bf16 here), 2 N/dp, in one flat buffer
  on the optimizer's device. With optimizer offload that buffer is pinned host memory for *all*
  parameters, whatever the ratio. (Counted as fp32 until 2026-12-02: every estimate with it was high by
  2 N, 16 GB of host memory for 8B.)
- optimizer: fp32 master + Adam m + v = 12 N/dp, in "sub-groups" of `sub_group_size` (1e9) elements.
  Optimizer offload at ratio r puts the last n - int((1 - r) * n) of the n sub-groups on the CPU: their
  master, m, v (pageable) and a fp32 gradient copy (pinned), 16 B/param; the others stay on the GPU
  with their own fp32 gradient copy, 16 B/param. So the split is by whole sub-groups: 8B on one GPU
  has 8, and ratio 0.5 puts 4 of them (48.7% of the parameters) on the CPU.
- without offload, the optimizer step flattens one sub-group's fp32 gradient (a transient of up to
  4 B x 1e9, after the activations are freed): the peak is the larger of that and the activations.
- gathered parameters in flight: the largest module (the embedding / lm_head) and its bf16 gradient.

Activations: with checkpointing, each layer keeps its bf16 input and one layer is recomputed at a
time, not while the loss's buffers are live; without it, every layer keeps everything its backward
needs (`layer_activation_bytes`: 34 h per token for a GPT-2 block, ~52 h for a Llama-3 block, whose RMSNorms keep fp32
copies and whose SwiGLU MLP keeps four I-wide tensors). The loss dominates at Llama-3's 128k vocabulary: HF upcasts the
logits to fp32 for cross-entropy and its backward holds the fp32 log-softmax, its gradient and the
input gradient at once: 12 bytes per logit element (the bf16 logits are freed by then, as long as the
trainer does not keep the model output alive across backward; hpctrain's node does not).

Host per rank: the python + torch + DeepSpeed process, plus whatever offload pins or keeps there.

LoRA ([lora] r > 0; `Shape.lora_params` adapter parameters): the base is frozen, so it costs its weights
only (in the training dtype, partitioned under ZeRO-3; QLoRA's NF4 linears ~0.516 B/param with the
double-quantized scales, the rest of the base in the training dtype), and gradients, optimizer state,
offload and ZeRO-3's sub-groups count the adapters alone. Activations are a full fine-tune's (the backward
still runs through every frozen layer to reach the adapters below) plus LoRA dropout's 1-byte mask of every
adapted linear's input. Checked on one H200 (Llama-3.2-1B shape, r = 16, ZeRO-2, 2 x 2048 tokens): LoRA
17.99 GB measured, 17.83 estimated; QLoRA 16.55 and 16.39 (tests/test_lora.py); ZeRO-3 20.63 and 19.44,
with recompute 10.34 and 10.85. Offload with LoRA is not measured.

Checked against H200 measurements (seq 4096, bf16, one GPU; GPU figure = torch.cuda.max_memory_allocated,
compared with the estimate minus `runtime`; host figure = the process's peak RSS; GB = 1e9 B; the table is in
docs/planner.md and tests/test_plan_gpu.py holds every row to 10%): ten GPU peaks of 1B, 3B and 8B with and
without offload and recompute, among them the planner's own 1B and 8B choices, within +1.0% to +5.0%; five host
peaks with optimizer offload (1B, 3B full; 8B ratios 0.15, 0.3, 0.5) within -1.7% to +2.3%; 8B full offload
killed for host memory on a 125 GiB host (predicted 140 GiB: refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hpctrain.plan.buckets import zero3_buckets
from hpctrain.spec.rules import mem_bytes

GiB = 1024**3
DEFAULT_GPU_GB = 80.0  # A100/H100 80GB: the common training GPU when the site does not say
DEFAULT_HOST_GB = 256.0  # assumed when --mem is not given
FIT_FRACTION = 0.9  # leave 10% for fragmentation and the allocator

# --- calibration constants (bytes unless named _GB) -------------------------------------------------
GPU_RUNTIME_GB = 1.5  # CUDA context, NCCL, cuBLAS workspaces: outside torch's max_memory_allocated
# One python + torch + deepspeed process on the host (GPU rank), with what offload needs beside its named
# buffers (the pinned allocator's rounding, CPU Adam's threads): fitted to the host peaks (ru_maxrss) of
# 8B ratio 0.15 2 x 8 (51.1 GB), 8B ratio 0.5 mb 2 (86.0), 3B full offload (63.6) and 1B full offload (28.7),
# all within 3% with it (BENCHMARKS.md, December).
HOST_RANK_GB = 5.5
CPU_RANK_GB = 1.5  # the same on a CPU-only rank (no CUDA libraries)
SUB_GROUP_SIZE = 10**9  # DeepSpeed's zero_optimization.sub_group_size default (elements)
ZERO3_GRAD_BYTES = 4  # ZeRO-3's fp32 copies of a sub-group's gradient (optimizer step, GPU sub-groups)
ADAM_BYTES_MIXED = 12  # fp32 master + m + v when training in bf16/fp16
ADAM_BYTES_FP32 = 8  # m + v: the fp32 weights are the master copy
OFFLOADED_GROUP_BYTES = 16  # per parameter of a CPU sub-group: master, m, v + the pinned fp32 gradient copy
GPU_GROUP_BYTES = 16  # per parameter of a GPU sub-group under partial offload: the same on the GPU
ACT_SBH_BYTES = 34  # GPT-2 block, per token, in units of h (Korthikanti et al. 2022, fused attention)
LLAMA_NORM_BYTES_PER_H = 6  # HF LlamaRMSNorm: autograd keeps the fp32 input (4 h) and the bf16 normalised x (2 h)
LIGER_ACT_FRACTION = 0.82  # a Llama layer's activations with Liger's fused kernels / without (H200-measured)
FUSED_CE_BYTES_PER_H = 4  # Liger's fused linear cross-entropy: the input gradient it computes in forward (+ slack)
LOGIT_BYTES = 12  # per logit element at the loss: fp32 log-softmax + its gradient + the input gradient
BUCKET_ELEMENTS_PER_H2 = 2  # ZeRO-1/2 reduce + allgather buckets: hidden^2 elements each (render/deepspeed.py)
# bitsandbytes NF4 with double quantization: 4 bits + an 8-bit absmax per 64 weights + a fp32 scale per 256
# of those (4 + 8/64 + 32/16384 = 4.127 bits).
NF4_BYTES = 4.127 / 8


@dataclass(frozen=True)
class Estimate:
    """Memory of one choice, in GiB: per rank on its device, and per host, with the terms."""

    zero: int
    offload: str
    device_gb: float
    host_gb: float
    fits: bool
    breakdown: dict[str, float] = field(default_factory=dict)
    offload_ratio: float = 1.0  # fraction of optimizer state on the CPU as asked (DeepSpeed's ratio)
    cpu_fraction: float = 0.0  # the fraction that actually lands there (whole sub-groups)
    micro_batch: int = 1
    activation_checkpointing: bool = False


def parse_mem_gb(mem: str) -> float | None:
    """SLURM --mem in GiB ("125G" -> 125.0; unit-less is megabytes), None when unset or unreadable
    (hpctrain.spec.rules.mem_bytes reads it)."""
    size = mem_bytes(mem)
    return size / 2**30 if size is not None else None


def layer_params(a: dict[str, Any]) -> int:
    """Parameters of one transformer block."""
    return sum(_layer_tensors(a))


def _layer_tensors(a: dict[str, Any]) -> list[int]:
    """One block's parameter tensors in module order (DeepSpeed builds sub-groups in this order)."""
    h, i, hd = int(a["hidden"]), int(a["intermediate"]), int(a["head_dim"])
    heads, kvh = int(a["heads"]), int(a["kv_heads"])
    if a["style"] == "gpt2":  # c_attn (3h) + c_proj + 2-layer MLP, all with biases, 2 LayerNorms (w+b)
        return [2 * h, h * 3 * h + 3 * h, h * h + h, 2 * h, h * i + i, i * h + h]
    bias = a["attention_bias"]
    q, kv, o = h * heads * hd + (heads * hd if bias else 0), h * kvh * hd + (kvh * hd if bias else 0), heads * hd * h
    experts = int(a.get("experts") or 0)
    if experts:  # router, the experts fused as transformers holds them (gate_up, down), a shared expert and its gate
        mi, si = int(a["moe_intermediate"]), int(a["shared_expert_intermediate"])
        shared = [h * si, h * si, si * h, h] if si else []
        return [q, kv, kv, o, h * experts, experts * 2 * mi * h, experts * mi * h, *shared, h, h]
    return [q, kv, kv, o, h * i, h * i, i * h, h, h]  # SwiGLU MLP (gate, up, down) + 2 RMSNorms


def model_tensors(a: dict[str, Any]) -> list[int]:
    """Every parameter tensor's size in module order; tied embeddings once."""
    h, v, layers = int(a["hidden"]), int(a["vocab"]), int(a["layers"])
    head = [v * h]
    if a["style"] == "gpt2":
        head.append(int(a["positions"]) * h)
    tail = [2 * h] if a["style"] == "gpt2" else [h]
    if not a["tied"]:
        tail.append(v * h)
    return head + _layer_tensors(a) * layers + tail


def sub_groups(a: dict[str, Any], dp: int, shard_div: int = 1) -> list[int]:
    """Sizes of one rank's optimizer sub-groups, as DeepSpeed's `_create_fp16_sub_groups` cuts them:
    parameters in order, a group closes once it reaches SUB_GROUP_SIZE elements."""
    groups, cur = [], 0
    for t in model_tensors(a):
        cur += math.ceil(t / shard_div / dp)
        if cur >= SUB_GROUP_SIZE:
            groups.append(cur)
            cur = 0
    if cur:
        groups.append(cur)
    return groups


def cpu_share(groups: list[int], ratio: float) -> float:
    """Fraction of the optimizer state DeepSpeed puts on the CPU for `ratio` (its exact expression)."""
    n = len(groups)
    on_gpu = int((1 - ratio) * n)
    return sum(groups[on_gpu:]) / max(1, sum(groups))


def lora_linears(a: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """One block's linear layers as {module name: (in features, out features)}: what LoRA can adapt
    ("all-linear" leaves the output head out)."""
    h, i, hd = int(a["hidden"]), int(a["intermediate"]), int(a["head_dim"])
    if a["style"] == "gpt2":  # Conv1D layers (PEFT adapts them too); c_proj is in attention and in the MLP
        return {"c_attn": (h, 3 * h), "c_proj": (h + i, 2 * h), "c_fc": (h, i)}
    q, kv = int(a["heads"]) * hd, int(a["kv_heads"]) * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _targeted(a: dict[str, Any], targets: tuple[str, ...]) -> list[tuple[int, int]]:
    """(in, out) of the block's linears LoRA adapts: `targets` () = every one; names the planner does not
    know count as every layer (an estimate errs high rather than low)."""
    layers = lora_linears(a)
    chosen = [n for n in layers if n in targets] if targets else list(layers)
    return [layers[n] for n in chosen or layers]


def lora_param_count(a: dict[str, Any], r: int, targets: tuple[str, ...] = ()) -> int:
    """Adapter parameters: r x (in + out) for every targeted linear of every block (A is r x in, B out x r)."""
    return int(a["layers"]) * sum(r * (i + o) for i, o in _targeted(a, targets))


def lora_mask_elems(a: dict[str, Any], targets: tuple[str, ...] = ()) -> int:
    """Elements per token and block that LoRA's dropout keeps a mask of: the adapted linears' inputs.
    Measured on an H200 (Llama-3.2-1B, r = 16, dropout 0.05, 2 x 2048 tokens, ZeRO-2): 1.5 GB above the
    estimate without them, 1.34 GB with them as 1-byte masks."""
    return sum(i for i, _ in _targeted(a, targets))


def base_weight_bytes(sh: Shape) -> float:
    """The frozen base's weights on one (unpartitioned) rank: the training dtype, or NF4 for the blocks'
    linears under QLoRA (embeddings, norms and the output head stay in the training dtype)."""
    shard = sh.params / (sh.tp * sh.pp)
    if not sh.quant_4bit:
        return shard * sh.wb
    block_linears = int(sh.arch["layers"]) * sum(i * o for i, o in lora_linears(sh.arch).values())
    return block_linears * NF4_BYTES + (sh.params - block_linears) * sh.wb


def _lora_groups(n: int, dp: int) -> list[int]:
    """ZeRO-3 sub-groups of the adapters' optimizer partition (SUB_GROUP_SIZE elements each)."""
    part = math.ceil(n / dp)
    return [SUB_GROUP_SIZE] * (part // SUB_GROUP_SIZE) + ([part % SUB_GROUP_SIZE] if part % SUB_GROUP_SIZE else [])


@dataclass(frozen=True)
class Shape:
    """What an estimate needs to know about the run besides the choice."""

    arch: dict[str, Any]
    params: int
    dp: int
    tp: int
    pp: int
    seq: int
    wb: int  # bytes per weight: 2 (bf16/fp16) or 4 (fp32)
    gpu: bool
    ranks_per_node: int
    device_cap: float  # bytes; inf on CPU ranks
    host_cap: float  # bytes
    lora_params: int = 0  # LoRA adapter parameters (0: the whole model trains)
    lora_mask_elems: int = 0  # per token and block: inputs of the adapted linears, whose dropout masks stay (1 B)
    quant_4bit: bool = False  # QLoRA: the base's transformer-block linears in NF4
    liger: bool = False  # Liger Kernel's fused RMSNorm/RoPE/SwiGLU (hpctrain.node.model.kernels): fewer activations
    fused_ce: bool = False  # and its fused linear cross-entropy: no logits at the loss


def layer_activation_bytes(a: dict[str, Any], tokens: int, wb: int, tp: int, liger: bool = False) -> float:
    """Bytes one transformer block keeps for backward over `tokens` tokens (16-bit activations x wb/2).

    GPT-2 style: Korthikanti et al.'s 34 h per token (fused attention, no s^2 term). Llama style, as
    Hugging Face's LlamaDecoderLayer saves them: each RMSNorm keeps its fp32 input and the bf16
    normalised tensor that meets the weight (6 h; the fp32 product in between is not saved); q, its
    rotate_half copy and the rotated q (6 h); k and v with their RoPE copies (8 kv); attention output and
    o_proj input (4 h); the SwiGLU MLP's gate, silu, up and product (8 I). 22 h + 8 kv + 8 I: about 52 h
    for Llama 3 8B, against the 34 h of a GPT block. Checked on an H200 without checkpointing: 1B ZeRO-3
    micro-batch 6 measured 100.8 GB, predicted 107 GB (+6%; with 10 h per norm it was +12%).

    With Liger Kernel's fused kernels (`liger`; liger_kernel 0.8.5): LIGER_ACT_FRACTION of that, measured. On
    paper each RMSNorm keeps its bf16 input (2 h), RoPE only cos/sin, the SwiGLU gate and up (6 I with the down
    projection's input): 62% of the unfused bytes; measured on one H200 (8B LoRA r=16, 4 x 4096, no recompute,
    2026-12-03) the peak was 119.6 GiB where 62% predicted 100.3: 82% fits it (the fused kernels' own
    transients and what the paper count misses).
    """
    h, inter = int(a["hidden"]), int(a["intermediate"])
    if a["style"] == "gpt2":
        per_token = ACT_SBH_BYTES * h
    else:
        kv = int(a["kv_heads"]) * int(a["head_dim"])
        per_token = LLAMA_NORM_BYTES_PER_H * 2 * h + 10 * h + 8 * kv + 8 * inter
        if liger:
            per_token = int(per_token * LIGER_ACT_FRACTION)
    return tokens * per_token * wb / 2 / tp


def _activations(sh: Shape, micro: int, ac: bool, zero: int = 0) -> tuple[float, float, float]:
    """(kept layer activations, one layer being recomputed, loss/logits) bytes of one rank in backward.

    With checkpointing each layer keeps only its input; the layer being recomputed and the loss are not
    live at the same time (the loss's buffers are freed before the last layer's recompute starts)."""
    a = sh.arch
    h, layers, tokens = int(a["hidden"]), int(a["layers"]) // sh.pp, sh.seq * micro
    full = layer_activation_bytes(a, tokens, sh.wb, sh.tp, sh.liger) + tokens * sh.lora_mask_elems  # LoRA masks
    kept = layers * tokens * h * sh.wb if ac else layers * full
    # The fused cross-entropy never materialises the logits: it keeps the hidden states' gradient instead.
    # Under ZeRO-3 it stays off (the head's weight is partitioned: hpctrain.node.model.kernels).
    logits = tokens * h * FUSED_CE_BYTES_PER_H if sh.fused_ce and zero < 3 else tokens * int(a["vocab"]) * LOGIT_BYTES
    return kept, full if ac else 0.0, logits


def _bucket_bytes(sh: Shape, zero: int, shard: float) -> float:
    """ZeRO's communication buckets on the device. ZeRO-3: reduce + prefetch bucket of hpctrain.plan.buckets'
    table (1.24 B params: 5e8 + 5e7 measured +1.0 GB peak against the h*h rule's 4.2 M + 3.8 M)."""
    h = int(sh.arch["hidden"])
    if zero >= 3:
        b = zero3_buckets("gpu" if sh.gpu else "cpu", sh.params, h)
        return min(b.reduce + b.prefetch, shard) * sh.wb
    return BUCKET_ELEMENTS_PER_H2 * min(h * h, shard) * sh.wb if zero >= 1 else 0.0


def estimate(sh: Shape, zero: int, offload: str, micro: int, ac: bool, ratio: float = 1.0) -> Estimate:
    """Peak memory of one choice. Offloaded state moves from the device to the host's RAM."""
    a, dp, wb = sh.arch, sh.dp, sh.wb
    lora = sh.lora_params > 0
    # What trains: every parameter, or (LoRA) the adapters beside a frozen base that costs its weights only.
    shard = sh.lora_params if lora else sh.params / (sh.tp * sh.pp)
    adam = ADAM_BYTES_FP32 if wb == 4 else ADAM_BYTES_MIXED
    weights = ((base_weight_bytes(sh) if lora else 0.0) + shard * wb) / (dp if zero >= 3 else 1)
    opt_off = offload in ("optimizer", "all")
    host_pinned = host_state = step_transient = 0.0
    cpu_frac = 0.0
    if zero >= 3:
        groups = _lora_groups(sh.lora_params, dp) if lora else sub_groups(a, dp, sh.tp * sh.pp)
        part = shard / dp
        if opt_off:
            cpu_frac = cpu_share(groups, ratio)
            grads = 0.0
            optim = GPU_GROUP_BYTES * part * (1 - cpu_frac)
            host_pinned = wb * part  # the flat gradient buffer (model dtype), pinned, for every parameter
            host_state = OFFLOADED_GROUP_BYTES * part * cpu_frac
            on_gpu = groups[: int((1 - ratio) * len(groups))]
            step_transient = ZERO3_GRAD_BYTES * max(on_gpu, default=0)  # torch AdamW's temporaries
        else:
            grads = wb * part  # the flat gradient buffer, in the model dtype
            optim = adam * part
            step_transient = ZERO3_GRAD_BYTES * max(groups)  # the flattened gradient of one sub-group
    else:
        grads = shard * wb / (dp if zero >= 2 else 1)
        optim = shard * adam / (dp if zero >= 1 else 1)
        if opt_off:  # stage_1_and_2: master + m + v and a fp32 gradient partition on the host
            cpu_frac = 1.0
            host_state = optim + shard * 4 / dp
            optim = 0.0
    if offload in ("param", "all"):
        host_pinned += weights
        weights = 0.0
    acts, recompute, logits = _activations(sh, micro, ac, zero)
    h, v = int(a["hidden"]), int(a["vocab"])
    largest = max(v * h, layer_params(a)) / sh.tp
    gathered = (1 if lora else 2) * largest * wb if zero == 3 else 0.0  # gathered module + its 16-bit gradient
    # ZeRO-3's prefetch bucket gathers frozen weights too; ZeRO-1/2's buckets carry trained gradients only.
    buckets = _bucket_bytes(sh, zero, sh.params / (sh.tp * sh.pp) if zero >= 3 else shard)
    runtime = (GPU_RUNTIME_GB if sh.gpu else CPU_RANK_GB) * GiB
    in_backward = acts + max(logits, recompute) + gathered
    device = weights + grads + optim + buckets + runtime + max(in_backward, step_transient)
    terms = (("weights", weights), ("grads", grads), ("optimizer", optim), ("activations", acts),
             ("recompute", recompute), ("logits", logits), ("zero_buffers", gathered + buckets),
             ("step_transient", step_transient),
             ("runtime", runtime), ("host_pinned", host_pinned), ("host_optimizer", host_state))
    breakdown = {k: round(x / GiB, 3) for k, x in terms}
    offloaded = host_pinned + host_state
    if sh.gpu:
        host = sh.ranks_per_node * (HOST_RANK_GB * GiB + offloaded)
    else:  # CPU ranks: the "device" is host RAM, so offload moves nothing
        device += offloaded
        host = sh.ranks_per_node * device
    fits = device <= FIT_FRACTION * sh.device_cap and host <= FIT_FRACTION * sh.host_cap
    return Estimate(zero, offload, round(device / GiB, 3), round(host / GiB, 3), fits, breakdown,
                    offload_ratio=ratio, cpu_fraction=round(cpu_frac, 4), micro_batch=micro,
                    activation_checkpointing=ac)
