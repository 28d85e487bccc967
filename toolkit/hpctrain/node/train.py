"""The training loop every rank runs: checks, DeepSpeed engine, steps, checkpoints, metrics, export."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.node import checkpoint as ckpt
from hpctrain.node.dist import DistEnv
from hpctrain.node.metrics import MetricsWriter, host_mem_gb, host_peak_gb, log, step_line
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


def main(run_dir: str) -> int:
    """The contract's `hpctrain.node.train.main(run_dir)`: preflight + training, as `main.run(run_dir, "train")`."""
    from hpctrain.node.main import run

    return run(run_dir, "train")


class StopRequested(Exception):
    """Training stopped after a checkpoint because SLURM signalled (time limit near, or preemption)."""


class OtherRankFailed(Exception):
    """Another rank hit an error; this rank stops without a message of its own."""


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


@dataclass
class StopFlag:
    """Set from a signal handler; acted on at the next step boundary, when all ranks agree."""

    signum: int = 0
    previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def chain(self) -> None:
        """Hand the signal to whoever had it before (submitit requeues a preempted job from rank 0)."""
        prev = self.previous.get(self.signum)
        if callable(prev) and self.signum == signal.SIGUSR2:
            prev(self.signum, None)


# -------------------------------------------------------------------------------------------- prepare
def prepare(run_dir: Path, d: DistEnv) -> Prepared:
    """Read and check every input; raises NodeInputError naming the file and the fix."""
    from hpctrain.node.data import build_source
    from hpctrain.node.model import check_model_inputs, hf_config
    from hpctrain.node.tokenize import load_tokenizer

    paths = RunFolder(run_dir)
    spec = read_spec(paths)
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
    micro, gas = int(cfg["train_micro_batch_size_per_gpu"]), int(cfg["gradient_accumulation_steps"])
    if spec.train.precision == "fp16" and not use_gpu:
        _allow_cpu_fp16()
    hf_cfg = hf_config(spec.model)
    tok = load_tokenizer(spec.data.tokenizer)
    source = build_source(spec, tok, micro, int(hf_cfg.vocab_size), force_padded=pp > 1)
    return Prepared(paths, spec, d, use_gpu, cfg, zero, dp, micro, gas, hf_cfg, tok, source, resume, universal,
                    plan.activation_checkpointing)


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

    from hpctrain.node.model import apply_freeze, build_model, param_count
    from hpctrain.spec import presets

    spec = p.spec
    torch.manual_seed(spec.train.seed)  # same init on every rank
    if spec.parallel.pp > 1:
        from hpctrain.node.pipeline import build_pipeline, load_pretrained_into

        model = build_pipeline(p.hf_cfg, spec.parallel.pp, p.checkpointing)
        if spec.model.path:
            load_pretrained_into(model, spec.model.path, p.hf_cfg.num_hidden_layers)
        n_params = presets.llama_param_count(p.hf_cfg.to_dict())
    else:
        model = build_model(spec.model, p.hf_cfg, spec.train.precision, p.ds_config, zero3=p.zero == 3)
        if p.checkpointing:
            # The library's default flavour (transformers renamed the method in 5.2x; both exist there).
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        n_params = param_count(model)
    frozen = apply_freeze(model, spec.model.freeze)
    if frozen:
        log.info("froze %d parameter tensors matching %s", frozen, list(spec.model.freeze))
    params = [q for q in model.parameters() if q.requires_grad]
    sched = None
    if "scheduler" not in p.ds_config:
        fn = lr_lambda(spec)
        sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=p.ds_config,
                                           lr_scheduler=sched)
    return engine, n_params


