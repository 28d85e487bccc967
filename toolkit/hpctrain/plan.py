"""Derived facts of a run, computed once from the spec: parallel degrees, batch arithmetic,
parameter count, a memory estimate per rank and per host, and the ZeRO/offload choice.

Pure arithmetic (no torch): it runs on a login node in milliseconds. The memory model is the usual
mixed-precision accounting (weights 2 B/param, grads 2 B, fp32 master + Adam m + v = 12 B), split
by ZeRO stage over the data-parallel ranks, plus activations (Korthikanti et al. 2022, with a fused
attention kernel, so no seq^2 term) and a fixed runtime overhead. It is an estimate, good to
about 20%; its purpose is to refuse hopeless plans and to pick the cheapest ZeRO setting that fits.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.errors import HpcUsageError, bad_value
from hpctrain.presets import PRESETS
from hpctrain.spec import Model, Spec
from hpctrain.spec_rules import how_to_set

GiB = 1024**3
DEFAULT_GPU_GB = 80.0  # A100/H100 80GB: the common training GPU when the site does not say
DEFAULT_HOST_GB = 256.0  # assumed when --mem is not given
FIT_FRACTION = 0.9  # leave 10% for fragmentation and the allocator
GPU_RUNTIME_GB = 1.5  # CUDA context, NCCL buffers, kernels
HOST_RANK_GB = 2.5  # one python + torch + deepspeed process on the host
CPU_RANK_GB = 1.5  # the same on a CPU-only rank (no CUDA libraries)
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
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise bad_value(key, getattr(model, key.split(".")[1]), f"cannot read {path} ({exc})",
                            f"point it at a readable config.json (presets: {', '.join(PRESETS)})") from None
    cfg.update(model.overrides)
    return cfg


def model_arch(cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalise Llama/Mistral/Qwen2-style and GPT-2-style config keys to one shape."""
    def get(*names: str, default: Any = None) -> Any:
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        if default is None:
            raise HpcUsageError(f"model config: none of {names} found (model_type "
                                f"{cfg.get('model_type')!r}). Fix: use a Llama, Mistral or GPT-2 style config.json")
        return default

    kind = str(cfg.get("model_type", "llama"))
    hidden = int(get("hidden_size", "n_embd", "d_model"))
    heads = int(get("num_attention_heads", "n_head"))
    gpt2 = kind == "gpt2" or "n_embd" in cfg
    return {
        "model_type": kind,
        "style": "gpt2" if gpt2 else "llama",
        "hidden": hidden,
        "layers": int(get("num_hidden_layers", "n_layer")),
        "heads": heads,
        "kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "intermediate": int(get("intermediate_size", "n_inner", default=0) or 4 * hidden),
        "vocab": int(get("vocab_size")),
        "positions": int(get("max_position_embeddings", "n_positions", default=0)),
        "tied": bool(cfg.get("tie_word_embeddings", gpt2)),
        "attention_bias": bool(cfg.get("attention_bias", kind == "qwen2")),
    }


