"""The training loop every rank runs: checks, DeepSpeed engine, steps, metrics, export; checkpoints and resume
through node/checkpointing/checkpointer.py."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.node import phases
from hpctrain.node.checkpointing import checkpoint as ckpt
from hpctrain.node.checkpointing.checkpointer import Checkpointer, Progress, StopFlag, StopRequested
from hpctrain.node.dist import DistEnv, comm_device
from hpctrain.node.model import attention
from hpctrain.node.monitor.metrics import (
    MetricsWriter,
    attempt_number,
    host_mem_gb,
    host_peak_gb,
    log,
    step_line,
)
from hpctrain.node.runconf import (
    NodeInputError,
    effective_ds_config,
    read_ds_config,
    read_plan,
    read_spec,
    record_effective,
)
from hpctrain.runs.folder import RunFolder
from hpctrain.spec.model import Spec


@dataclass
class Prepared:
    """Everything checked and read before the process group exists (fast, no collective can hang)."""

    paths: RunFolder
    spec: Spec
    d: DistEnv
    use_gpu: bool
    ds_config: dict[str, Any]  # exactly what deepspeed.initialize gets: ds_config.json + the allocation's edits
    zero: int
    dp: int
    micro: int
    gas: int
    hf_cfg: Any
    tokenizer: Any
    source: Any
    resume: ckpt.ResumePoint | None
    universal: bool
    checkpointing: bool = False  # activation checkpointing: the spec's value, or the plan's for "auto"
    eval_source: Any = None  # the prepared folder's validation split when [train] eval_every > 0
    cpu_adam: Any = None  # the thread building DeepSpeedCPUAdam beside the data and model (node/model/zero_offload.py)
    kernels: str = "none"  # the plan's fused kernels: "liger" (node/model/kernels.py) or "none"


# -------------------------------------------------------------------------------------------- prepare
def prepare(run_dir: Path, d: DistEnv) -> Prepared:
    """Read and check every input; raises NodeInputError naming the file and the fix."""
    from hpctrain.node.data.loader import build_eval_source, build_source
    from hpctrain.node.data.tokenize import load_tokenizer
    from hpctrain.node.model.build import check_model_inputs, hf_config
    from hpctrain.node.monitor.tracking import check_available

    paths = RunFolder(run_dir)
    spec = read_spec(paths)
    check_available(spec)
    use_gpu = spec.resources.gpus_per_node > 0 and os.environ.get("DS_ACCELERATOR", "") != "cpu"
    pp, tp = spec.parallel.pp, spec.parallel.tp
    if tp > 1 and pp > 1:
        raise NodeInputError("[parallel] tp > 1 with pp > 1: not supported by the node trainer. Fix: use one of them.")
    if d.world_size % (pp * tp):
        raise NodeInputError(f"[parallel] pp x tp = {pp * tp} does not divide the world size {d.world_size}. Fix: "
                             "choose degrees dividing nodes * tasks_per_node.")
    dp = d.world_size // (pp * tp)
    check_model_inputs(spec.model)
    plan = read_plan(paths)
    rendered = read_ds_config(paths)
    resume = ckpt.find_resume(paths.checkpoints_dir)
    universal = bool(resume) and ckpt.needs_universal(resume.meta, dp, pp, tp)  # type: ignore[union-attr]
    cfg = allocation_ds_config(paths, rendered, d, dp=dp, universal=universal, use_gpu=use_gpu)
    zero = int(cfg["zero_optimization"]["stage"])
    from hpctrain.node.model.zero_offload import prebuild_cpu_adam

    cpu_adam = prebuild_cpu_adam(cfg, use_gpu)  # its JIT compile overlaps the tokenizer, data and model build
    micro, gas = int(cfg["train_micro_batch_size_per_gpu"]), int(cfg["gradient_accumulation_steps"])
    if spec.train.precision == "fp16" and not use_gpu:
        _allow_cpu_fp16()
    hf_cfg = hf_config(spec.model)
    tok = load_tokenizer(spec.data.tokenizer)
    source = build_source(spec, tok, micro, int(hf_cfg.vocab_size), force_padded=pp > 1)
    eval_source = build_eval_source(spec, micro, int(hf_cfg.vocab_size), force_padded=pp > 1)
    source.prefetch(0)  # the epoch plan overlaps the engine build
    return Prepared(paths, spec, d, use_gpu, cfg, zero, dp, micro, gas, hf_cfg, tok, source, resume, universal,
                    plan.activation_checkpointing, eval_source, cpu_adam, plan.kernels)


def allocation_ds_config(paths: RunFolder, rendered: dict[str, Any], d: DistEnv, *, dp: int, universal: bool,
                         use_gpu: bool) -> dict[str, Any]:
    """ds_config.json with this allocation's edits (runconf.effective_ds_config), each logged; rank 0
    writes the result to ds_config.effective.json when there are any, so a user can diff the two."""
    cfg, edits = effective_ds_config(rendered, dp=dp, universal=universal, use_gpu=use_gpu)
    for edit in edits:
        log.info("ds_config: %s", edit)
    if d.rank == 0:
        record_effective(paths, cfg, edits)
        if edits:
            log.info("ds_config: the config DeepSpeed gets is %s", paths.ds_config_effective_json)
    return cfg


def _allow_cpu_fp16() -> None:
    """DeepSpeed refuses fp16 on CPUs without mkldnn fp16 (no AMX-FP16/AVX512-FP16).

    HPCTRAIN_CPU_FP16=1 lets it run anyway (torch computes fp16 on such CPUs, slowly): the tests use it
    to exercise dynamic loss scaling on any CPU.
    """
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.is_fp16_supported():
        return
    if os.environ.get("HPCTRAIN_CPU_FP16") != "1":
        raise NodeInputError("[train] precision = \"fp16\": this CPU has no fp16 support and DeepSpeed refuses it. "
                             "Fix: use precision = \"bf16\" or \"fp32\" on CPU ranks.")
    acc.is_fp16_supported = lambda: True


def lr_lambda(spec: Spec) -> Callable[[int], float]:
    """Linear warmup to lr, then cosine to min_lr at the last step (a multiplier of the base lr)."""
    t = spec.train
    warm, total, floor = t.warmup_steps, max(1, t.steps), (t.min_lr / t.lr if t.lr else 0.0)

    def fn(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        progress = min(1.0, (s - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


# -------------------------------------------------------------------------------------------- engine
def build_engine(p: Prepared) -> tuple[Any, int]:
    """The DeepSpeed engine (pipeline engine when pp > 1) and the full parameter count."""
    import deepspeed
    import torch

    from hpctrain.node.model.build import apply_freeze, build_model, param_count
    from hpctrain.node.model.zero_offload import join_cpu_adam
    from hpctrain.node.monitor.tracking import prepare_env
    from hpctrain.spec import presets

    spec = p.spec
    torch.manual_seed(spec.train.seed)  # same init on every rank
    packed = getattr(p.source, "mode", "") == "pack" and not p.source.synthetic
    attn = attention.resolve(spec.model.attention, attention.capability() if p.use_gpu else None,
                             packed_flex=packed and spec.parallel.pp == 1 and attention.supports_flex(p.hf_cfg))
    kept = attention.apply(attn)
    log.info("attention: %s%s (%s)", attn.hf or "transformers' default", f", SDPA backend {attn.first} first"
             if attn.first and not kept else "", kept or attn.why)
    if spec.parallel.pp > 1:
        from hpctrain.node.model.pipeline import build_pipeline, load_pretrained_into

        model = build_pipeline(p.hf_cfg, spec.parallel.pp, p.checkpointing)
        if spec.model.path:
            load_pretrained_into(model, spec.model.path, p.hf_cfg.num_hidden_layers)
        n_params = presets.llama_param_count(p.hf_cfg.to_dict())
    else:
        if spec.lora.quantize == "4bit":  # QLoRA: NF4 base weights through bitsandbytes
            from hpctrain.node.model.lora import load_quantized

            model = load_quantized(spec.model, p.hf_cfg, spec.train.precision, attn.hf)
        else:
            model = build_model(spec.model, p.hf_cfg, spec.train.precision, p.ds_config, zero3=p.zero == 3,
                                attn=attn.hf, device="cuda" if p.use_gpu else "cpu")
        if p.kernels == "liger":  # before PEFT wraps the model (node/model/kernels.py)
            from hpctrain.node.model import kernels

            kernels.apply(model, kernels.fused_ce_allowed(p.zero, spec.parallel.pp))
        if p.checkpointing:
            # The library's default flavour (transformers renamed the method in 5.2x; both exist there).
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        n_params = param_count(model)
    if spec.lora.r:  # adapters on the frozen model, before DeepSpeed builds its optimizer (node/model/lora.py)
        from hpctrain.node.model.lora import wrap

        model = wrap(model, spec, checkpointing=p.checkpointing)
    frozen = apply_freeze(model, spec.model.freeze)
    if frozen:
        log.info("froze %d parameter tensors matching %s", frozen, list(spec.model.freeze))
    # from_pretrained returns the model in eval mode, and nothing switched it back before an evaluation did: dropout
    # (LoRA's too) was off, and Liger's fused loss (training mode only) computed the whole logits instead (an 8B
    # LoRA run at micro-batch 4 ran out of GPU memory on a 7.8 GiB fp32 logits tensor on the H200, 2026-12-03).
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    sched = None
    if "scheduler" not in p.ds_config:
        fn = lr_lambda(spec)
        sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn)
    waited = join_cpu_adam(p.cpu_adam)
    if p.cpu_adam is not None:
        log.info("CPU Adam prebuild: waited %.1f s for it after the model build", waited)
    prepare_env(p.paths, spec, p.d.rank)  # W&B's run id and folder, read by the wandb.init DeepSpeed calls
    _fast_init(p)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=p.ds_config,
                                           lr_scheduler=sched)
    if p.use_gpu and p.zero == 3 and "offload_optimizer" in p.ds_config["zero_optimization"]:
        from hpctrain.node.model.zero_offload import install

        log.info("ZeRO-3 optimizer offload step fix: %s", install(getattr(engine, "optimizer", None)))
        from hpctrain.node.model.fast_init import TIMES

        if TIMES:
            log.info("fast init: %s", ", ".join(f"{k} {v:.2f}" for k, v in TIMES.items()))
    return engine, n_params


def _fast_init(p: Prepared) -> None:
    """ZeRO-3 offload's engine build without its pinned copies and host round trip (node/model/fast_init.py)."""
    from hpctrain.node.model import fast_init

    why_not = fast_init.wanted(p.ds_config, p.use_gpu)
    if why_not:
        log.debug("fast init: %s", why_not)
        return
    fast_init.install()
    log.info("fast init: ZeRO-3 defragments on the GPU and page-locks its host buffers in place")


