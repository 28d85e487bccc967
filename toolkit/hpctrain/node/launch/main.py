"""`run(run_dir, mode)`: the node entrypoint. Owns teardown (try/except/else) and exit codes.

Exit codes (every rank; hpctrain.states.ExitCode): 0 done, 2 bad input (message on rank 0 names the file
and the fix), 3 stopped on SLURM's pre-timeout/preemption signal after a checkpoint (resubmit resumes),
4 preflight failed, 1 anything else (traceback in logs/attempt-K.rank-R.log). A rank that fails or stops
also appends one event to the run folder's events.jsonl (hpctrain.runs.events): the collector classifies
the attempt from it, rank logs or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import TypeVar

from hpctrain.node import dist, phases
from hpctrain.node.checkpointing.checkpointer import StopFlag, StopRequested
from hpctrain.node.dist import OtherRankFailed
from hpctrain.node.launch import imports, predecessors, preflight, script
from hpctrain.node.monitor import stacks as node_stacks
from hpctrain.node.monitor.metrics import attempt_number, log, setup_logging
from hpctrain.node.runconf import NodeInputError, read_spec
from hpctrain.runs import events, repro
from hpctrain.runs.checkpoints import complete_steps
from hpctrain.runs.folder import RunFolder
from hpctrain.spec.model import Spec, user_script
from hpctrain.states import ExitCode, FailureClass


def run(run_dir: str, mode: str = "train") -> int:
    """Run on every rank. Returns 0, or raises SystemExit with a non-zero code on every rank."""
    import gc
    import os
    import warnings

    # Rank logs, metrics, checkpoints, summary: private to the user however this rank was started
    # (submitit, srun, torchrun, DeepSpeed's runner); the docs promise 0600 files in the run folder.
    os.umask(0o077)
    # torch's c10d deprecation notices repeat on every collective of DeepSpeed's ZeRO-3 (pages of stderr).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    d = dist.detect()
    paths = RunFolder(Path(run_dir).absolute())
    setup_logging(paths.logs_dir, d.rank, attempt_number())
    before: str | None = None  # the directory to give back at the end (the trainer runs in the run folder)
    log.info("hpctrain node: mode %s, rank %d/%d (local %d) via %s, master %s:%d", mode, d.rank, d.world_size,
             d.local_rank, d.source, d.master_addr, d.master_port)
    code = ExitCode.OK
    initialized = False
    stop: StopFlag | None = None
    own = False  # the user's own program (submit --script) instead of the trainer
    where = _Where(d.rank, attempt_number(), d.job_id)
    if d.rank == 0:
        _event(paths.path, where, events.START, extra={"mode": mode, "world_size": d.world_size})
        _freeze(paths, where.attempt)
    try:
        if mode not in ("train", "preflight"):
            raise NodeInputError(f"mode {mode!r}: use 'train' or 'preflight'.")
        spec = read_spec(paths)
        if not user_script(spec):  # a user's program: its rank processes dump, not this wrapper (script.child_env)
            _stack_dumps(paths, where)
        # Export MASTER_ADDR/PORT first: the preflight rendezvous listens on MASTER_PORT + 1.
        dist.prepare_process_env(d, use_gpu=spec.resources.gpus_per_node > 0,
                                 cpus_per_task=max(1, spec.resources.cpus_per_task), run_dir=str(paths.path))
        predecessors.wait_gone(str(os.environ.get("HPCTRAIN_RUN_DIR", "")), predecessors.restart_of(dict(os.environ)),
                               log.info)
        phases.mark("entry")  # interpreter, hpctrain's imports, the run folder's spec (and the step before gone)
        _preflight(spec.launch.preflight_timeout_s)
        phases.mark("preflight")
        if mode == "preflight":
            return ExitCode.OK
        if user_script(spec):
            own, stop = True, _stop_flag(script.ScriptStop, spec, paths)
            stop.install()  # before the program starts: a signal from now on stops it for requeue
            _run_user_script(spec, paths, d, stop, where.job_id)
            return ExitCode.OK
        from hpctrain.node import train

        # The trainer runs in its run folder: ds_config.json names the trackers' folders relative to it
        # ("output_path": "metrics", joined by DeepSpeed to the directory it runs in), so they land there
        # wherever the folder sits (moved, resubmitted, in a container). A user's script, above, keeps the
        # directory the job started in (its own relative paths). Given back at the end (tests run in-process).
        before = _enter(paths.path)
        prep = train.prepare(paths.path, d)  # every input checked before any collective can hang
        phases.mark("prepare")  # torch, transformers, the tokenizer and data
        dist.init_process_group(d, prep.use_gpu, timeout_min=float(_env_float("DEEPSPEED_TIMEOUT", 10)))
        phases.mark("process_group")
        initialized = True
        stop = _stop_flag(StopFlag, spec, paths)
        stop.install()  # before the engine build: a signal during it is acted on at the first step boundary
        engine, state = train.run_training(prep, stop)
        train.finish(prep, engine, state)
        # Free the engine (and the process-group handles it holds) now, while the interpreter is whole:
        # left to interpreter shutdown, gloo's threads were once torn down out of order (see _teardown).
        del engine, state
        gc.collect()
    except Exception as exc:  # noqa: BLE001 - the entrypoint owns every failure: log it, event it, exit non-zero
        code = _fail(exc, paths, where, stop if stop is not None else StopFlag(run_dir=paths.path))
    else:
        log.info("done")
    finally:
        if initialized:
            _teardown(together=code == ExitCode.OK)
        _leave(before)
    if own and code == ExitCode.STOPPED and stop is not None:
        script.requeue_pending(d.rank, stop)  # after the stop event: rank 0's submitit requeues the job
    if code != ExitCode.OK:
        raise SystemExit(int(code))
    return ExitCode.OK


# Before anything imports deepspeed on this rank: ~1 s less start-up (hpctrain.node.launch.imports).
imports.install()

_Stop = TypeVar("_Stop", bound=StopFlag)


def _stop_flag(kind: type[_Stop], spec: Spec, paths: RunFolder) -> _Stop:
    """The run's stop flag, with what StopFlag.why() tells a time limit, a preemption and a cancel apart by."""
    from hpctrain.spec.rules import time_limit_s

    return kind(run_dir=paths.path, limit_s=float(time_limit_s(spec.resources.time)),
                window_s=float(spec.resources.signal_seconds))


