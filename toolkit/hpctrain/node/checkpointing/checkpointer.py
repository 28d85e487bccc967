"""When the trainer checkpoints, how it saves, and how it resumes: the `Checkpointer` the loop talks to.

The loop asks two things at each step boundary, `maybe_save(progress, votes)` and `should_stop`. Behind them:
- a save every `[checkpoint] every_steps` steps, every `every_minutes` minutes, on SLURM's signal (USR2
  before the time limit, TERM on a preemption) and at the last step (unless the run asked for no
  checkpoints at all), never twice at one step;
- the decision is the same on every rank without a collective of its own: each rank's votes (signal seen;
  minutes elapsed, on rank 0's clock only) ride on the step's one all_reduce (`votes()`);
- the writer is asynchronous or not per `[checkpoint] async_save` (node/checkpointing/ckpt_async.py); a save on the
  signal or at the last step returns once the checkpoint is complete, and `close()` drains a background
  write still pending at the end;
- old checkpoints are pruned to `keep` as each new one completes (checkpoint.prune);
- `load()` resumes from the point `checkpoint.find_resume` chose before the engine existed (the
  universal flag must be in the DeepSpeed config), through a universal checkpoint when the DP size changed.
The files, their crash safety and the "complete checkpoint" rule live in node/checkpointing/checkpoint.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.node.checkpointing import checkpoint as ckpt
from hpctrain.node.dist import OtherRankFailed, agree
from hpctrain.node.monitor.metrics import MetricsWriter, log
from hpctrain.node.runconf import NodeInputError
from hpctrain.spec.model import Spec

# Where a rank in a container asks for the requeue (containers/scontrol-shim.sh; templates/sbatch.sh.j2 does it).
REQUEUE_REQUEST = "requeue-request"


def _env_time(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def _my_job_ids() -> set[str]:
    """This job as the registry may name it: SLURM's id, an array task's "A_i", the local executor's pid."""
    env = os.environ
    ids = {env.get("SLURM_JOB_ID", ""), env.get("SUBMITIT_LOCAL_JOB_ID", "")}
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        ids.add(f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}")
    return ids - {""}


def wait_for_requeue(poll_s: float = 0.2) -> None:
    """A rank other than 0, stopped on the signal under SLURM: wait (at most HPCTRAIN_REQUEUE_GRACE_S, 20 s)
    until rank 0 has handed the job back. srun --kill-on-bad-exit would end the step on our non-zero exit,
    possibly before rank 0 requeued the job. Rank 0's `scontrol requeue` ends us anyway; in a container it is
    a request in the run folder instead (containers/scontrol-shim.sh), carried out by the batch script once
    the step has ended, so we leave as soon as this attempt's request is there: waiting out the grace kept
    the step, and the requeue, 20 s longer (tests/test_container_slurm's USR2 run)."""
    if not os.environ.get("SLURM_JOB_ID"):
        return
    run_dir = os.environ.get("HPCTRAIN_RUN_DIR")
    request = Path(run_dir) / REQUEUE_REQUEST if run_dir else None
    deadline = time.monotonic() + float(os.environ.get("HPCTRAIN_REQUEUE_GRACE_S", "20"))
    while time.monotonic() < deadline:
        try:
            if request is not None and request.stat().st_mtime >= _PROCESS_START:  # not an older attempt's
                return
        except OSError:
            pass
        time.sleep(poll_s)


class StopRequested(Exception):
    """Training stopped after a checkpoint because SLURM signalled (time limit near, or preemption).
    `checkpointed`: a checkpoint was saved on the signal (a user's script may stop without one)."""

    def __init__(self, message: str, checkpointed: bool = True) -> None:
        super().__init__(message)
        self.checkpointed = checkpointed


# When this rank's process started: the job's start where SLURM does not say (SLURM_JOB_START_TIME).
_PROCESS_START = time.time()