# -------------------------------------------------------------------------------------------- loop
@dataclass
class LoopState:
    """Where the loop stands; the data cursor follows from the steps done since the attempt started."""

    step: int
    step0: int  # where this attempt started (0, or the step it resumed from)
    cursor0: int  # the data cursor at step0
    tokens_seen: float
    per_step: int  # micro-batches one optimizer step consumes over all data-parallel ranks (gas x dp)
    last_saved: int = -1  # the step of the attempt's last checkpoint (finish() exports only that one)
    tracker: Any = None  # node.monitor.tracking.Tracker: hpctrain's figures through DeepSpeed's monitor (rank 0)

    @property
    def cursor(self) -> int:
        return self.cursor0 + (self.step - self.step0) * self.per_step

    def progress(self) -> Progress:
        return Progress(self.step, self.cursor, self.tokens_seen)


@dataclass(frozen=True)
class RankRole:
    """Which micro-batches this rank reads and whether it counts their tokens."""

    pipe: bool
    dp_rank: int
    first_stage: bool


@dataclass(frozen=True)
class StepOut:
    """One optimizer step, after its all_reduce: mean loss, tokens and padded slots over all ranks."""

    loss: float
    tokens: float
    slots: float
    votes: list[float]  # the checkpointer's, summed over ranks
    trained: float = 0.0  # tokens the loss covered (label != -100): the responses of SFT data


