"""hpctrain.runtime: the small SDK for your own training script run by `hpctrain submit --script`.

    from hpctrain import runtime

    start = 0
    if (ckpt := runtime.resume_from()) is not None:       # the latest complete checkpoint, or None
        engine.load_checkpoint(ckpt.parent, tag=ckpt.name)
        start = runtime.resume_step()
    for step in range(start + 1, steps + 1):
        loss = train_step()
        runtime.report(step=step, loss=loss)               # metrics.jsonl + heartbeats (hang watchdog)
        if runtime.should_stop() or step % 50 == 0:        # SLURM's pre-timeout / preemption signal
            engine.save_checkpoint(runtime.checkpoint_dir(), tag=f"step-{step}")
            runtime.mark_checkpoint(step)                  # now it counts: resume, summary, supervisor
        if runtime.should_stop():
            break                                          # hpctrain requeues the job; it resumes here

Most scripts need less: a HF Trainer with `hpctrain.runtime.hf.HpctrainCallback` resumes by default
(`trainer.train()` starts from the checkpoint hpctrain marked last, and the callback's rotation never deletes it),
and a plain DeepSpeed loop needs one call, `start = hpctrain.runtime.ds.attach(engine)` (loads the marked
checkpoint, marks the engine's saves, checkpoints on SLURM's signal). docs/scripts.md has the lines.

Every function works on every rank; those that agree (should_stop, mark_checkpoint) are collective when
torch.distributed is initialized, so call them on every rank at the same point. Outside a job (HPCTRAIN_RUN_DIR
unset) the run folder is ./hpctrain-run, so the script also runs by hand.

Importing this module imports no torch (it uses torch.distributed only when the script already started it)
and installs handlers for SIGUSR2 and SIGTERM that only note the signal (a handler the script set before
is called after). The formats are the run folder's (hpctrain.runs): metrics, heartbeats, checkpoint markers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hpctrain.runs import beats
from hpctrain.runs.checkpoints import LATEST, MARKER, UnusableCheckpoints, choose_resume, step_tag
from hpctrain.runs.folder import RunFolder

__all__ = ["checkpoint_dir", "is_main", "mark_checkpoint", "rank", "report", "resume_from", "resume_step", "run_dir",
           "should_stop", "world_size"]

LOCAL_RUN_DIR = "hpctrain-run"
_signal_seen = 0
_previous: dict[int, Any] = {}


def run_dir() -> Path:
    """The run folder (HPCTRAIN_RUN_DIR, set on every rank by hpctrain); ./hpctrain-run outside a job."""
    return Path(os.environ.get("HPCTRAIN_RUN_DIR") or Path.cwd() / LOCAL_RUN_DIR)


def rank() -> int:
    return _int_env("RANK", 0)


def world_size() -> int:
    return _int_env("WORLD_SIZE", 1)


def is_main() -> bool:
    """Rank 0: the one that writes metrics and checkpoint markers."""
    return rank() == 0


def checkpoint_dir() -> Path:
    """Where checkpoints go: RUN/checkpoints. Save step N into checkpoint_dir()/step-N, then mark_checkpoint(N)."""
    path = RunFolder(run_dir()).checkpoints_dir
    path.mkdir(parents=True, exist_ok=True)
    return path


# ------------------------------------------------------------------------------------------------ stop
def _note(signum: int, frame: Any) -> None:
    global _signal_seen
    _signal_seen = signum
    prev = _previous.get(signum)
    if callable(prev):
        prev(signum, frame)


def _install() -> None:
    """Note SLURM's signals (USR2 before the time limit, TERM on preemption) instead of dying of them."""
    if not hasattr(signal, "SIGUSR2"):
        return
    try:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            _previous[sig] = signal.signal(sig, _note)
    except ValueError:  # not the main thread (imported from a worker thread): the stop file still works
        pass


def _requested() -> bool:
    """The node entry's stop-request.json names this job and run of it (an older one does not count)."""
    path = RunFolder(run_dir()).stop_request
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    job = os.environ.get("SLURM_JOB_ID", "")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    try:  # the node entry's start: outside SLURM (no job id) the time tells this run's request from an older one
        started = float(os.environ.get("HPCTRAIN_STARTED", "0"))
    except ValueError:
        started = 0.0
    return (isinstance(rec, dict) and str(rec.get("job")) == job and str(rec.get("restart", "0")) == restart
            and float(rec.get("time", 0) or 0) >= started)


def should_stop() -> bool:
    """True once SLURM signalled this job (pre-timeout USR2 or preemption TERM): save a checkpoint, mark it and
    leave the loop; hpctrain requeues the job and resume_from() then names that checkpoint. Collective when
    torch.distributed is initialized: every rank gets the same answer at the same step."""
    return _agree(bool(_signal_seen) or _requested())


def _dist() -> Any:
    """torch.distributed when the script started a process group, else None (never imports torch)."""
    tdist = sys.modules.get("torch.distributed")
    try:
        return tdist if tdist is not None and tdist.is_available() and tdist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported torch: act alone
        return None


def _agree(flag: bool) -> bool:
    """Any rank's True is every rank's True (one all_reduce of one number)."""
    tdist = _dist()
    if tdist is None:
        return flag
    torch = sys.modules["torch"]
    device = "cpu"
    if tdist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item() > 0)