def layer_params(a: dict[str, Any]) -> int:
    """Parameters of one transformer block."""
    h, i, hd = int(a["hidden"]), int(a["intermediate"]), int(a["head_dim"])
    heads, kvh = int(a["heads"]), int(a["kv_heads"])
    if a["style"] == "gpt2":  # c_attn (3h) + c_proj + 2-layer MLP, all with biases, 2 LayerNorms (w+b)
        return (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
    q = h * heads * hd
    kv = 2 * h * kvh * hd
    o = heads * hd * h
    bias = (heads + 2 * kvh) * hd if a["attention_bias"] else 0
    return q + kv + o + bias + 3 * h * i + 2 * h  # SwiGLU MLP (gate, up, down) + 2 RMSNorms


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
# Memory

@dataclass(frozen=True)
class Estimate:
    """Memory of one ZeRO/offload choice, in GiB: per rank on its device, and per host."""

    zero: int
    offload: str
    device_gb: float
    host_gb: float
    fits: bool
    breakdown: dict[str, float] = field(default_factory=dict)


def _parse_mem_gb(mem: str) -> float | None:
    m = re.match(r"^(\d+)([KMGT]?)$", mem)
    if not m:
        return None
    scale = {"K": 1 / 1024**2, "M": 1 / 1024, "": 1 / 1024, "G": 1.0, "T": 1024.0}[m.group(2)]
    return int(m.group(1)) * scale  # SLURM's unit-less --mem is megabytes


def estimate(spec: Spec, a: dict[str, Any], params: int, dp: int, micro: int, zero: int, offload: str) -> Estimate:
    """Memory for one choice. Offloaded state moves from the device to the host's RAM."""
    p, r = spec.parallel, spec.resources
    gpu = r.gpus_per_node > 0
    wb = 4 if spec.train.precision == "fp32" else 2
    shard = params / (p.tp * p.pp)
    weights, grads = shard * wb, shard * wb
    optim = shard * (8 if wb == 4 else 12)  # fp32 master copy only exists in mixed precision
    if zero >= 1:
        optim /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    host_state = 0.0
    if offload in ("optimizer", "all"):
        host_state += optim + shard * 4 / dp  # fp32 gradient partition lives next to the optimizer
        optim = 0.0
    if offload in ("param", "all"):
        host_state += weights
        weights = 0.0
    h, s, layers = a["hidden"], spec.data.seq_len, a["layers"] // p.pp
    unit = s * micro * h * wb / 2  # Korthikanti's 34*s*b*h bytes per layer assume 16-bit
    if spec.train.activation_checkpointing:
        acts = layers * 2 * unit + 34 * unit / p.tp
    else:
        acts = layers * 34 * unit / p.tp
    acts += micro * s * a["vocab"] * (wb + 4 + wb)  # logits, their fp32 upcast for the loss, and its grad
    live = 2 * layer_params(a) / p.tp * wb if zero == 3 else 0.0  # gathered layers in flight (prefetch)
    buckets = 2 * min(h * h, shard) * wb if zero >= 1 else 0.0  # reduce (+ allgather) buckets
    runtime = (GPU_RUNTIME_GB if gpu else CPU_RANK_GB) * GiB
    device = weights + grads + optim + acts + live + buckets + runtime
    breakdown = {k: round(v / GiB, 3) for k, v in (("weights", weights), ("grads", grads), ("optimizer", optim),
                 ("activations", acts), ("zero_buffers", live + buckets), ("runtime", runtime),
                 ("offloaded_to_host", host_state))}
    rpn = ranks_per_node(spec)
    if gpu:
        host = rpn * (HOST_RANK_GB * GiB + host_state)
        device_cap = (r.gpu_mem_gb or DEFAULT_GPU_GB) * GiB
    else:  # CPU ranks: the "device" is host RAM, so offload moves nothing
        device += host_state
        host = rpn * device
        device_cap = float("inf")
    host_cap = (_parse_mem_gb(r.mem) or DEFAULT_HOST_GB) * GiB
    fits = device <= FIT_FRACTION * device_cap and host <= FIT_FRACTION * host_cap
    return Estimate(zero, offload, round(device / GiB, 3), round(host / GiB, 3), fits, breakdown)


def candidates(spec: Spec) -> list[tuple[int, str]]:
    """Choices in order of speed: no offload by rising stage, then optimizer offload, then all.

    Explicit offload restricts the list to it; pipeline parallelism allows ZeRO 0-1 only; on CPU
    ranks offload moves nothing, so it is never chosen automatically.
    """
    p, gpu = spec.parallel, spec.resources.gpus_per_node > 0
    order = [(0, "none"), (1, "none"), (2, "none"), (3, "none")]
    if gpu:
        order += [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "all")] if p.pp > 1 else \
            [(2, "optimizer"), (3, "optimizer"), (3, "all")]
    if p.offload != "none":
        order = [(z, p.offload) for z in (1, 2, 3) if p.offload == "optimizer" or z == 3]
    if p.pp > 1:
        order = [(z, o) for z, o in order if z <= 1]
    return order


# --------------------------------------------------------------------------------------------------
# The plan

@dataclass(frozen=True)
class Plan:
    """Everything derived from a spec; rendered into plan.json and used by render and dispatch."""

    world_size: int
    nodes: int
    ranks_per_node: int
    dp: int
    pp: int
    tp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    zero_stage: int
    offload: str
    param_count: int
    memory: dict[str, Any]
    reasons: list[str]
    device: str = "gpu"  # "gpu" or "cpu" (DS_ACCELERATOR=cpu, gloo)
    precision: str = "bf16"
    model: dict[str, Any] = field(default_factory=dict)
    options: list[dict[str, Any]] = field(default_factory=list)  # every ZeRO/offload choice estimated

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys) for plan.json and `hpctrain plan --json`."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def _degrees(spec: Spec) -> tuple[int, int, int]:
    p, r = spec.parallel, spec.resources
    rpn = ranks_per_node(spec)
    world = r.nodes * rpn
    if world % (p.tp * p.pp):
        valid = [d for d in range(1, world + 1) if world % d == 0]
        raise bad_value("parallel.tp*pp", p.tp * p.pp,
                        f"world size {world} ({r.nodes} nodes x {rpn} ranks) is not divisible by tp {p.tp} x pp {p.pp}",
                        f"choose tp*pp among {valid}, or change --nodes/--gpus-per-node so the world size is a "
                        f"multiple of {p.tp * p.pp}")
    if p.tp > rpn and p.tp > 1:
        raise bad_value("parallel.tp", p.tp, f"tensor parallelism must stay inside a node ({rpn} ranks per node)",
                        how_to_set("parallel.tp", rpn))
    return rpn, world, world // (p.tp * p.pp)