def run_training(p: Prepared, stop: StopFlag) -> tuple[Any, LoopState]:
    """Train to spec.train.steps (or until `stop`, installed by the entry before the engine build, says a
    signal came); returns the engine and the final loop state."""
    from hpctrain.node.monitor.heartbeat import RankBeat

    # Per-rank beats for the hang watchdog (hpctrain.fault.supervisor): they name the rank that stops advancing.
    hang_s = float(getattr(p.spec.launch, "hang_timeout_s", 300) or 300)
    from hpctrain.node.monitor.gpustats import GpuStats

    gpu = GpuStats(p.d.local_rank) if p.use_gpu else None  # utilization, memory, temperature in the beats
    beat = RankBeat(p.paths.metrics_dir, p.d.rank, interval_s=min(10.0, max(1.0, hang_s / 5)), gpu=gpu).start()
    try:
        return _train(p, stop, beat)
    except StopRequested:
        raise
    except Exception as exc:
        # Said at once, not at the next beat: a collective that failed on a closed peer connection lets the
        # watchdog end the job in seconds instead of srun waiting for SLURM's NODE_FAIL (hpctrain.fault.watchdog).
        beat.fail(exc)
        raise


def _train(p: Prepared, stop: StopFlag, beat: Any) -> tuple[Any, LoopState]:
    """Engine, resume, then the loop: step, metrics, checkpoint when due, stop on the signal."""
    from hpctrain.node.model.build import flops_per_token
    from hpctrain.node.monitor.tracking import Tracker

    engine, n_params = build_engine(p)
    phases.mark("engine")  # deepspeed's import, the model, deepspeed.initialize
    checkpointer = Checkpointer.for_run(engine, p.spec, p.paths.checkpoints_dir, stop, rank=p.d.rank,
                                        world=p.d.world_size, dp=p.dp, zero=p.zero, use_gpu=p.use_gpu,
                                        n_params=n_params, beat=beat)
    start = checkpointer.load(p.resume, p.universal)
    phases.mark("load")
    st = LoopState(start.step, start.step, start.cursor, start.tokens_seen, per_step=p.gas * p.dp)
    st.tracker = tracker = Tracker.for_engine(engine, p.paths, p.spec, p.d.rank)
    tracker.log_config(p.paths)
    tracker.resumed_at(st.step)
    attempt = attempt_number()
    metrics = MetricsWriter(p.paths.metrics_dir, p.d.rank)
    role = _role(p, engine)
    fpt = flops_per_token(p.hf_cfg, n_params, p.spec.data.seq_len)
    beat.set(st.step, "compute")
    _announce(p, metrics, n_params, st.step)
    while st.step < p.spec.train.steps:
        t0 = time.time()
        lr = float(engine.get_lr()[0])
        out = _step(p, engine, st, role, checkpointer, beat)
        dt = time.time() - t0
        saved = checkpointer.maybe_save(st.progress(), out.votes)
        rec = _record(p, st, out, lr, dt, fpt, saved.blocking_s if saved else 0.0, engine)
        rec.update(checkpointer.metrics_fields(saved))
        if _eval_due(p, st.step):
            rec.update(evaluate(p, engine, role))
        metrics.step(rec)
        tracker.step(rec, attempt)
        log.info(step_line(rec))
        if checkpointer.should_stop:
            raise checkpointer.requeue(st.step, metrics)
        _fail_hook(st.step, st.step0, checkpointer.io)
    checkpointer.close(st.step)
    st.last_saved = checkpointer.last_saved
    metrics.heartbeat(st.step, "finished")
    beat.stop("done")
    return engine, st