def comm_device() -> Any:
    """Where collective tensors must live: the GPU for NCCL, the host for gloo."""
    import torch
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def agree(ok: bool) -> bool:
    """All ranks learn whether every rank succeeded (one all_reduce), so none waits in a collective."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0.0 if ok else 1.0], device=comm_device())
    dist.all_reduce(flag)
    return flag.item() == 0


def resume(p: Prepared, engine: Any) -> tuple[int, int, float]:
    """Load the resume point (converting to universal first when the DP size changed).

    Returns (start step, data cursor, tokens seen)."""
    import torch.distributed as dist

    if p.resume is None:
        return 0, 0, 0.0
    tag = p.resume.tag
    error: Exception | None = None
    if p.universal:
        if dist.get_rank() == 0:
            log.info("checkpoint %s has dp=%s, this run dp=%d: converting to a universal checkpoint",
                     tag, p.resume.meta.get("dp"), p.dp)
            try:
                tag = ckpt.convert_universal(p.paths.checkpoints_dir, tag, p.zero)
            except Exception as exc:  # noqa: BLE001 - reported below, after every rank knows
                error = exc
        if not agree(error is None):
            raise error or OtherRankFailed()
        tag = f"universal-{p.resume.tag}"
    try:
        path, client = engine.load_checkpoint(str(p.paths.checkpoints_dir), tag=tag, load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise NodeInputError(f"{p.paths.checkpoints_dir / tag}: DeepSpeed found no checkpoint to load there.")
    except NodeInputError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - any load failure becomes one message, on every rank
        error = NodeInputError(f"{p.paths.checkpoints_dir / tag}: cannot load checkpoint ({type(exc).__name__}: {exc}). "
                               "Fix: delete that folder (and `latest`) to resume from an earlier checkpoint.")
    if not agree(error is None):
        raise error or OtherRankFailed()
    align_optimizer_steps(engine)
    same_world = int(p.resume.meta.get("world_size", -1)) == p.d.world_size
    restored = same_world and ckpt.load_rng(p.resume.path / f"rng-rank-{p.d.rank}.pt")
    step = int(client.get("step", p.resume.step))
    cursor = int(client.get("cursor", 0))
    log.info("resumed from %s at step %d (data cursor %d, rng %s)", tag, step, cursor,
             "restored" if restored else "re-seeded")
    return step, cursor, float(client.get("tokens_seen", 0.0))


def align_optimizer_steps(engine: Any) -> int:
    """Put every `step` of a fused torch AdamW's state on its parameter's device, as float32.

    torch's fused kernel refuses a CPU `step` next to CUDA parameters, and DeepSpeed's universal-checkpoint
    loader writes the optimizer state directly, with `step` as a CPU tensor (seen on H200s: a 4-GPU
    checkpoint resumed on 2 failed in the first optimizer step). Returns how many were moved.
    """
    import torch

    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    groups = getattr(opt, "param_groups", [])
    if not any(g.get("fused") or g.get("capturable") for g in groups):
        return 0
    moved = 0
    # Walk the state, not param_groups: ZeRO-3 puts a sub-group's fp32 partition into its group only
    # for the duration of its optimizer step, so the groups are empty here.
    for param, state in getattr(opt, "state", {}).items():
        step = state.get("step") if isinstance(state, dict) else None
        if torch.is_tensor(param) and torch.is_tensor(step) and \
                (step.device != param.device or step.dtype != torch.float32):
            state["step"] = step.to(device=param.device, dtype=torch.float32)
            moved += 1
    return moved


# -------------------------------------------------------------------------------------------- loop
@dataclass
class LoopState:
    step: int
    cursor0: int
    step0: int
    tokens_seen: float
    last_ckpt_time: float
    last_saved: int = -1
    beat: Any = None  # hpctrain.node.heartbeat.RankBeat
    io: Any = None  # ckpt_async.CheckpointIO: the engine's checkpoint writer


def run_training(p: Prepared, stop: StopFlag) -> tuple[Any, LoopState]:
    """Train to spec.train.steps (or until a signal); returns the engine and the final loop state."""
    from hpctrain.node.heartbeat import RankBeat

    # Per-rank beats for the hang watchdog (hpctrain.fault.watchdog): they name the rank that stops advancing.
    hang_s = float(getattr(p.spec.launch, "hang_timeout_s", 300) or 300)
    beat = RankBeat(p.paths.metrics_dir, p.d.rank, interval_s=min(10.0, max(1.0, hang_s / 5))).start()
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
    import torch
    import torch.distributed as dist

    from hpctrain.node.faultinject import inject
    from hpctrain.node.model import flops_per_token

    engine, n_params = build_engine(p)
    metrics = MetricsWriter(p.paths.metrics_dir, p.d.rank)
    step0, cursor0, tokens_seen = resume(p, engine)
    st = LoopState(step0, cursor0, step0, tokens_seen, time.time(), beat=beat, io=install_writer(p, engine, n_params))
    beat.set(step0, "compute")
    t = p.spec.train
    pipe = p.spec.parallel.pp > 1
    tp = p.spec.parallel.tp
    # AutoTP lays ranks out as (dp, tp): the tp peers of one data-parallel rank are contiguous and must
    # all see the same batch; only the first of them counts its tokens.
    dp_rank = engine.grid.get_data_parallel_rank() if pipe else p.d.rank // tp
    first_stage = engine.is_first_stage() if pipe else p.d.rank % tp == 0
    fpt = flops_per_token(p.hf_cfg, n_params, p.spec.data.seq_len)
    if p.d.rank == 0:
        metrics.event({"event": "start", "step": step0, "world_size": p.d.world_size, "dp": p.dp, "zero": p.zero,
                       "params": n_params, "resumed_from": p.resume.tag if p.resume else None})
    log.info("training %d params, world %d (dp %d pp %d), ZeRO %d, %s, micro %d x gas %d, steps %d -> %d",
             n_params, p.d.world_size, p.dp, p.spec.parallel.pp, p.zero, t.precision, p.micro, p.gas, step0, t.steps)
    while st.step < t.steps:
        t0 = time.time()
        lr = float(engine.get_lr()[0])
        batches = [p.source.batch(st.cursor0 + ((st.step - st.step0) * p.gas + m) * p.dp + dp_rank)
                   for m in range(p.gas)]
        beat.set(st.step + 1, "compute")
        loss_sum = _train_step(engine, batches, pipe)
        inject("step", st.step + 1, st.step0, p.d.rank, log)  # test hook: HPCTRAIN_FAULT_INJECT
        beat.set(st.step + 1, "reduce")
        tokens = sum(b.tokens for b in batches) if first_stage else 0
        slots = sum(b.slots for b in batches) if first_stage else 0
        ckpt_due = p.d.rank == 0 and p.spec.checkpoint.every_minutes > 0 and \
            time.time() - st.last_ckpt_time >= 60 * p.spec.checkpoint.every_minutes
        red = torch.tensor([loss_sum, float(tokens), float(slots), float(stop.signum > 0), float(ckpt_due)],
                           dtype=torch.float64, device=comm_device())
        dist.all_reduce(red)
        vals: list[float] = red.tolist()  # the one device sync of the step
        st.step += 1
        loss = vals[0] / (p.gas * p.d.world_size) if not pipe else loss_sum
        dt = time.time() - t0
        st.tokens_seen += vals[1]
        signalled = vals[3] > 0
        saved = None
        if signalled or vals[4] > 0 or _due(p, st.step) or (st.step == t.steps and _final_wanted(p)):
            saved = save_now(p, engine, st, wait=signalled or st.step == t.steps)
        rec = _record(p, st, loss, lr, vals, dt, fpt, saved.blocking_s if saved else 0.0, engine)
        rec.update(_ckpt_fields(st, saved))
        metrics.step(rec)
        log.info(step_line(rec))
        if signalled:
            metrics.heartbeat(st.step, "stopped-on-signal")
            metrics.event({"event": "stopped-on-signal", "step": st.step, "signal": stop.signum})
            log.info("signal %d: checkpointed at step %d, stopping for requeue", stop.signum, st.step)
            if p.d.rank == 0:
                stop.chain()  # under submitit: requeues the job (scontrol requeue) and exits
            elif os.environ.get("SLURM_JOB_ID"):
                # srun --kill-on-bad-exit would end the step on our non-zero exit, possibly before rank 0
                # has requeued the job; the requeue ends us anyway.
                time.sleep(float(os.environ.get("HPCTRAIN_REQUEUE_GRACE_S", "20")))
            raise StopRequested(f"stopped on signal at step {st.step}")
        _fail_hook(st.step, st.step0, st.io)
    beat.set(st.step, "checkpoint")
    ckpt.drain(st.io)  # a background write still pending (the last save was not the final step's)
    metrics.heartbeat(st.step, "finished")
    beat.stop("done")
    return engine, st


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


def _final_wanted(p: Prepared) -> bool:
    """A checkpoint at the end unless the run asked for none at all (benchmarks: 15-50 GB saved)."""
    c = p.spec.checkpoint
    return c.every_steps > 0 or c.every_minutes > 0 or c.export_hf


def _due(p: Prepared, step: int) -> bool:
    n = p.spec.checkpoint.every_steps
    return n > 0 and step % n == 0


def install_writer(p: Prepared, engine: Any, n_params: int) -> Any:
    """The engine's checkpoint engine becomes hpctrain's writer; async or not per [checkpoint] async_save."""
    from hpctrain.node import ckpt_async

    rank_bytes = ckpt.estimate_state_bytes(n_params, p.dp, p.zero, p.spec.train.precision)
    per_node = max(1, min(p.d.world_size, p.spec.resources.tasks_per_node))
    on, why = ckpt.choose_async(p.spec.checkpoint.async_save, p.use_gpu, rank_bytes, per_node,
                                ckpt.host_available_bytes())
    log.info("checkpoints: %s (%s)", "asynchronous" if on else "synchronous", why)
    return ckpt_async.install(engine, async_mode=on, pin=on and p.use_gpu, rank=p.d.rank, world=p.d.world_size)


def save_now(p: Prepared, engine: Any, st: LoopState, wait: bool = True) -> ckpt.SaveStats | None:
    """Checkpoint at st.step (collective). `wait`: return only once it is complete (final save, signal)."""
    if st.last_saved == st.step:
        if wait:  # e.g. a signal right after an async save: that write must be complete before we stop
            ckpt.drain(st.io)
        return None
    cursor = st.cursor0 + (st.step - st.step0) * p.gas * p.dp
    client = {"step": st.step, "cursor": cursor, "tokens_seen": st.tokens_seen, "dp": p.dp,
              "world_size": p.d.world_size}
    meta = {"world_size": p.d.world_size, "dp": p.dp, "pp": p.spec.parallel.pp, "tp": p.spec.parallel.tp,
            "zero": p.zero, "precision": p.spec.train.precision, "cursor": cursor}
    if st.beat is not None:
        st.beat.set(st.step, "checkpoint")
    from hpctrain.node.faultinject import inject

    # Test hook: HPCTRAIN_FAULT_INJECT="ckpt-crash:step=N" kills every rank with the checkpoint half written.
    midway = lambda: inject("checkpoint", st.step, st.step0, p.d.rank, log)
    stats = ckpt.save(engine, p.paths.checkpoints_dir, st.step, client, meta, p.spec.checkpoint.keep, midway=midway,
                      io=st.io, wait=wait)
    if st.beat is not None:
        st.beat.set(st.step, "reduce")
    st.last_saved, st.last_ckpt_time = st.step, time.time()
    if stats.write_s is None:
        log.info("checkpoint step-%d: state copied in %.2f s, writing in the background", st.step, stats.blocking_s)
    else:
        log.info("checkpoint step-%d written in %.2f s (%s)", st.step, stats.write_s, stats.mode)
    return stats


def _ckpt_fields(st: LoopState, saved: ckpt.SaveStats | None) -> dict[str, Any]:
    """metrics.jsonl: ckpt_blocking_s on the saving step; ckpt_write_s/bytes/gbps on the step where rank 0
    sees the checkpoint complete (the same step for a synchronous save)."""
    out: dict[str, Any] = {}
    if saved is not None:
        out.update(ckpt_blocking_s=saved.blocking_s, ckpt_mode=saved.mode)
        done = saved if saved.write_s is not None else saved.previous
        if done is not None:
            out.update(done.record())
            return out
    job = st.io.finished() if st.io is not None else None
    if job is not None:
        out.update(ckpt.SaveStats(job.step, "async", 0.0, job.write_s, job.total_bytes or None).record())
    return out


def _record(p: Prepared, st: LoopState, loss: float, lr: float, red: list[float], dt: float, fpt: float, ckpt_s: float,
            engine: Any) -> dict[str, Any]:
    import torch

    tokens, slots = red[1], red[2]
    tps = tokens / dt if dt > 0 else 0.0
    tflops = fpt * tps / p.d.world_size / 1e12
    peak = p.spec.train.peak_tflops
    rec: dict[str, Any] = {
        "step": st.step, "loss": loss, "lr": lr, "tokens": int(tokens), "tokens_per_s": tps,
        "tflops": tflops, "mfu": (tflops / peak) if peak > 0 else None,
        "gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if p.use_gpu else 0.0,
        "gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if p.use_gpu else 0.0,
        "host_mem_gb": host_mem_gb(), "host_peak_gb": host_peak_gb(), "padding_frac": (1.0 - tokens / slots) if slots else 0.0,
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
    """Final eval loss (the check an export must reproduce), then the HF export on rank 0."""
    import torch

    metrics = MetricsWriter(p.paths.metrics_dir, p.d.rank)
    cursor = st.cursor0 + (st.step - st.step0) * p.gas * p.dp
    eval_loss = None
    if p.spec.parallel.pp == 1:
        g = cursor + p.d.rank // p.spec.parallel.tp  # the first micro-batch a next step would train on
        engine.eval()
        with torch.no_grad():
            eval_loss = float(engine(**p.source.batch(g).model_inputs(engine.device)).loss.float().item())
        engine.train()
    record = {"event": "finished", "step": st.step, "eval_loss": eval_loss, "eval_batch": cursor,
              "tokens_seen": st.tokens_seen}
    if p.spec.checkpoint.export_hf and p.spec.parallel.tp > 1:
        from hpctrain.node.export import write_hf

        t0 = time.time()
        sd = engine._consolidated_16bit_state_dict()  # collective: gathers the AutoTP shards on rank 0
        if p.d.rank == 0:
            out = write_hf(p.paths, p.spec, p.hf_cfg, dict(sd), f"step-{st.step}", st.step)
            record.update(export=str(out), export_s=time.time() - t0)
            log.info("exported Hugging Face model to %s in %.1f s", out, record["export_s"])
    elif p.d.rank == 0 and p.spec.checkpoint.export_hf and st.last_saved == st.step:
        from hpctrain.node.export import export_hf

        t0 = time.time()
        out = export_hf(p.paths.path, tag=f"step-{st.step}")
        record.update(export=str(out), export_s=time.time() - t0)
        log.info("exported Hugging Face model to %s in %.1f s", out, record["export_s"])
    metrics.event(record)
    log.info("finished at step %d, eval loss %s", st.step, eval_loss)
