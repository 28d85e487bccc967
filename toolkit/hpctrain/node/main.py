"""`run(run_dir, mode)`: the node entrypoint. Owns teardown (try/except/else) and exit codes.

Exit codes (every rank): 0 done, 2 bad input (message on rank 0 names the file and the fix),
3 stopped on SLURM's pre-timeout/preemption signal after a checkpoint (resubmit resumes), 4 preflight
failed, 1 anything else (traceback in logs/attempt-K.rank-R.log).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from hpctrain.node import dist
from hpctrain.node.metrics import attempt_number, log, setup_logging
from hpctrain.node.runconf import NodeInputError, RunPaths, read_spec

EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_STOPPED, EXIT_PREFLIGHT = 0, 1, 2, 3, 4


class PreflightFailed(Exception):
    pass


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
    paths = RunPaths(Path(run_dir))
    setup_logging(paths.logs, d.rank, attempt_number())
    log.info("hpctrain node: mode %s, rank %d/%d (local %d) via %s, master %s:%d", mode, d.rank, d.world_size,
             d.local_rank, d.source, d.master_addr, d.master_port)
    code = EXIT_OK
    initialized = False
    try:
        if mode not in ("train", "preflight"):
            raise NodeInputError(f"mode {mode!r}: use 'train' or 'preflight'.")
        spec = read_spec(paths.root)
        # Export MASTER_ADDR/PORT first: the preflight rendezvous listens on MASTER_PORT + 1.
        dist.prepare_process_env(d, use_gpu=spec.resources.gpus_per_node > 0,
                                 cpus_per_task=max(1, spec.resources.cpus_per_task))
        _preflight(spec.launch.preflight_timeout_s)
        if mode == "preflight":
            return EXIT_OK
        from hpctrain.node import train

        prep = train.prepare(paths.root, d)  # every input checked before any collective can hang
        dist.init_process_group(d, prep.use_gpu, timeout_min=float(_env_float("DEEPSPEED_TIMEOUT", 10)))
        initialized = True
        stop = train.StopFlag()
        stop.install()
        engine, state = train.run_training(prep, stop)
        train.finish(prep, engine, state)
        # Free the engine (and the process-group handles it holds) now, while the interpreter is whole:
        # left to interpreter shutdown, gloo's threads were once torn down out of order (see _teardown).
        del engine, state
        gc.collect()
    except NodeInputError as exc:
        code = EXIT_INPUT
        _report(d.rank, f"hpctrain: {exc}", str(exc))
    except PreflightFailed as exc:
        code = EXIT_PREFLIGHT
        _report(d.rank, f"hpctrain: preflight failed: {exc}", str(exc))
    except Exception as exc:  # noqa: BLE001 - the entrypoint owns every failure: log it, exit non-zero
        name = type(exc).__name__
        if name == "StopRequested":
            code = EXIT_STOPPED
        elif name == "OtherRankFailed":
            code = EXIT_ERROR
            log.error("stopping: another rank failed (see the rank-0 log)")
        else:
            code = EXIT_ERROR
            log.error("training failed:\n%s", traceback.format_exc())
            print(f"hpctrain: rank {d.rank} failed: {name}: {exc} (traceback in {paths.logs})", file=sys.stderr)
    else:
        log.info("done")
    finally:
        if initialized:
            _teardown(together=code == EXIT_OK)
    if code != EXIT_OK:
        raise SystemExit(code)
    return EXIT_OK


def _report(rank: int, loud: str, quiet: str) -> None:
    """One clear message on rank 0's stderr; the other ranks only log it."""
    log.error(quiet)
    if rank == 0:
        print(loud, file=sys.stderr, flush=True)


def _preflight(timeout_s: int) -> None:
    """DISPATCH's torch-free TCP rendezvous, when it is installed (hpctrain.node.preflight)."""
    try:
        from hpctrain.node import preflight
    except ImportError:
        log.info("preflight: hpctrain.node.preflight not available, skipped")
        return
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


__all__ = ["RunPaths", "read_spec", "run"]