def _eval_due(p: Prepared, step: int) -> bool:
    every = p.spec.train.eval_every
    return p.eval_source is not None and every > 0 and (step % every == 0 or step == p.spec.train.steps)


def evaluate(p: Prepared, engine: Any, role: RankRole) -> dict[str, Any]:
    """Mean loss over the first eval batches of the validation split (the same ones at every evaluation),
    shared by the data-parallel ranks and weighted by predicted tokens; perplexity = exp(loss).

    Every rank runs the same number of forwards (ZeRO-3 gathers parameters in each, so a rank with fewer
    would hang its peers); a rank whose last batch lies past the eval set runs it with weight 0.
    """
    import torch
    import torch.distributed as tdist

    from hpctrain.node.data.loader import IGNORE

    src, t0 = p.eval_source, time.time()
    n = src.batches_per_epoch()
    want = p.spec.train.eval_tokens
    total = n if want <= 0 else min(n, max(1, math.ceil(want / (p.micro * p.spec.data.seq_len))))
    per_rank = math.ceil(total / p.dp)
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    engine.eval()
    with torch.no_grad():
        for k in range(per_rank):
            g = k * p.dp + role.dp_rank
            b = src.batch(g % n)
            loss = engine(**b.model_inputs(engine.device)).loss.detach().float().cpu().double()
            if g < total and role.first_stage:
                predicted = int((b.labels[:, 1:] != IGNORE).sum())
                loss_sum += loss * predicted
                count += predicted
    engine.train()
    red = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64, device=comm_device())
    tdist.all_reduce(red)
    s, c = red.tolist()
    mean = s / c if c else None
    ppl = math.exp(mean) if mean is not None and mean < 700 else None  # JSON has no inf
    return {"eval_loss": mean, "eval_ppl": ppl, "eval_tokens": int(c), "eval_s": time.time() - t0}