class PreflightFailed(Exception):
    pass


def _enter(folder: Path) -> str | None:
    """chdir into `folder`; the directory left (None when it no longer exists)."""
    try:
        before: str | None = os.getcwd()
    except OSError:
        before = None
    os.chdir(folder)
    return before


def _leave(before: str | None) -> None:
    if before is not None:
        with contextlib.suppress(OSError):  # removed meanwhile: stay where we are
            os.chdir(before)


def _run_user_script(spec: Spec, paths: RunFolder, d: dist.DistEnv, stop: script.ScriptStop, job_id: str) -> None:
    """The user's program in place of the trainer: returns when it succeeded; raises StopRequested when it ended
    after the stop signal (exit 3: requeue, resume from its latest complete checkpoint), ScriptFailed else."""
    from hpctrain.node.runconf import read_plan

    plan = read_plan(paths)
    before = complete_steps(paths.checkpoints_dir)
    code, tail = script.run_script(spec, paths, d, stop, ranks_per_node=plan.ranks_per_node, nodes=plan.nodes,
                                   job_id=job_id)
    if stop.signum:
        saved = complete_steps(paths.checkpoints_dir)
        new = bool(saved) and saved != before
        what = f"its checkpoint of step {saved[-1]}" if new else (
            f"no new checkpoint (latest complete: step {saved[-1]})" if saved else "no checkpoint")
        raise StopRequested(f"stopped on signal {stop.signum}: the script exited with code {code} after {what}",
                            checkpointed=new)
    if code != 0:
        raise script.failure(code, tail)