# --------------------------------------------------------------------------------------------- metrics
def report(step: int, **metrics: Any) -> None:
    """One optimizer step done: rank 0 appends {"step", "time", **metrics} to metrics/metrics.jsonl (what
    `hpctrain summary` reads: loss, lr, tokens_per_s, tflops, mfu, ckpt_s are known) and the heartbeat; every
    rank's beat tells the hang watchdog it advanced. Values must be JSON numbers or strings (tensors: .item())."""
    folder = RunFolder(run_dir())
    now = time.time()
    if is_main():
        folder.metrics_dir.mkdir(parents=True, exist_ok=True)
        rec = {"step": int(step), "time": now, **{k: _plain(v) for k, v in metrics.items()}}
        with open(folder.metrics_jsonl, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        _replace(folder.heartbeat, {"step": int(step), "time": now, "rank": 0, "host": socket.gethostname(),
                                    "state": "training"})
    _beat(int(step) + 1, "compute")


def _plain(value: Any) -> Any:
    """A metric as JSON: numbers and strings as they are, a tensor or numpy scalar through .item()."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def _beat(step: int, phase: str) -> None:
    """This rank's beat (format: hpctrain.runs.beats), what the node's RankBeat writes for the trainer."""
    rec = {"rank": rank(), "host": socket.gethostname(), "step": step, "phase": phase, "time": time.time(),
           "job": os.environ.get("SLURM_JOB_ID", ""), "restart": os.environ.get("SLURM_RESTART_COUNT", "0") or "0",
           "pid": os.getpid()}
    directory = beats.ranks_dir(RunFolder(run_dir()).metrics_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        beats.write_record(directory, beats.beat_name(rank()), rec)
    except OSError:
        pass  # a flaky filesystem must not cost a training step


def _replace(path: Path, rec: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(rec) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


# ----------------------------------------------------------------------------------------- checkpoints
def mark_checkpoint(step: int, path: str | os.PathLike[str] | None = None) -> Path:
    """Say that the checkpoint of `step` is complete, once every rank has written it (call on every rank:
    a barrier when torch.distributed is initialized; rank 0 writes). `path` defaults to
    checkpoint_dir()/step-N; a checkpoint elsewhere (HF Trainer's checkpoint-N) is recorded in the marker
    of checkpoint_dir()/step-N. Writes the marker (with a manifest of file sizes, every file fsynced) and
    `latest`, the rule hpctrain.runs.checkpoints defines. Returns the marker's folder."""
    tdist = _dist()
    if tdist is not None:
        tdist.barrier()
    ckpt = checkpoint_dir()
    folder = ckpt / step_tag(int(step))
    target = Path(path).absolute() if path is not None else folder
    if is_main():
        _write_marker(ckpt, folder, int(step), target)
    if tdist is not None:
        tdist.barrier()  # no rank goes on (and may stop) before the marker is there
    _beat(int(step) + 1, "compute")
    return folder


def _write_marker(ckpt: Path, folder: Path, step: int, target: Path) -> None:
    if not target.is_dir():
        raise FileNotFoundError(f"mark_checkpoint({step}): {target} is not a folder; save the checkpoint first")
    folder.mkdir(parents=True, exist_ok=True)
    files = {str(p.relative_to(target)): p.stat().st_size for p in sorted(target.rglob("*"))
             if p.is_file() and p.name != MARKER}
    for rel in files:
        _fsync(target / rel)
    meta = {"step": step, "tag": step_tag(step), "time": time.time(), "files": files, "source": "runtime",
            "world_size": world_size(), **({} if target == folder else {"path": str(target)})}
    _atomic(folder / MARKER, json.dumps(meta, indent=1) + "\n")
    _fsync(folder)
    _atomic(ckpt / LATEST, step_tag(step) + "\n")
    _fsync(ckpt)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _resume_point() -> tuple[int, Path] | None:
    """(step, files) of the checkpoint to resume from, by the one rule (hpctrain.runs.checkpoints.choose_resume):
    the one `latest` names when whole, else the newest whole one. Raises UnusableCheckpoints (a ValueError whose
    message says what to do) when checkpoints were marked complete and none is whole."""
    ckpt = RunFolder(run_dir()).checkpoints_dir
    choice = choose_resume(ckpt)
    for why in choice.skipped:
        print(f"hpctrain.runtime: resume passed over {why}", file=sys.stderr)
    if choice.refused:
        raise UnusableCheckpoints(choice.refused)
    found = choice.checkpoint
    return (found.step, found.files) if found else None


def resume_from() -> Path | None:
    """The folder of the checkpoint to resume from (what mark_checkpoint recorded): the one `latest` names, or the
    newest whole one when that one is damaged; None to start fresh. Raises UnusableCheckpoints (a ValueError) when
    every checkpoint marked complete is damaged: starting again from step 0 is then a person's decision."""
    found = _resume_point()
    return found[1] if found else None


def resume_step() -> int:
    """The step of resume_from()'s checkpoint, 0 when there is none."""
    found = _resume_point()
    return found[0] if found else 0


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


_install()