@dataclass
class StopFlag:
    """Set from a signal handler; acted on at the next step boundary, when all ranks agree.

    `run_dir`, `limit_s` and `window_s` (the time limit and --signal's lead, from the spec) let `why()`
    tell the pre-timeout signal from a preemption, and both from `hpctrain cancel`."""

    signum: int = 0
    previous: dict[int, Any] = field(default_factory=dict)
    run_dir: Path | None = None
    limit_s: float | None = None
    window_s: float = 0.0
    _live_end: tuple[float | None] | None = field(default=None, repr=False)  # job_end_time's answer, once

    def seconds_left(self, now: float | None = None) -> float | None:
        """Of the time limit: SLURM's projected end when it exports one, else the limit from the job's start
        (SLURM_JOB_START_TIME, else this process's start: a requeued or restarted job starts its clock again)."""
        now = time.time() if now is None else now
        end = _env_time("SLURM_JOB_END_TIME")
        if end is not None:
            return end - now
        if self.limit_s is None:
            return None
        return (_env_time("SLURM_JOB_START_TIME") or _PROCESS_START) + self.limit_s - now

    def live_end(self) -> float | None:
        """The job's end as slurmctld holds it now, asked once per process (None outside SLURM, or when
        squeue cannot say). The environment's end is the one of the job's start: `scontrol update
        TimeLimit=` (an extension an admin granted, a limit cut) moves the real pre-timeout signal away
        from it, and the signal would read as a preemption."""
        if self._live_end is None:
            job = os.environ.get("SLURM_JOB_ID", "")
            end: float | None = None
            if job:
                from hpctrain.slurmcommands import job_end_time

                end = job_end_time(job)
            self._live_end = (end,)
        return self._live_end[0]

    def cancelled(self) -> bool:
        """`hpctrain cancel` asked to stop THIS job (its request names the job ids it cancelled: a later
        attempt of the run is not cancelled by an old request)."""
        from hpctrain.runs.folder import RunFolder

        req = RunFolder(self.run_dir).cancel_request() if self.run_dir is not None else None
        return req is not None and bool(_my_job_ids() & {str(j) for j in req.get("jobs") or []})

    def why(self, signum: int | None = None) -> Any:
        """The failure class of this stop (hpctrain.states.stop_class): time_limit, preempted, cancelled."""
        from hpctrain.states import FailureClass, stop_class

        sig = self.signum if signum is None else signum
        guessed = "SLURM_JOB_END_TIME" not in os.environ and "SLURM_JOB_START_TIME" not in os.environ
        cancelled = self.cancelled()
        cls = stop_class(sig, self.seconds_left(), self.window_s, cancelled=cancelled,
                         limit_s=(self.limit_s or 0.0) if guessed else 0.0)
        if cls == FailureClass.PREEMPTED and sig in (signal.SIGUSR1, signal.SIGUSR2):
            # Far from the end the job started with: ask SLURM for the end it holds now (only then, so a
            # plain time limit costs no RPC). A moved limit makes this the pre-timeout signal after all.
            end = self.live_end()
            if end is not None:
                cls = stop_class(sig, end - time.time(), self.window_s, cancelled=cancelled)
        return cls

    def install(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def chain(self) -> None:
        """Hand the signal to whoever had it before (submitit requeues a preempted job from rank 0);
        never for a run that `hpctrain cancel` stops."""
        prev = self.previous.get(self.signum)
        if self.cancelled():
            return
        if callable(prev) and self.signum == signal.SIGUSR2:
            prev(self.signum, None)


@dataclass(frozen=True)
class Progress:
    """Where training stands at a step boundary: what a checkpoint records and a resume restores."""

    step: int  # optimizer steps done
    cursor: int  # global index of the next micro-batch (node/data/loader.py: batches are a function of it)
    tokens_seen: float


@dataclass
class SavePolicy:
    """When to save (no I/O, no collectives). `clock` is injectable so that the minutes rule is testable."""

    every_steps: int  # 0 = off
    every_minutes: float  # 0 = off
    last_step: int  # spec.train.steps
    final: bool  # save at the last step
    clock: Callable[[], float] = time.time
    since: float = 0.0  # clock at the last save, or when training started

    def restart_timer(self) -> None:
        self.since = self.clock()

    def minutes_due(self) -> bool:
        return self.every_minutes > 0 and self.clock() - self.since >= 60 * self.every_minutes

    def due(self, step: int, *, signalled: bool, minutes: bool) -> bool:
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        return signalled or minutes or by_steps or (step == self.last_step and self.final)


class Checkpointer:
    """Owns saving and resuming for one attempt. Every method that saves or loads is collective."""

    def __init__(self, engine: Any, ckpt_dir: Path, policy: SavePolicy, stop: StopFlag, *, rank: int, keep: int,
                 layout: dict[str, Any], io: Any = None, beat: Any = None) -> None:
        self.engine, self.dir, self.policy, self.stop = engine, ckpt_dir, policy, stop
        self.rank, self.keep = rank, keep
        self.layout = layout  # world_size, dp, pp, tp, zero, precision: what a resume must match or convert
        self.io = io  # ckpt_async.CheckpointIO installed as the engine's checkpoint engine; None: plain sync saves
        self.beat = beat  # the rank's heartbeat for the hang watchdog (its phase names a stuck save)
        self.step0 = 0  # where this attempt started: the fault-injection hook fires only past it
        self.last_saved = -1
        self.signalled = False

    @classmethod
    def for_run(cls, engine: Any, spec: Spec, ckpt_dir: Path, stop: StopFlag, *, rank: int, world: int, dp: int,
                zero: int, use_gpu: bool, n_params: int, beat: Any = None) -> Checkpointer:
        """The run's policy, with hpctrain's writer installed as the engine's checkpoint engine."""
        from hpctrain.node.checkpointing import ckpt_async

        c = spec.checkpoint
        # A checkpoint at the end unless the run asked for none at all (benchmarks: 15-50 GB saved).
        final = c.every_steps > 0 or c.every_minutes > 0 or c.export_hf
        policy = SavePolicy(c.every_steps, c.every_minutes, spec.train.steps, final)
        if spec.lora.r:  # a LoRA checkpoint holds the adapters and their optimizer state only
            from hpctrain.node.model.lora import adapter_checkpoints, trainable_counts

            adapter_checkpoints(engine)
            n_params = trainable_counts(engine.module)[0]
        rank_bytes = ckpt.estimate_state_bytes(n_params, dp, zero, spec.train.precision)
        per_node = max(1, min(world, spec.resources.tasks_per_node))
        on, why = ckpt.choose_async(c.async_save, use_gpu, rank_bytes, per_node, ckpt.host_available_bytes(),
                                    scheduled=final)
        log.info("checkpoints: %s (%s)", "asynchronous" if on else "synchronous", why)
        # The snapshot's host buffers (the whole rank state, pinned) only where a save is scheduled: a run that
        # saves only on a signal would hold them, unused, beside the optimizer's own host memory.
        io = ckpt_async.install(engine, async_mode=on, pin=on and use_gpu, rank=rank, world=world,
                                reserve_bytes=rank_bytes if final else 0)
        layout = {"world_size": world, "dp": dp, "pp": spec.parallel.pp, "tp": spec.parallel.tp, "zero": zero,
                  "precision": spec.train.precision, "adapters": bool(spec.lora.r)}
        return cls(engine, ckpt_dir, policy, stop, rank=rank, keep=c.keep, layout=layout, io=io, beat=beat)

    # ---------------------------------------------------------------------------------------- saving
    def votes(self) -> list[float]:
        """This rank's say in the save at the coming step boundary, summed over ranks by the step's
        all_reduce: [signal seen, minutes elapsed]. Only rank 0's clock votes, so the ranks cannot
        disagree about the time."""
        return [float(self.stop.signum > 0), float(self.rank == 0 and self.policy.minutes_due())]

    def maybe_save(self, progress: Progress, votes: Sequence[float]) -> ckpt.SaveStats | None:
        """Collective: save at this step boundary when the agreed `votes` or the step count say so.
        A save on the signal or at the last step returns once the checkpoint is complete."""
        self.signalled = votes[0] > 0
        if not self.policy.due(progress.step, signalled=self.signalled, minutes=votes[1] > 0):
            return None
        return self.save(progress, wait=self.signalled or progress.step == self.policy.last_step)

    @property
    def should_stop(self) -> bool:
        """True after the step boundary at which some rank had seen the signal (that step is saved)."""
        return self.signalled

    def save(self, progress: Progress, wait: bool = True) -> ckpt.SaveStats | None:
        """Checkpoint at progress.step (collective). `wait`: return only once it is complete."""
        step = progress.step
        if self.last_saved == step:
            if wait and self.io is not None:  # e.g. a signal right after an async save: it must be complete
                ckpt.drain(self.io)
            return None
        client = {"step": step, "cursor": progress.cursor, "tokens_seen": progress.tokens_seen,
                  "dp": self.layout["dp"], "world_size": self.layout["world_size"]}
        meta = {**self.layout, "cursor": progress.cursor}
        self._phase(step, "checkpoint")
        from hpctrain.node.faultinject import inject

        # Test hook: HPCTRAIN_FAULT_INJECT="ckpt-crash:step=N" kills every rank with the checkpoint half written.
        midway = lambda: inject("checkpoint", step, self.step0, self.rank, log)
        stats = ckpt.save(self.engine, self.dir, step, client, meta, self.keep, midway=midway, io=self.io,
                          wait=wait)
        self._phase(step, "reduce")
        self.last_saved = step
        self.policy.restart_timer()
        if stats.write_s is None:
            log.info("checkpoint step-%d: state copied in %.2f s, writing in the background", step, stats.blocking_s)
        else:
            log.info("checkpoint step-%d written in %.2f s (%s)", step, stats.write_s, stats.mode)
        return stats

    def metrics_fields(self, saved: ckpt.SaveStats | None) -> dict[str, Any]:
        """metrics.jsonl: ckpt_blocking_s on the saving step; ckpt_write_s/bytes/gbps on the step where rank 0
        sees the checkpoint complete (the same step for a synchronous save)."""
        out: dict[str, Any] = {}
        if saved is not None:
            out.update(ckpt_blocking_s=saved.blocking_s, ckpt_mode=saved.mode)
            done = saved if saved.write_s is not None else saved.previous
            if done is not None:
                out.update(done.record())
                return out
        job = self.io.finished() if self.io is not None else None
        if job is not None:
            out.update(ckpt.SaveStats(job.step, "async", 0.0, job.write_s, job.total_bytes or None).record())
        return out

    def requeue(self, step: int, metrics: MetricsWriter) -> StopRequested:
        """After the save on the signal: record the stop, hand the job back to SLURM (rank 0), and return
        the exception that ends this rank (node/launch/main.py exits 3 for it)."""
        metrics.heartbeat(step, "stopped-on-signal")
        metrics.event({"event": "stopped-on-signal", "step": step, "signal": self.stop.signum})
        from hpctrain.states import FailureClass

        why = self.stop.why()
        if why == FailureClass.CANCELLED:
            log.info("signal %d: checkpointed at step %d, stopping: cancelled by the user (hpctrain cancel)",
                     self.stop.signum, step)
            return StopRequested(f"cancelled by the user at step {step}")
        log.info("signal %d: checkpointed at step %d, stopping for requeue (%s)", self.stop.signum, step,
                 why or "a peer got the signal")
        if self.rank == 0:
            self.stop.chain()  # under submitit: requeues the job (scontrol requeue) and exits
        else:
            wait_for_requeue()
        return StopRequested(f"stopped on signal at step {step}")

    def close(self, step: int) -> None:
        """End of training (collective): a background write still pending (the last save was not the
        final step's) completes, or its failure is raised on every rank."""
        self._phase(step, "checkpoint")
        if self.io is not None:
            ckpt.drain(self.io)

    def _phase(self, step: int, phase: str) -> None:
        if self.beat is not None:
            self.beat.set(step, phase)

    # ---------------------------------------------------------------------------------------- resuming
    def load(self, point: ckpt.ResumePoint | None, universal: bool) -> Progress:
        """Load `point` (None: a fresh start), converting it to a universal checkpoint first when
        `universal` (the DP size changed). Collective; the minutes timer starts when it returns."""
        if point is None:
            self.policy.restart_timer()
            return Progress(0, 0, 0.0)
        ckpt.check_adapters(point, bool(self.layout.get("adapters")))
        tag = self._convert(point) if universal else point.tag
        client = self._load_engine(tag)
        align_optimizer_steps(self.engine)
        same_world = int(point.meta.get("world_size", -1)) == self.layout["world_size"]
        restored = same_world and ckpt.load_rng(point.path / f"rng-rank-{self.rank}.pt")
        progress = Progress(int(client.get("step", point.step)), int(client.get("cursor", 0)),
                            float(client.get("tokens_seen", 0.0)))
        log.info("resumed from %s at step %d (data cursor %d, rng %s)", tag, progress.step, progress.cursor,
                 "restored" if restored else "re-seeded")
        self.step0 = progress.step
        self.policy.restart_timer()
        return progress

    def _convert(self, point: ckpt.ResumePoint) -> str:
        """Rank 0 runs ds_to_universal; every rank learns whether it worked. Returns the universal tag."""
        error: Exception | None = None
        if self.rank == 0:
            log.info("checkpoint %s has dp=%s, this run dp=%d: converting to a universal checkpoint",
                     point.tag, point.meta.get("dp"), self.layout["dp"])
            try:
                ckpt.convert_universal(self.dir, point.tag, int(self.layout["zero"]))
            except Exception as exc:  # noqa: BLE001 - reported below, after every rank knows
                error = exc
        if not agree(error is None):
            raise error or OtherRankFailed()
        return f"universal-{point.tag}"

    def _load_engine(self, tag: str) -> dict[str, Any]:
        """engine.load_checkpoint with module, optimizer and scheduler; returns the client state.
        Any failure becomes one NodeInputError naming the folder, on every rank."""
        error: Exception | None = None
        client: dict[str, Any] = {}
        try:
            # A LoRA checkpoint lacks the frozen base (read from [model] path): not strict there.
            strict = not self.layout.get("adapters")
            path, loaded = self.engine.load_checkpoint(str(self.dir), tag=tag, load_module_strict=strict,
                                                       load_optimizer_states=True, load_lr_scheduler_states=True)
            if path is None:
                raise NodeInputError(f"{self.dir / tag}: DeepSpeed found no checkpoint to load there.")
            client = dict(loaded or {})
        except NodeInputError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - any load failure becomes one message, on every rank
            error = NodeInputError(f"{self.dir / tag}: cannot load checkpoint ({type(exc).__name__}: {exc}). "
                                   "Fix: delete that folder (and `latest`) to resume from an earlier checkpoint.")
        if not agree(error is None):
            raise error or OtherRankFailed()
        return client


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
        step: Any = state.get("step") if isinstance(state, dict) else None
        if torch.is_tensor(param) and torch.is_tensor(step) and \
                (step.device != param.device or step.dtype != torch.float32):
            state["step"] = step.to(device=param.device, dtype=torch.float32)
            moved += 1
    return moved
