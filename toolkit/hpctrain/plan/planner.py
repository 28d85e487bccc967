"""Derived facts of a run, computed once from the spec: parallel degrees, batch arithmetic,
parameter count, a memory estimate per rank and per host, and the ZeRO/offload/ratio,
micro-batch and activation-checkpointing choices.

Pure arithmetic (no torch): it runs on a login node in milliseconds. The memory model lives in
`hpctrain.plan.memory` (mixed-precision accounting as DeepSpeed 0.19.8's ZeRO stages allocate it,
activations, logits, pinned host buffers; the figures it was checked against are listed there).
Its purpose is to refuse hopeless plans and to pick the fastest setting that fits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hpctrain.errors import HpcUsageError, bad_value
from hpctrain.plan.memory import (
    DEFAULT_GPU_GB,
    DEFAULT_HOST_GB,
    SUB_GROUP_SIZE,
    Estimate,
    GiB,
    Shape,
    base_weight_bytes,
    estimate,
    layer_activation_bytes,
    layer_params,
    lora_mask_elems,
    lora_param_count,
    parse_mem_gb,
)
from hpctrain.plan.model import Plan
from hpctrain.plan.timemodel import H200, StepTime, predict
from hpctrain.spec import finetune
from hpctrain.spec.finetune import Default
from hpctrain.spec.model import Model, Spec, user_script
from hpctrain.spec.presets import PRESETS
from hpctrain.spec.rules import (
    MODEL_BOOL_KEYS,
    MODEL_SHAPE_KEYS,
    Kind,
    check_model_key,
    how_to_set,
    need,
    zero_choices,
)

OFFLOADS_IN_ORDER = ("none", "optimizer", "param", "all")


# --------------------------------------------------------------------------------------------------
# Model shape and parameter count

def load_model_config(model: Model) -> dict[str, Any]:
    """The model's config.json as a dict: a preset, a config path, or a model folder's config.json,
    with `[model.overrides]` applied (the node applies the same overrides)."""
    if model.config in PRESETS:
        cfg = dict(PRESETS[model.config])
    else:
        path = Path(model.path) / "config.json" if model.path else Path(model.config)
        key = "model.path" if model.path else "model.config"
        if not model.path and not model.config:
            raise bad_value("model.path", "", "no model given",
                            "pass --model DIR or set [model] config = 'llama-tiny' (a preset or config.json)")
        try:
            cfg = json.loads(_read_config(path))
            if not isinstance(cfg, dict):
                raise TypeError("not a JSON object")
        except (OSError, ValueError, TypeError, RecursionError) as exc:  # JSON/Unicode decode errors: ValueErrors
            fix = (f"point it at a readable config.json (presets: {', '.join(PRESETS)})" if not model.path else
                   "point [model] path (--model DIR) at a local Hugging Face folder written by save_pretrained "
                   "(config.json, *.safetensors, the tokenizer files). Compute nodes are offline: download it once, "
                   "e.g. `huggingface-cli download ORG/NAME --local-dir DIR`")
            raise bad_value(key, getattr(model, key.split(".")[1]), f"cannot read {path} ({exc})", fix) from None
    cfg.update(model.overrides)
    return cfg


MAX_CONFIG_BYTES = 16 << 20  # a config.json is kilobytes; /dev/zero or a weights file given by mistake is not read


def _read_config(path: Path) -> str:
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
        raise ValueError("not a regular file")
    with open(path, "rb") as fh:
        data = fh.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"larger than the limit of {MAX_CONFIG_BYTES} bytes")
    return data.decode("utf-8")


def model_arch(cfg: dict[str, Any], overridden: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """Normalise Llama/Mistral/Qwen2-style and GPT-2-style config keys to one shape.

    Every dimension is checked first (a positive whole number; heads divide the hidden size, kv heads
    divide the heads): num_attention_heads = 0 used to divide by zero and hidden_size = -64 "fitted".
    A refusal names `model.overrides.KEY` when the value came from an override (OVERRIDDEN).
    """
    def where(key: str) -> str:
        return f"model.overrides.{key}" if key in overridden else f"model config.json {key}"

    for key in sorted((MODEL_SHAPE_KEYS | MODEL_BOOL_KEYS) & set(cfg)):
        if cfg[key] is not None:  # null in a config.json means "not set" (GPT-2's n_inner)
            check_model_key(where(key), key, cfg[key])

    def get(*names: str, default: Any = None) -> tuple[str, Any]:
        for n in names:
            if cfg.get(n) is not None:
                return n, cfg[n]
        if default is None:
            raise HpcUsageError(f"model config: none of {names} found (model_type "
                                f"{cfg.get('model_type')!r}). Fix: use a Llama, Mistral or GPT-2 style config.json")
        return names[0], default

    kind = str(cfg.get("model_type", "llama"))
    hidden_key, hidden = get("hidden_size", "n_embd", "d_model")
    heads_key, heads = get("num_attention_heads", "n_head")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    need(bool(cfg.get("head_dim")) or hidden % heads == 0, where(heads_key), heads,
         f"{hidden_key} {hidden} is not divisible by {heads_key} {heads}",
         f"choose {heads_key} among the divisors of {hidden} (or set head_dim)")
    need(heads % kv_heads == 0, where("num_key_value_heads"), kv_heads,
         f"{heads_key} {heads} is not a multiple of num_key_value_heads {kv_heads}",
         f"choose num_key_value_heads among the divisors of {heads}")
    gpt2 = kind == "gpt2" or "n_embd" in cfg
    # MoE (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek): every expert's weights are held, trained and stepped, so
    # memory counts them all (a Mixtral 8x7B planned as a dense 7B ran out of memory by 6.7x its weights).
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    inter = int(get("intermediate_size", "n_inner", default=0)[1] or 4 * hidden)
    moe_inter = int(cfg.get("moe_intermediate_size") or inter) if experts else 0
    shared = int(cfg.get("shared_expert_intermediate_size") or int(cfg.get("n_shared_experts") or 0) * moe_inter)
    return {
        "model_type": kind,
        "style": "gpt2" if gpt2 else "llama",
        "hidden": int(hidden),
        "layers": int(get("num_hidden_layers", "n_layer")[1]),
        "heads": int(heads),
        "kv_heads": kv_heads,
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "intermediate": inter,
        "experts": experts,  # 0: a dense MLP
        "moe_intermediate": moe_inter,
        "shared_expert_intermediate": shared if experts else 0,
        "vocab": int(get("vocab_size")[1]),
        "positions": int(get("max_position_embeddings", "n_positions", default=0)[1]),
        "tied": bool(cfg.get("tie_word_embeddings", gpt2)),
        "attention_bias": bool(cfg.get("attention_bias", kind in ("qwen2", "qwen2_moe"))),
    }


def param_count(a: dict[str, Any]) -> int:
    """Total parameters; tied embeddings counted once."""
    h, v, layers = int(a["hidden"]), int(a["vocab"]), int(a["layers"])
    emb = v * h * (1 if a["tied"] else 2)
    if a["style"] == "gpt2":
        return layers * layer_params(a) + emb + int(a["positions"]) * h + 2 * h
    return layers * layer_params(a) + emb + h


# --------------------------------------------------------------------------------------------------
# Degrees and batch arithmetic

def ranks_per_node(spec: Spec) -> int:
    """One rank per GPU; on CPU, tasks_per_node ranks (or 1)."""
    r = spec.resources
    return r.gpus_per_node or r.tasks_per_node or 1


def divisors(n: int) -> list[int]:
    """The divisors of n (>= 1) in increasing order, found in O(sqrt n): the spec bounds n (MAX_NODES,
    MAX_BATCH), and a walk over every number up to n took 44 s for a global batch of 1e9."""
    small: list[int] = []
    large: list[int] = []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _multiples(g: int, unit: int) -> str:
    """The multiples of `unit` on either side of g: '48 or 72'."""
    below, above = (g // unit) * unit, (g // unit + 1) * unit
    return f"{below} or {above}" if below else str(above)


def batch_sizes(spec: Spec, dp: int) -> tuple[int, int, int]:
    """(micro, accum, global) with global = micro * accum * dp; the missing value(s) derived.

    Refusals name the value that fixes the triple, because "inconsistent" alone helps nobody.
    """
    t = spec.train
    m, a, g = t.micro_batch, t.grad_accum, t.global_batch
    if g and m and a:
        if g != m * a * dp:
            fix = f"set --global-batch {m * a * dp}"
            if g % (m * dp) == 0:
                fix += f", or --grad-accum {g // (m * dp)}"
            raise bad_value("train.global_batch", g, f"micro_batch {m} x grad_accum {a} x dp {dp} = {m * a * dp}",
                            fix + ", or leave one of the three unset (0) to derive it")
        return m, a, g
    if g:
        if m:
            if g % (m * dp):
                raise bad_value("train.global_batch", g, f"not a multiple of micro_batch x dp = {m} x {dp}",
                                f"set --global-batch {_multiples(g, m * dp)}, or change --micro-batch")
            return m, g // (m * dp), g
        a = a or 1
        if g % (a * dp):
            raise bad_value("train.global_batch", g, f"not a multiple of grad_accum x dp = {a} x {dp}",
                            f"set --global-batch {_multiples(g, a * dp)}, or change --grad-accum")
        return g // (a * dp), a, g
    m, a = m or 1, a or 1
    return m, a, m * a * dp


# --------------------------------------------------------------------------------------------------
# Memory (the model itself is hpctrain.plan.memory)

RATIO_STEP = 0.05  # offload_ratio auto tries 0.05, 0.10, ... 1.0


def _ratio_steps() -> list[float]:
    n = round(1 / RATIO_STEP)
    return [round(k * RATIO_STEP, 2) for k in range(1, n + 1)]


def _shape(spec: Spec, arch: dict[str, Any], params: int, dp: int) -> Shape:
    r, p = spec.resources, spec.parallel
    gpu = r.gpus_per_node > 0
    return Shape(arch=arch, params=params, dp=dp, tp=p.tp, pp=p.pp, seq=spec.data.seq_len,
                 wb=4 if spec.train.precision == "fp32" else 2, gpu=gpu, ranks_per_node=ranks_per_node(spec),
                 device_cap=(r.gpu_mem_gb or DEFAULT_GPU_GB) * GiB if gpu else float("inf"),
                 host_cap=(parse_mem_gb(r.mem) or DEFAULT_HOST_GB) * GiB,
                 lora_params=lora_param_count(arch, spec.lora.r, spec.lora.target_modules) if spec.lora.r else 0,
                 quant_4bit=spec.lora.quantize == "4bit",
                 lora_mask_elems=lora_mask_elems(arch, spec.lora.target_modules)
                 if spec.lora.r and spec.lora.dropout > 0 else 0,
                 liger=kernels_of(spec) == "liger" and arch["style"] != "gpt2",
                 fused_ce=kernels_of(spec) == "liger" and arch["style"] != "gpt2" and p.pp == 1)


def kernels_of(spec: Spec) -> str:
    """The fused kernels the ranks apply: `[model] kernels`, on GPU ranks of one pipeline stage only."""
    ok = spec.resources.gpus_per_node > 0 and spec.parallel.pp == 1
    return spec.model.kernels if ok else "none"


def kernels_reason(spec: Spec, sh: Shape) -> str:
    """What `[model] kernels` does to this plan, for plan.reasons."""
    if spec.model.kernels == "none":
        return ""
    if kernels_of(spec) == "none":
        where = "a pipeline (pp > 1)" if spec.parallel.pp > 1 else "CPU ranks (Triton kernels need a GPU)"
        return f"kernels = {spec.model.kernels} -> none: {where}"
    tokens = sh.seq
    per_layer = (layer_activation_bytes(sh.arch, tokens, sh.wb, sh.tp, liger=sh.liger)
                 / layer_activation_bytes(sh.arch, tokens, sh.wb, sh.tp))
    return (f"kernels = liger: fused RMSNorm, RoPE and SwiGLU keep {per_layer:.0%} of a layer's activations; "
            "the fused linear cross-entropy keeps no logits (ZeRO 0-2; under ZeRO-3 the head's weight is "
            "partitioned and transformers' loss stays)")


def lora_reason(spec: Spec, sh: Shape) -> str:
    """What LoRA changes in the memory estimate, for plan.reasons."""
    lo = spec.lora
    where = ", ".join(lo.target_modules) if lo.target_modules else "every linear layer but the output head"
    dtype = "NF4 block linears (QLoRA) + " + spec.train.precision if sh.quant_4bit else spec.train.precision
    return (f"LoRA r={lo.r} on {where}: {sh.lora_params / 1e6:.1f} M adapter parameters train "
            f"({sh.lora_params / sh.params:.2%} of {sh.params / 1e9:.2f} B); the frozen base costs its weights only "
            f"({dtype}, {base_weight_bytes(sh) / GiB:.1f} GiB unpartitioned), gradients and optimizer state are the "
            "adapters'")


def _micro_options(spec: Spec, dp: int) -> list[int] | None:
    """Micro-batches to try, largest first, when only the global batch is given; None otherwise."""
    t = spec.train
    if not t.global_batch or t.micro_batch or t.grad_accum or t.global_batch % dp:
        return None
    per_rank = t.global_batch // dp
    return divisors(per_rank)[::-1]


def _search(sh: Shape, kind: Kind, micros: list[int], acs: list[bool],
            accum_of: Callable[[int], int]) -> tuple[Estimate, bool, StepTime | None]:
    """The fastest fitting estimate of one kind, by the time model (hpctrain.plan.timemodel) on GPU ranks:
    every checkpointing choice and micro-batch, each at the smallest CPU share that fits (a larger share only
    adds CPU Adam time). CPU ranks have no measured rates: the first fit in the old order (checkpointing off
    first, then the smallest ratio, then the largest micro-batch). (estimate, fits, predicted step); when
    nothing fits, the smallest estimate tried."""
    zero, offload, ratio = kind
    ratios = _ratio_steps() if ratio == "auto" else [float(ratio)]
    tried: list[Estimate] = []
    fitting: list[tuple[float, int, Estimate, StepTime]] = []
    for ac in acs:
        for micro in micros:
            for r in ratios:
                e = estimate(sh, zero, offload, micro, ac, r)
                if ratio == "auto" and e.cpu_fraction >= 1.0:
                    break  # no longer partial: the same as full offload, which is its own kind
                tried.append(e)
                if not e.fits:
                    continue
                if not sh.gpu:
                    return e, True, None
                t = predict(sh, e, accum_of(micro))
                fitting.append((round(t.total, 4), len(fitting), e, t))
                break
    if fitting:
        _, _, best, t = min(fitting, key=lambda f: (f[0], f[1]))  # ties: the earlier in the order above
        return best, True, t
    if not tried:  # ratio auto found no partial split at all (a single sub-group)
        tried.append(estimate(sh, zero, offload, micros[-1], acs[-1], 1.0))
    return min(tried, key=lambda e: e.device_gb), False, None


def _option(e: Estimate, t: StepTime | None) -> dict[str, Any]:
    """One row of plan.options: the memory estimate and, where there is one, its predicted step."""
    return {**asdict(e), "predicted_step_s": round(t.total, 3) if t else None}


def _describe(e: Estimate) -> str:
    text = f"ZeRO {e.zero}, offload {e.offload!r}"
    if e.offload_ratio < 1:
        text += f" ratio {e.offload_ratio:g} ({e.cpu_fraction:.1%} of the optimizer state on the CPU)"
    return text


def _fit_text(e: Estimate) -> str:
    return f"{e.device_gb:.1f} GiB per rank, {e.host_gb:.1f} GiB per host"


def _degrees(spec: Spec) -> tuple[int, int, int]:
    p, r = spec.parallel, spec.resources
    rpn = ranks_per_node(spec)
    world = r.nodes * rpn
    if world % (p.tp * p.pp):
        found = divisors(world)
        valid = ", ".join(map(str, found)) if len(found) <= 24 else ", ".join(map(str, found[:24])) + ", ..."
        raise bad_value("parallel.tp*pp", p.tp * p.pp,
                        f"world size {world} ({r.nodes} nodes x {rpn} ranks) is not divisible by tp {p.tp} x pp {p.pp}",
                        f"choose tp*pp among [{valid}], or change --nodes/--gpus-per-node so the world size is a "
                        f"multiple of {p.tp * p.pp}")
    if p.tp > rpn and p.tp > 1:
        raise bad_value("parallel.tp", p.tp, f"tensor parallelism must stay inside a node ({rpn} ranks per node)",
                        how_to_set("parallel.tp", rpn))
    return rpn, world, world // (p.tp * p.pp)


# Kinds predicted within 5% (or 0.05 s) of the fastest count as equal and the earlier (less sharding) wins:
# the time model leaves out communication, which grows with the stage, and runs vary 5-9%.
TIE, TIE_S = 1.05, 0.05


def _choose(spec: Spec, sh: Shape, kinds: list[Kind], micros: list[int], acs: list[bool],
            accum_of: Callable[[int], int],
            reasons: list[str]) -> tuple[Estimate, list[tuple[Estimate, StepTime | None]], StepTime | None]:
    """Zero auto: the fitting kind of the shortest predicted step (GPU ranks; within TIE of it the earlier in
    zero_choices' order, since the time model leaves out communication, which grows with the stage), or the
    first fitting kind in that order (CPU ranks). An explicit choice is kept, with a warning if it does not fit."""
    p = spec.parallel
    found = [_search(sh, k, micros, acs, accum_of) for k in kinds]
    options = [(e, t) for e, _, t in found]
    if p.zero != "auto":
        chosen, fits, t = found[0]
        reasons.append(f"{_describe(chosen)}: as requested")
        if not fits:
            reasons.append(f"WARNING: estimated {_fit_text(chosen)} exceeds 90% of capacity; try --zero auto")
        return chosen, options, t
    fitting = [(i, e, t) for i, (e, fits, t) in enumerate(found) if fits]
    if fitting:
        fastest = min((t.total for _, _, t in fitting if t is not None), default=None)
        i, e, t = next(f for f in fitting if fastest is None or f[2] is None or f[2].total <= TIE * fastest + TIE_S)
        faster = [f"{z}/{o}" + (" partial" if r != 1.0 else "") for z, o, r in kinds[:i]
                  if not found[kinds.index((z, o, r))][1]]
        why = f" (earlier choices do not fit: {', '.join(faster)})" if faster else " (the fastest choice)"
        if t is not None and len(fitting) > 1:
            why += f"; predicted {t.total:.2f} s, the shortest of the {len(fitting)} that fit"
        reasons.append(f"zero auto -> {_describe(e)}: fits in {_fit_text(e)}{why}")
        return e, options, t
    best = min((e for e, _ in options), key=lambda e: e.device_gb)
    raise bad_value("parallel.zero", "auto",
                    f"no ZeRO/offload choice fits: the smallest needs {_fit_text(best)}",
                    "add nodes (--nodes), turn on --activation-checkpointing, lower --micro-batch, "
                    "offload everything (--offload all), or offload to NVMe (--offload all --offload-device nvme "
                    "--nvme-path DIR)")


def _explain(spec: Spec, chosen: Estimate, t: StepTime | None, micros: list[int], acs: list[bool],
             reasons: list[str]) -> None:
    """Reasons for the automatic micro-batch, checkpointing and ratio choices, and the predicted step."""
    how = "the shortest predicted step" if t is not None else "the largest that fits"
    if len(micros) > 1:
        reasons.append(f"micro-batch auto -> {chosen.micro_batch}: {how} among the divisors of global_batch / dp = "
                       f"{micros[0]} (larger micro-batches: fewer per-micro-step gradient offloads, more memory)")
    if len(acs) > 1:
        if t is not None:
            reasons.append(f"activation checkpointing auto -> {'on' if chosen.activation_checkpointing else 'off'}: "
                           "the shorter predicted step of the two (recompute costs 1/3 more compute; it frees "
                           "memory for larger micro-batches)")
        else:
            reasons.append("activation checkpointing auto -> " + (
                "on: the run does not fit without it (recompute costs ~25% more compute)"
                if chosen.activation_checkpointing
                else "off: the run fits without it (no recompute, ~25% less compute)"))
    if chosen.offload_ratio < 1 and spec.parallel.offload_ratio != chosen.offload_ratio:
        reasons.append(f"offload ratio auto -> {chosen.offload_ratio:g}: the smallest ratio (steps of {RATIO_STEP:g}) "
                       f"whose GPU estimate fits; DeepSpeed moves whole sub-groups of {SUB_GROUP_SIZE:.0e} elements, "
                       f"so {chosen.cpu_fraction:.1%} of the optimizer state goes to CPU Adam and the rest is stepped "
                       "on the GPU, which is far faster")
    if t is not None:
        reasons.append(f"predicted step {t.describe()}: hpctrain.plan.timemodel with the {H200.name} figures "
                       "(docs/planner.md); communication between ranks is not modelled")


def fault_reasons(spec: Spec) -> list[str]:
    """What the job does about failing nodes inside its allocation: spares, the health check."""
    r, f = spec.resources, spec.fault
    out = []
    if r.spare_nodes:
        out.append(f"{r.spare_nodes} spare node(s) allocated beside the {r.nodes} training node(s) "
                   f"({r.nodes + r.spare_nodes} in the job): a failing node is replaced in a new srun step, "
                   f"up to {f.in_job_restarts or r.spare_nodes} time(s)")
    if f.health_check:
        what = "GPUs: NVML errors and throttling, bf16 matmul rate" if r.gpus_per_node else "CPU matmul rate"
        out.append(f"health check before training on all {r.nodes + r.spare_nodes} node(s) ({what}; all-reduce and "
                   f"ring-pair bandwidth), at most {f.health_timeout_s} s: a failing node is "
                   + ("replaced by a spare" if r.spare_nodes else "excluded and the job resubmitted")
                   + " (SLURM jobs; sweeps and the local executor have none)")
    return out


def default_reasons(spec: Spec, defaults: Sequence[Default]) -> list[str]:
    """The fine-tuning defaults applied, each with its reason, and what no default could fix (a pretrained
    model fed byte ids): the one text of them, for plan.json, `hpctrain plan` and `submit`."""
    m, d = spec.model, spec.data
    return [x.line() for x in defaults] + finetune.warnings(m.path, d.tokenizer, d.source, d.format)


def fine_tuning_lines(spec: Spec, plan: Plan) -> list[str]:
    """The lines of `default_reasons` for a plan made with them (what `submit` prints)."""
    return default_reasons(spec, [Default(**d) for d in plan.defaults])


def make_plan(spec: Spec, defaults: Sequence[Default] = ()) -> Plan:
    """Derive the plan; refuse (HpcUsageError) what cannot run, saying which value fixes it.

    `defaults`: the fine-tuning defaults that resolution applied (hpctrain.spec.model.resolve_with_defaults),
    recorded with their reasons."""
    plan = _make_plan(spec)
    return dataclasses.replace(plan, reasons=[*plan.reasons, *default_reasons(spec, defaults)],
                               defaults=[x.as_json() for x in defaults])


# Families whose positions are a learned table of max_position_embeddings / n_positions rows: a longer row
# indexes past it, and every rank fails at its first forward (RoPE and ALiBi models only extrapolate).
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt"})


def _check_positions(spec: Spec, arch: dict[str, Any]) -> None:
    positions, kind = int(arch["positions"]), str(arch["model_type"])
    if kind not in LEARNED_POSITIONS or not positions:
        return
    need(spec.data.seq_len <= positions, "data.seq_len", spec.data.seq_len,
         f"longer than the model's {positions} learned positions ({kind} has a position embedding table, not RoPE)",
         f"set [data] seq_len = {positions} (or less)")


def _make_plan(spec: Spec) -> Plan:
    rpn, world, dp = _degrees(spec)
    if user_script(spec) and not (spec.model.path or spec.model.config):
        return _plan_unknown_model(spec, rpn, world, dp)
    micros = _micro_options(spec, dp)
    micro, accum, glob = batch_sizes(spec, dp)
    arch = model_arch(load_model_config(spec.model), set(spec.model.overrides))
    _check_positions(spec, arch)
    params = param_count(arch)
    r, t = spec.resources, spec.train
    reasons = [(f"world {world} = {r.nodes} nodes x {rpn} ranks; dp {dp} = world / "
                f"(tp {spec.parallel.tp} x pp {spec.parallel.pp})")]
    reasons += fault_reasons(spec)
    if r.gpus_per_node and not r.gpu_mem_gb:
        reasons.append(f"GPU memory assumed {DEFAULT_GPU_GB:g} GiB: set gpu_mem_gb in the site profile")
    if not r.mem:
        reasons.append(f"host memory assumed {DEFAULT_HOST_GB:g} GiB: pass --mem to check against the real size")
    if not r.gpus_per_node:
        reasons.append("CPU ranks: DS_ACCELERATOR=cpu with gloo; the 'device' is host RAM")
    sh = _shape(spec, arch, params, dp)
    acs = [False, True] if t.activation_checkpointing == "auto" else [bool(t.activation_checkpointing)]
    kinds = zero_choices(spec.parallel, gpu=bool(r.gpus_per_node))  # an explicit choice first, then the rest
    if sh.lora_params:
        reasons.append(lora_reason(spec, sh))
    if spec.model.kernels != "none":
        reasons.append(kernels_reason(spec, sh))
    if sh.quant_4bit:  # 4-bit weights: neither partitioned (ZeRO-3) nor offloaded (spec.rules refuses both)
        kinds = [k for k in kinds if k[0] < 3 and k[1] == "none"]
    per_rank = glob // dp
    accum_of: Callable[[int], int] = (lambda m: per_rank // m) if micros else (lambda m: accum)
    chosen, options, predicted = _choose(spec, sh, kinds, micros or [micro], acs, accum_of, reasons)
    if micros:
        micro, accum = chosen.micro_batch, glob // (chosen.micro_batch * dp)
    reasons.insert(1, f"global batch {glob} = micro {micro} x accum {accum} x dp {dp}")
    _explain(spec, chosen, predicted, micros or [micro], acs, reasons)
    memory = {"per_rank_gb": chosen.device_gb, "per_host_gb": chosen.host_gb, "breakdown": chosen.breakdown,
              "device_capacity_gb": (r.gpu_mem_gb or DEFAULT_GPU_GB) if r.gpus_per_node else None,
              "host_capacity_gb": parse_mem_gb(r.mem) or DEFAULT_HOST_GB, "fits": chosen.fits,
              "cpu_fraction": chosen.cpu_fraction}
    if sh.lora_params:
        memory["lora_params"] = sh.lora_params
    return Plan(world_size=world, nodes=r.nodes, ranks_per_node=rpn, dp=dp, pp=spec.parallel.pp,
                tp=spec.parallel.tp, micro_batch=micro, grad_accum=accum, global_batch=glob,
                zero_stage=chosen.zero, offload=chosen.offload, param_count=params, memory=memory,
                reasons=reasons, device="gpu" if r.gpus_per_node else "cpu", precision=t.precision,
                model=arch, options=[_option(e, t) for e, t in options], offload_ratio=chosen.offload_ratio,
                predicted_step_s=round(predicted.total, 3) if predicted else 0.0,
                activation_checkpointing=chosen.activation_checkpointing, spare_nodes=r.spare_nodes,
                in_job_restarts=spec.fault.in_job_restarts or r.spare_nodes, kernels=kernels_of(spec))


def _plan_unknown_model(spec: Spec, rpn: int, world: int, dp: int) -> Plan:
    """A user script without [model]: the shape and the batch arithmetic (ds_config.json carries them) are
    known; the model, so its parameter count and memory, is not, and the plan says so instead of inventing a
    fit. ZeRO auto needs an estimate to choose by."""
    p, t, r = spec.parallel, spec.train, spec.resources
    if p.zero == "auto":
        raise bad_value("parallel.zero", "auto", "your script's model is unknown to the planner (no [model]), so "
                        "there is no memory estimate to choose a ZeRO stage by",
                        "pass --zero 0, 1, 2 or 3, or describe the model with --model (a preset or a config.json) "
                        "to have it estimated")
    micro, accum, glob = batch_sizes(spec, dp)
    ratio = p.offload_ratio if isinstance(p.offload_ratio, float) and p.offload_ratio > 0 else 1.0
    ac = t.activation_checkpointing is True
    reasons = [f"world {world} = {r.nodes} nodes x {rpn} ranks; dp {dp} = world / (tp {p.tp} x pp {p.pp})",
               (f"global batch {glob} = micro {micro} x accum {accum} x dp {dp} (ds_config.json; your script may "
                "use them or not)"),
               ("model unknown: your script builds it, and no [model] describes it, so there is no parameter count "
                "and no memory estimate (nothing is known to fit or not to fit); pass --model with a preset or a "
                "config.json of the same shape to have the memory checked"),
               f"ZeRO stage {p.zero} / offload {p.offload}: as requested, not checked against memory"]
    if not r.gpus_per_node:
        reasons.append("CPU ranks: DS_ACCELERATOR=cpu with gloo")
    reasons += fault_reasons(spec)
    memory: dict[str, Any] = {"known": False, "per_rank_gb": None, "per_host_gb": None, "breakdown": {}, "fits": None,
              "device_capacity_gb": (r.gpu_mem_gb or DEFAULT_GPU_GB) if r.gpus_per_node else None,
              "host_capacity_gb": parse_mem_gb(r.mem) or DEFAULT_HOST_GB, "cpu_fraction": None}
    return Plan(world_size=world, nodes=r.nodes, ranks_per_node=rpn, dp=dp, pp=p.pp, tp=p.tp, micro_batch=micro,
                grad_accum=accum, global_batch=glob, zero_stage=int(p.zero), offload=p.offload, param_count=0,
                memory=memory, reasons=reasons, device="gpu" if r.gpus_per_node else "cpu", precision=t.precision,
                model={}, options=[], offload_ratio=ratio, activation_checkpointing=ac, spare_nodes=r.spare_nodes,
                in_job_restarts=spec.fault.in_job_restarts or r.spare_nodes)