class _Where:
    """Who writes the event: rank, attempt K, the job id as the registry knows it (array task "A_i"), host."""

    def __init__(self, rank: int, attempt: int, job_id: str) -> None:
        array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        self.rank, self.attempt = rank, attempt
        self.job_id = f"{array}_{task}" if array and task else job_id
        # SLURM's name for the node (what --exclude takes), else the machine's.
        self.host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _stack_dumps(paths: RunFolder, where: _Where) -> None:
    """Dump every thread's stack to stacks/attempt-K.rank-R.txt on SIGURG (hpctrain.runs.stacks says why
    that signal): `hpctrain stacks`, and the watchdog before it cancels a hung job. Installed before
    anything can hang but the spec's read, which tells whether this process is a rank (the trainer) or the
    wrapper of a user's program, whose own rank processes dump instead (script.child_env); a folder that cannot
    take the file costs a log line, never the run."""
    try:
        path = node_stacks.install(paths.stacks_dir, where.rank, where.attempt, where.job_id)
    except (OSError, ValueError, RuntimeError) as err:
        log.warning("no stack dumps on SIGURG for this rank: %s", err)
        return
    log.info("stack dumps on SIGURG go to %s", path)


def failure_of(exc: BaseException) -> tuple[FailureClass | None, ExitCode]:
    """A rank's exception -> (failure class, exit code), by the exception's class. None: this rank stopped
    because another rank failed (that rank's event names the cause). torch is looked up, not imported: an
    OOM or a collective's error can only come from it once it is loaded."""
    if isinstance(exc, NodeInputError):
        return FailureClass.INPUT_ERROR, ExitCode.INPUT
    if isinstance(exc, PreflightFailed):
        return FailureClass.PREFLIGHT, ExitCode.PREFLIGHT
    if isinstance(exc, OtherRankFailed):
        return None, ExitCode.ERROR
    if isinstance(exc, MemoryError):
        return FailureClass.HOST_OOM, ExitCode.ERROR
    if isinstance(exc, script.ScriptFailed):  # the collector refines it by the program's exception text
        return (FailureClass.UNKNOWN if exc.returncode < 0 else FailureClass.PYTHON_EXCEPTION), ExitCode.ERROR
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return FailureClass.GPU_OOM, ExitCode.ERROR
    tdist = sys.modules.get("torch.distributed")
    if tdist is not None and isinstance(exc, getattr(tdist, "DistError", ())):
        return FailureClass.COMM_TIMEOUT, ExitCode.ERROR
    # Anything else is the user's code or config. A RuntimeError that carries gloo's or NCCL's text (a lost
    # peer, a timeout) is told apart by the collector, which owns the patterns for third-party messages.
    return FailureClass.PYTHON_EXCEPTION, ExitCode.ERROR


def _submitit_refused_requeue(exc: BaseException) -> bool:
    """submitit's UncompletedJobError, by class; submitit is looked up, not imported (no job, no submitit)."""
    utils = sys.modules.get("submitit.core.utils")
    return utils is not None and isinstance(exc, getattr(utils, "UncompletedJobError", ()))


def _fail(exc: Exception, paths: RunFolder, where: _Where, stop: StopFlag) -> ExitCode:
    """Log the failure, print its one line on stderr, append its event; the exit code. The stop's class
    (time limit, preemption, a user's cancel) is StopFlag.why's."""
    signum = stop.signum
    if isinstance(exc, StopRequested):
        _event(paths.path, where, events.STOP, stop.why(), message=str(exc), exit_code=ExitCode.STOPPED,
               signum=signum, extra={"checkpointed": exc.checkpointed})
        return ExitCode.STOPPED
    if _submitit_refused_requeue(exc):
        # submitit's requeue handler runs on its signal, USR2 (hpctrain's --signal=USR2@N), and declined to
        # requeue (no retries wanted): a stop on the signal, not a bug. Either StopFlag.chain handed it the
        # signal after the checkpoint (signum set), or the signal came before StopFlag was installed and
        # called it directly (signum 0): then nothing was saved. The exit code stays 1, as before.
        sig = signum or int(signal.SIGUSR2)
        saved = complete_steps(paths.checkpoints_dir) if signum else []
        what = f"stopped on signal at step {saved[-1]} after its checkpoint" if saved else (
            "stopped on signal before training, nothing saved")
        log.info("%s; submitit did not requeue: %s", what, exc)
        _event(paths.path, where, events.STOP, stop.why(sig), message=f"{what}; submitit did not requeue ({exc})",
               exit_code=ExitCode.ERROR, signum=sig, extra={"checkpointed": bool(saved)})
        return ExitCode.ERROR
    cls, code = failure_of(exc)
    exc_line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    tb: tuple[str, ...] = ()
    if isinstance(exc, script.ScriptFailed):  # the program's own exception and traceback, from its stderr
        print(f"hpctrain: rank {where.rank}: {exc} (its stderr is in this log)", file=sys.stderr, flush=True)
        log.error("%s", exc)
        # Under a per-node launcher this entry is the node's one task: the program's rank that raised is another.
        _event(paths.path, where, events.FAILURE, cls, exception=exc.exception or exc_line, message=str(exc),
               exit_code=code, tb=tuple(exc.tail[-12:]),
               extra={"script_rank": exc.rank} if exc.rank is not None else None)
        return code
    if cls == FailureClass.INPUT_ERROR:
        _report(where.rank, f"hpctrain: {exc}", str(exc))
    elif cls == FailureClass.PREFLIGHT:
        _report(where.rank, f"hpctrain: preflight failed: {exc}", str(exc))
    elif cls is None:
        log.error("stopping: another rank failed (see the rank-0 log)")
    else:
        text = traceback.format_exc()
        tb = tuple(text.rstrip().splitlines()[-12:])
        log.error("training failed:\n%s", text)
        print(f"hpctrain: rank {where.rank} failed: {type(exc).__name__}: {exc} (traceback in {paths.logs_dir})",
              file=sys.stderr)
    _event(paths.path, where, events.FAILURE, cls, exception=exc_line if cls is not None else "",
           message=str(exc) or exc_line if cls is not None else "another rank failed", exit_code=code, tb=tb)
    return code