def _role(p: Prepared, engine: Any) -> RankRole:
    # AutoTP lays ranks out as (dp, tp): the tp peers of one data-parallel rank are contiguous and must
    # all see the same batch; only the first of them counts its tokens.
    pipe, tp = p.spec.parallel.pp > 1, p.spec.parallel.tp
    if pipe:
        return RankRole(True, engine.grid.get_data_parallel_rank(), engine.is_first_stage())
    return RankRole(False, p.d.rank // tp, p.d.rank % tp == 0)


def _announce(p: Prepared, metrics: MetricsWriter, n_params: int, step0: int) -> None:
    t = p.spec.train
    if p.d.rank == 0:
        metrics.event({"event": "start", "step": step0, "world_size": p.d.world_size, "dp": p.dp, "zero": p.zero,
                       "params": n_params, "resumed_from": p.resume.tag if p.resume else None,
                       "startup": phases.report()})
        _report_data(p, metrics)
    # n_params is the model's (what FLOPs count); with LoRA only the adapters train (the "LoRA r=..." line above)
    log.info("%s %d params, world %d (dp %d pp %d), ZeRO %d, %s, micro %d x gas %d, steps %d -> %d",
             "training LoRA adapters on a frozen base of" if p.spec.lora.r else "training", n_params, p.d.world_size,
             p.dp, p.spec.parallel.pp, p.zero, t.precision, p.micro, p.gas, step0, t.steps)
    if p.d.rank == 0 and not getattr(p.source, "synthetic", True):
        line = epochs_line(p.source.batches_per_epoch(), p.dp * p.gas, t.steps)
        if line:
            log.info("%s", line)


def epochs_line(micro_batches: int, per_step: int, steps: int) -> str:
    """How many passes over the data the run's steps make (hpctrain counts steps, a fine-tune is usually planned
    in epochs: a few for SFT, and a small dataset under many steps is seen dozens of times)."""
    if micro_batches <= 0 or per_step <= 0:
        return ""
    per_epoch = micro_batches / per_step
    return (f"data: one epoch is {micro_batches:,} micro-batches = {per_epoch:,.1f} optimizer steps of {per_step} "
            f"micro-batches; the run's {steps:,} steps are {steps / per_epoch:,.2f} epochs")


def _report_data(p: Prepared, metrics: MetricsWriter) -> None:
    """Rank 0: the SFT records' tally (read, trained on, bad by reason) into its log and a `data` event, which
    `hpctrain summary` shows; every rank read the same file, so one report stands for all."""
    report = getattr(p.source, "report", None)
    if not report:
        return
    from hpctrain.data.sft import Tally

    for line in Tally.from_json(report).table(p.spec.data.seq_len):
        log.info("data: %s", line)
    metrics.event({"event": "data", "format": p.spec.data.format, "source": p.spec.data.source, **report})


def _step(p: Prepared, engine: Any, st: LoopState, role: RankRole, checkpointer: Checkpointer,
          beat: Any) -> StepOut:
    """One optimizer step and the step's one all_reduce (loss, tokens, slots, the checkpointer's votes,
    read after the compute so that a signal during it counts at this boundary). Advances `st`."""
    import torch
    import torch.distributed as tdist

    from hpctrain.node.faultinject import inject

    batches = [p.source.batch(st.cursor + m * p.dp + role.dp_rank) for m in range(p.gas)]
    beat.set(st.step + 1, "compute")
    loss_sum = _train_step(engine, batches, role.pipe)
    inject("step", st.step + 1, st.step0, p.d.rank, log)  # test hook: HPCTRAIN_FAULT_INJECT
    beat.set(st.step + 1, "reduce")
    tokens = sum(b.tokens for b in batches) if role.first_stage else 0
    slots = sum(b.slots for b in batches) if role.first_stage else 0
    trained = sum(b.trained for b in batches) if role.first_stage else 0
    red = torch.tensor([loss_sum, float(tokens), float(slots), float(trained), *checkpointer.votes()],
                       dtype=torch.float64, device=comm_device())
    tdist.all_reduce(red)
    vals: list[float] = red.tolist()  # the one device sync of the step
    st.step += 1
    st.tokens_seen += vals[1]
    loss = vals[0] / (p.gas * p.d.world_size) if not role.pipe else loss_sum
    return StepOut(loss, vals[1], vals[2], vals[4:], trained=vals[3])


def _train_step(engine: Any, batches: list[Any], pipe: bool) -> float:
    """One optimizer step over the micro-batches; returns the summed micro-batch loss (this rank)."""
    if pipe:
        it = iter([(b.input_ids, b.labels) for b in batches])
        return float(engine.train_batch(data_iter=it).item())
    total = None
    for b in batches:
        # Keep only the loss: holding the model output would keep the bf16 logits (micro x seq x vocab,
        # 4 GB for Llama-3 at micro 4, seq 4096) alive through backward, on top of the loss's fp32 buffers.
        out_loss = engine(**b.model_inputs(engine.device)).loss
        engine.backward(out_loss)
        engine.step()
        loss = out_loss.detach().float()
        total = loss if total is None else total + loss
    return float(total.item()) if total is not None else 0.0  # the step's only host sync


def _record(p: Prepared, st: LoopState, out: StepOut, lr: float, dt: float, fpt: float, ckpt_s: float,
            engine: Any) -> dict[str, Any]:
    """The step's metrics.jsonl line (the checkpoint's fields are added by the checkpointer)."""
    import torch

    loss, tokens, slots = out.loss, out.tokens, out.slots
    tps = tokens / dt if dt > 0 else 0.0
    tflops = fpt * tps / p.d.world_size / 1e12
    peak = p.spec.train.peak_tflops
    rec: dict[str, Any] = {
        "step": st.step, "loss": loss, "lr": lr, "tokens": int(tokens), "tokens_per_s": tps,
        "trained_tokens": int(out.trained), "trained_tokens_per_s": out.trained / dt if dt > 0 else 0.0,
        "tflops": tflops, "mfu": (tflops / peak) if peak > 0 else None,
        "gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if p.use_gpu else 0.0,
        "gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if p.use_gpu else 0.0,
        "host_mem_gb": host_mem_gb(), "host_peak_gb": host_peak_gb(),
        "padding_frac": (1.0 - tokens / slots) if slots else 0.0,
        "ckpt_s": ckpt_s, "time": time.time(),
    }
    if p.spec.train.precision == "fp16":
        opt = engine.optimizer
        rec["loss_scale"] = float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 0.0)))
    return rec