def _choose(spec: Spec, options: list[Estimate], reasons: list[str]) -> Estimate:
    p = spec.parallel
    if p.zero != "auto":
        offload = p.offload
        chosen = next((e for e in options if e.zero == p.zero and e.offload == offload), None)
        if chosen is None:
            raise bad_value("parallel.zero", p.zero, f"cannot combine with offload {offload!r}", "pass --zero auto")
        reasons.append(f"ZeRO {p.zero} with offload {offload!r}: as requested")
        if not chosen.fits:
            reasons.append(f"WARNING: estimated {chosen.device_gb:.1f} GiB per rank / {chosen.host_gb:.1f} GiB "
                           "per host exceeds 90% of capacity; try --zero auto")
        return chosen
    for e in options:
        if e.fits:
            faster = [f"{o.zero}/{o.offload}" for o in options[: options.index(e)]]
            why = f" (faster choices do not fit: {', '.join(faster)})" if faster else " (the fastest choice)"
            reasons.append(f"zero auto -> ZeRO {e.zero}, offload {e.offload!r}: fits in "
                           f"{e.device_gb:.1f} GiB per rank, {e.host_gb:.1f} GiB per host{why}")
            return e
    best = min(options, key=lambda e: e.device_gb)
    raise bad_value("parallel.zero", "auto",
                    f"no ZeRO/offload choice fits: the smallest needs {best.device_gb:.1f} GiB per rank and "
                    f"{best.host_gb:.1f} GiB per host",
                    "add nodes (--nodes), turn on --activation-checkpointing, lower --micro-batch, "
                    "offload everything (--offload all), or offload to NVMe (--offload all --offload-device nvme "
                    "--nvme-path DIR)")


def make_plan(spec: Spec) -> Plan:
    """Derive the plan; refuse (HpcUsageError) what cannot run, saying which value fixes it."""
    rpn, world, dp = _degrees(spec)
    micro, accum, glob = batch_sizes(spec, dp)
    arch = model_arch(load_model_config(spec.model))
    params = param_count(arch)
    reasons = [(f"world {world} = {spec.resources.nodes} nodes x {rpn} ranks; dp {dp} = world / "
                f"(tp {spec.parallel.tp} x pp {spec.parallel.pp})"),
               f"global batch {glob} = micro {micro} x accum {accum} x dp {dp}"]
    r = spec.resources
    if r.gpus_per_node and not r.gpu_mem_gb:
        reasons.append(f"GPU memory assumed {DEFAULT_GPU_GB:g} GiB: set gpu_mem_gb in the site profile")
    if not r.mem:
        reasons.append(f"host memory assumed {DEFAULT_HOST_GB:g} GiB: pass --mem to check against the real size")
    if not r.gpus_per_node:
        reasons.append("CPU ranks: DS_ACCELERATOR=cpu with gloo; the 'device' is host RAM")
    stages = sorted({z for z, _ in candidates(spec)} | ({spec.parallel.zero} if spec.parallel.zero != "auto" else set()))
    offloads = {spec.parallel.offload} | {o for _, o in candidates(spec)}
    all_opts = [estimate(spec, arch, params, dp, micro, z, o) for o in OFFLOADS_IN_ORDER if o in offloads
                for z in stages if o == "none" or (o == "optimizer" and z >= 1) or z == 3]
    order = candidates(spec) if spec.parallel.zero == "auto" else [(spec.parallel.zero, spec.parallel.offload)]
    ranked = [e for key in order for e in all_opts if (e.zero, e.offload) == key]
    chosen = _choose(spec, ranked, reasons)
    memory = {"per_rank_gb": chosen.device_gb, "per_host_gb": chosen.host_gb, "breakdown": chosen.breakdown,
              "device_capacity_gb": (r.gpu_mem_gb or DEFAULT_GPU_GB) if r.gpus_per_node else None,
              "host_capacity_gb": _parse_mem_gb(r.mem) or DEFAULT_HOST_GB, "fits": chosen.fits}
    return Plan(world_size=world, nodes=r.nodes, ranks_per_node=rpn, dp=dp, pp=spec.parallel.pp,
                tp=spec.parallel.tp, micro_batch=micro, grad_accum=accum, global_batch=glob,
                zero_stage=chosen.zero, offload=chosen.offload, param_count=params, memory=memory,
                reasons=reasons, device="gpu" if r.gpus_per_node else "cpu", precision=spec.train.precision,
                model=arch, options=[asdict(e) for e in all_opts])


def read_plan(run_dir: str | Path) -> dict[str, Any]:
    """RUN_DIR/plan.json as a dict (the node reads zero_stage and batch sizes from it)."""
    return dict(json.loads((Path(run_dir) / "plan.json").read_text(encoding="utf-8")))