def _event(root: Path, where: _Where, kind: str, cls: FailureClass | None = None, *, exception: str = "",
           message: str = "", exit_code: int | None = None, signum: int | None = None, tb: tuple[str, ...] = (),
           extra: dict[str, object] | None = None) -> None:
    """Append one event; a folder that cannot take it (read-only, full) costs a log line, never the exit code."""
    ev = events.Event(kind=kind, time=time.time(), rank=where.rank, host=where.host, job_id=where.job_id,
                      attempt=where.attempt, failure_class=cls, exception=exception, message=message,
                      exit_code=None if exit_code is None else int(exit_code), signal=signum, traceback=tb,
                      extra=dict(extra or {}))
    try:
        events.append_event(root, ev)
    except OSError as err:
        log.warning("could not append to %s: %s", events.events_path(root), err)


def _freeze(paths: RunFolder, attempt: int) -> None:
    """The packages of the environment that runs this attempt (repro/pip-freeze.attempt-K.txt): the node's or
    the image's, which may differ from the login node's. Informative: a failure costs a log line."""
    try:
        repro.write_freeze(paths.path, attempt)
    except Exception as err:  # noqa: BLE001 - never stop a training over its bundle
        log.warning("could not write %s: %s", paths.pip_freeze(attempt), err)


def _report(rank: int, loud: str, quiet: str) -> None:
    """One clear message on rank 0's stderr; the other ranks only log it."""
    log.error(quiet)
    if rank == 0:
        print(loud, file=sys.stderr, flush=True)


def _preflight(timeout_s: int) -> None:
    """The torch-free TCP rendezvous of every rank (hpctrain.node.launch.preflight), before any collective can hang.

    Imported at the top of this module: an install without it is broken, and the node must say so
    (ModuleNotFoundError names the module) instead of training without the check."""
    try:
        preflight.run_from_env(timeout_s)
    except Exception as exc:
        raise PreflightFailed(str(exc)) from exc
    log.info("preflight ok")


def _teardown(together: bool) -> None:
    """Destroy the process group; after a good run, only once every rank got here.

    Seen once on the 4-node CPU cluster: a rank that had finished and left 0.1 s before rank 0 aborted in
    C++ at exit ("terminate called without an active exception"), and srun's --kill-on-bad-exit turned the
    finished run into a FAILED job (the supervisor then retried it). Leaving together keeps every peer's
    gloo connections alive until all are done. A failed rank does not wait: its peers may never arrive."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return
    if together:
        try:
            tdist.barrier()
        except Exception as exc:  # noqa: BLE001 - the run is done; a peer gone at exit changes nothing
            log.warning("teardown: barrier failed (%s); destroying the process group anyway", exc)
    tdist.destroy_process_group()


def _env_float(name: str, default: float) -> float:
    import os

    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


__all__ = ["run"]