def _fail_hook(step: int, step0: int, io: Any = None) -> None:
    """Test/demo hook: HPCTRAIN_FAIL_AT_STEP=N kills every rank right after step N (a crash, no cleanup),
    in an attempt that started before N only, so the resumed attempt runs through.
    HPCTRAIN_FAIL_AFTER_WRITES=1 lets this rank's pending background checkpoint write finish first, so a
    test knows which checkpoint the resume must use (otherwise that depends on the writer's pace)."""
    at = os.environ.get("HPCTRAIN_FAIL_AT_STEP")
    if at and int(at) == step and step0 < step:
        if os.environ.get("HPCTRAIN_FAIL_AFTER_WRITES") == "1" and io is not None:
            io.wait()
        log.info("HPCTRAIN_FAIL_AT_STEP=%s: exiting hard", at)
        for h in log.handlers:
            h.flush()
        os._exit(17)


# -------------------------------------------------------------------------------------------- finish
def finish(p: Prepared, engine: Any, st: LoopState) -> None:
    """The loss on the micro-batch a next step would train on (`next_batch_loss`: the check an export must
    reproduce; not a validation loss, which is `eval_loss` on the metrics lines), then the HF export on rank 0."""
    import torch

    metrics = MetricsWriter(p.paths.metrics_dir, p.d.rank)
    cursor = st.cursor
    next_loss = None
    if p.spec.parallel.pp == 1:
        g = cursor + p.d.rank // p.spec.parallel.tp  # the first micro-batch a next step would train on
        engine.eval()
        with torch.no_grad():
            next_loss = float(engine(**p.source.batch(g).model_inputs(engine.device)).loss.float().item())
        engine.train()
    record = {"event": "finished", "step": st.step, "next_batch_loss": next_loss, "next_batch": cursor,
              "tokens_seen": st.tokens_seen}
    if p.spec.checkpoint.export_hf and p.spec.parallel.tp > 1:
        from hpctrain.node.checkpointing.export import write_hf

        t0 = time.time()
        sd = engine._consolidated_16bit_state_dict()  # collective: gathers the AutoTP shards on rank 0
        if p.d.rank == 0:
            out = write_hf(p.paths, p.spec, p.hf_cfg, dict(sd), f"step-{st.step}", st.step)
            record.update(export=str(out), export_s=time.time() - t0)
            log.info("exported Hugging Face model to %s in %.1f s", out, record["export_s"])
    elif p.d.rank == 0 and p.spec.checkpoint.export_hf and st.last_saved == st.step:
        from hpctrain.node.checkpointing.export import export_hf

        t0 = time.time()
        out = export_hf(p.paths.path, tag=f"step-{st.step}")
        record.update(export=str(out), export_s=time.time() - t0)
        log.info("exported Hugging Face model to %s in %.1f s", out, record["export_s"])
    metrics.event(record)
    if st.tracker is not None:
        st.tracker.close()
    log.info("finished at step %d, loss on the next batch %s", st.step, next_loss)
