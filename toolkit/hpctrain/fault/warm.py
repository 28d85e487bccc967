"""The in-job driver's side of warm ranks (hpctrain.node.launch.zygote): a zygote per node, started once.

With warm ranks on (the trainer on CPU ranks through srun: `Driver.warm`), the driver starts an srun step of
its own on every usable node of the job, spares included, before the first training step: one zygote per node
that imports torch, DeepSpeed, transformers and the trainer, then forks ranks on request. Every training step
(the first, and each in-job restart) runs `python -m hpctrain.node.launch.zygote run submitit.core._submit ...`
per task in place of `python -m submitit.core._submit ...`: a rank forked from its node's zygote when one answers,
a cold start otherwise. On a restart the survivors' zygotes and the spare's are already warm: the restart pays
the fork, the rendezvous and the engine build, not the imports (the restart timeline's `zygote` record says
which path each attempt's rank 0 took). When the training is over the driver writes the stop file and the
zygotes end (their step COMPLETED, not cancelled).

HPCTRAIN_WARM_RANKS=0 in the submitting environment (sbatch exports it) turns it off: every step starts cold, as
before (the restart bench's baseline). Stdlib; no torch.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpctrain.states import WARM_RANKS_ENV

ZYGOTE = "hpctrain.node.launch.zygote"
SUBMIT = "submitit.core._submit"
STOP_WAIT_S = 5.0  # for the zygotes to see the stop file (they look twice a second) and their srun to end
# srun options of the ranks' line that the zygotes' step must not take: the ranks' log files (the zygote has its
# own) and --kill-on-bad-exit (one zygote lost with its node must not end the others). Long forms only, as the
# batch script writes them (hpctrain.render.sbatch): a container's own short options (-e) pass untouched.
_DROP_WITH_VALUE = ("--output", "--error")
_DROP = ("--kill-on-bad-exit", "--unbuffered")


def enabled(env: dict[str, str]) -> bool:
    """Warm ranks unless the job's environment says HPCTRAIN_WARM_RANKS=0."""
    return env.get(WARM_RANKS_ENV, "1").strip() not in ("0", "false", "no", "off")


def _submit_at(launch: Sequence[str]) -> int | None:
    """Where `-m submitit.core._submit` starts in the ranks' srun line; None when the line runs something else."""
    for i in range(len(launch) - 1):
        if launch[i] == "-m" and launch[i + 1] == SUBMIT:
            return i
    return None


def client_argv(argv: Sequence[str]) -> list[str]:
    """A training step's srun line with each task asking its node's zygote for the rank (same python, same
    container, same flags). Unchanged when the line does not run submitit's runner."""
    i = _submit_at(argv)
    if i is None:
        return list(argv)
    return [*argv[:i], "-m", ZYGOTE, "run", SUBMIT, *argv[i + 2:]]


def zygote_argv(launch: Sequence[str], hosts: Sequence[str], run_dir: Path, job: str) -> list[str] | None:
    """The zygotes' srun step over `hosts`, one task each: the ranks' line (its container and python) without
    the ranks' log files and kill-on-bad-exit, --no-kill (a lost node leaves the others serving), its own log
    per node under logs/zygote/. None when the ranks' line does not run submitit's runner."""
    i = _submit_at(launch)
    if i is None:
        return None
    flags, skip = [], False
    for a in launch[1:i]:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if a in _DROP_WITH_VALUE:
            skip = True
            continue
        if name in _DROP_WITH_VALUE or name in _DROP:
            continue
        flags.append(a)
    log = run_dir / "logs" / "zygote" / "%j.%N.log"
    return [launch[0], f"--nodes={len(hosts)}", f"--nodelist={','.join(hosts)}", f"--ntasks={len(hosts)}",
            "--ntasks-per-node=1", "--overlap", "--no-kill", "--kill-on-bad-exit=0", f"--output={log}",
            f"--error={log}", *flags, "-m", ZYGOTE, "serve", str(stop_file(run_dir, job))]


def start(launch: Sequence[str], hosts: Sequence[str], run_dir: Path, env: dict[str, str]) -> list[Any]:
    """Start one zygote step per host (returns at once: the first training step's ranks wait for the imports on
    their node's socket): their srun processes, none when the line cannot be served warm. One step per node, not
    one over all: when a lost node is declared down, SLURM cancels every step that spans it, and the survivors'
    forked ranks would go with a shared step (seen: the restart's ranks killed 30 s after the kill)."""
    from hpctrain import slurmcommands as _slurm

    argvs = [zygote_argv(launch, [h], run_dir, env.get("SLURM_JOB_ID", "")) for h in hosts]
    if not argvs or argvs[0] is None:
        return []
    (run_dir / "logs" / "zygote").mkdir(parents=True, exist_ok=True)
    stop_file(run_dir, env.get("SLURM_JOB_ID", "")).unlink(missing_ok=True)  # a requeued run of the job
    return [_slurm.start_step(a, env=env) for a in argvs if a is not None]


def stop_file(run_dir: Path, job: str) -> Path:
    """Written when the job's training is over: its zygotes end (the driver hands each the path at start)."""
    return run_dir / "metrics" / f"zygote-{job}.stop"


def stop(procs: Sequence[Any], run_dir: Path, job: str) -> None:
    """Ask the zygotes to end (the stop file) and wait for their steps (bounded); kill what is left after that."""
    if not procs:
        return
    path = stop_file(run_dir, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("stop\n")
    deadline = time.monotonic() + STOP_WAIT_S
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
    finally:
        path.unlink(missing_ok=True)


__all__ = ["SUBMIT", "ZYGOTE", "client_argv", "enabled", "start", "stop", "zygote_argv"]
