"""Checkpoints that survive a crash at any instant, automatic resume, universal conversion.

Layout under RUN/checkpoints/:
    .tmp-step-N/          DeepSpeed writes here first (every rank), plus rng-rank-R.pt per rank
    .tmp-step-N/.done/    async saves: rank-R once rank R's files are fsynced (rank-R.failed if not)
    step-N/               renamed by rank 0 after a barrier, once every rank has written
    step-N/hpctrain.json  the completion marker: step, world/dp/pp, zero stage, file sizes (manifest)
    latest                text "step-N", replaced atomically, written last
    universal-step-N/     DeepSpeed universal checkpoint, made on demand when the DP size changed
Only folders with a marker count, and a resume starts from `latest` when whole, else the newest whole one (the
rule is hpctrain.runs.checkpoints, shared with hpctrain.runtime, the collector and the supervisor); a crash
mid-save leaves a .tmp-* folder that is ignored and removed.
When to save, and the resume itself, are node/checkpointing/checkpointer.py's.
Every file is fsynced before the marker is written. Async saves (node/checkpointing/ckpt_async.py) keep all of this:
only the moment the marker appears moves, from inside save() to rank 0's writer thread.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.node.dist import OtherRankFailed, agree
from hpctrain.node.runconf import NodeInputError
from hpctrain.runs.checkpoints import LATEST, MARKER, choose_resume, complete_steps, manifest_problem
from hpctrain.runs.checkpoints import read_marker as runs_read_marker

log = logging.getLogger("hpctrain.node")


@dataclass(frozen=True)
class ResumePoint:
    tag: str  # "step-N"
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


# ------------------------------------------------------------------------------------------- finding
def find_resume(ckpt_dir: Path) -> ResumePoint | None:
    """The checkpoint to resume from, by the one rule (hpctrain.runs.checkpoints.choose_resume): `latest` when
    whole, else the newest whole one; each one passed over is logged. Raises NodeInputError where the rule
    refuses (checkpoints were marked complete and none is whole)."""
    choice = choose_resume(ckpt_dir)
    for why in choice.skipped:
        log.warning("resume: passed over %s", why)
    if choice.refused:
        raise NodeInputError(choice.refused)
    if choice.checkpoint is None:
        return None
    return ResumePoint(choice.checkpoint.tag, choice.checkpoint.folder, choice.checkpoint.meta)


def read_marker(path: Path) -> dict[str, Any]:
    try:
        return dict(runs_read_marker(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NodeInputError(f"{path / MARKER}: unreadable checkpoint marker ({exc}). Fix: delete {path} (training "
                             "resumes from the previous complete checkpoint) or restore it from a backup.") from exc


def validate_files(path: Path, meta: dict[str, Any]) -> None:
    """Every file in the manifest exists with its recorded size, and torch files have a readable index (the
    check of hpctrain.runs.checkpoints.manifest_problem), for a checkpoint named explicitly (export --tag)."""
    problem = manifest_problem(path, meta)
    if problem:
        raise NodeInputError(f"{problem}. Fix: delete {path} and remove or edit {path.parent / LATEST} so "
                             "training resumes from an earlier complete checkpoint.")


def needs_universal(meta: dict[str, Any], dp: int, pp: int, tp: int) -> bool:
    """True when the data-parallel size changed and the optimizer state is partitioned (ZeRO >= 1)."""
    if int(meta.get("pp", 1)) != pp or int(meta.get("tp", 1)) != tp:
        raise NodeInputError(
            f"checkpoint {meta.get('tag')} was written with pp={meta.get('pp', 1)} tp={meta.get('tp', 1)}, this run "
            f"has pp={pp} tp={tp}: DeepSpeed cannot convert across pipeline/tensor layouts. Fix: resume with "
            f"[parallel] pp={meta.get('pp', 1)} tp={meta.get('tp', 1)}, or start a new run from the exported model.")
    return int(meta.get("dp", dp)) != dp and int(meta.get("zero", 0)) >= 1


def check_adapters(point: ResumePoint, adapters: bool) -> None:
    """A LoRA checkpoint (adapters only) resumes a LoRA run only, and a full one a full fine-tune only."""
    theirs = bool(point.meta.get("adapters"))
    if theirs != adapters:
        raise NodeInputError(
            f"{point.path}: written by a {'LoRA' if theirs else 'full fine-tune'} run, and this run is "
            f"{'LoRA (lora.r > 0)' if adapters else 'a full fine-tune (lora.r = 0)'}. Fix: resume with the [lora] "
            "section the checkpoint was written with, or start a new run (from the exported model).")


# ------------------------------------------------------------------------------------------- saving
@dataclass
class SaveStats:
    """What one save cost. Async: write_s/bytes are filled when the background write completes."""

    step: int
    mode: str  # "sync" | "async"
    blocking_s: float  # what the training loop waited
    write_s: float | None = None  # save start -> checkpoint complete (rank 0: finalised)
    bytes: int | None = None  # the whole checkpoint (all ranks' files), rank 0 only
    previous: SaveStats | None = None  # the earlier async write this save waited for, if not yet reported

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl fields of a completed write."""
        gbps = self.bytes / self.write_s / 1e9 if self.bytes and self.write_s else None
        return {"ckpt_step": self.step, "ckpt_mode": self.mode, "ckpt_write_s": self.write_s,
                "ckpt_bytes": self.bytes, "ckpt_gbps": gbps}


def save(engine: Any, ckpt_dir: Path, step: int, client_state: dict[str, Any], meta: dict[str, Any],
         keep: int, midway: Any = None, *, io: Any = None, wait: bool = True) -> SaveStats:
    """Collective: every rank calls it. `midway()` (fault-injection tests) runs once this rank's shards
    are written and before the checkpoint counts as complete.

    `io` is the engine's `ckpt_async.CheckpointIO` (installed by the Checkpointer). Without it, or in its
    synchronous mode, the checkpoint is complete when save returns. In async mode save returns once the
    state is copied to host memory; the writer threads finish it, and `wait=True` (the final save, a save
    on a signal) waits for that too. A pending write is always waited for first: one at a time."""
    import torch.distributed as dist

    t0 = time.time()
    rank = dist.get_rank()
    previous = drain(io) if io is not None else None
    tmp_tag = f".tmp-step-{step}"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(ckpt_dir / tmp_tag, ignore_errors=True)  # leftover of a crash mid-save
    dist.barrier()
    tmp = ckpt_dir / tmp_tag
    if io is not None:
        io.begin(step, tmp)
    # LoRA (meta "adapters"): the adapters and their optimizer state only; the frozen base is [model] path.
    lora = {"exclude_frozen_parameters": True} if meta.get("adapters") else {}
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state=client_state, save_latest=False, **lora)
    rng_path = tmp / f"rng-rank-{rank}.pt"
    if io is not None:
        io.save(_rng_state(), str(rng_path))
    else:
        write_file(_rng_state(), rng_path)
    if io is not None and io.async_mode:
        finalize = (lambda: _finish(ckpt_dir, tmp_tag, step, meta, keep)) if rank == 0 else None
        job = io.seal(finalize, midway)
        stats = SaveStats(step, "async", time.time() - t0, previous=previous)
        if wait:
            drain(io)
            stats.write_s, stats.bytes = job.write_s, job.total_bytes or None
            dist.barrier()  # rank 0 has finalised: the checkpoint is complete on every rank's return
            stats.blocking_s = time.time() - t0
        return stats
    if midway is not None:
        midway()
    dist.barrier()  # every rank's shards are on disk before the folder counts as complete
    total = _finish(ckpt_dir, tmp_tag, step, meta, keep) if rank == 0 else None
    dist.barrier()
    if io is not None:
        io.end_sync()
    secs = time.time() - t0
    return SaveStats(step, "sync", secs, secs, total, previous=previous)


def estimate_state_bytes(n_params: int, dp: int, zero: int, precision: str) -> int:
    """Rough size of one rank's checkpoint files: Adam's fp32 master + m + v (12 B/param, split over dp
    for ZeRO >= 1) plus the 16/32-bit weights (whole on a ZeRO 0-2 rank, split for ZeRO-3)."""
    weight = 4 if precision == "fp32" else 2
    optim = 12 * n_params // (dp if zero >= 1 else 1)
    weights = weight * n_params // (dp if zero == 3 else 1)
    return optim + weights


def choose_async(setting: bool | str, use_gpu: bool, rank_bytes: int, ranks_per_node: int,
                 avail_bytes: int | None, *, scheduled: bool = True) -> tuple[bool, str]:
    """Whether to save in the background, and why (for the run's log). `scheduled`: the run saves by steps,
    minutes or at its end (else only on a signal, a save that training waits for anyway)."""
    if setting is True or setting is False:
        return bool(setting), f"[checkpoint] async_save = {str(setting).lower()}"
    if not scheduled:
        return False, ("async_save = auto: no save is scheduled (every_steps and every_minutes are 0, no final "
                       "save), and a save on a signal waits for its write anyway")
    need = rank_bytes * ranks_per_node
    if not use_gpu:
        return False, ("async_save = auto: CPU ranks save synchronously (their state already lives in host "
                       "memory; set async_save = true to snapshot it anyway)")
    if avail_bytes is None:
        return False, "async_save = auto: free host memory unknown (no /proc/meminfo), saving synchronously"
    verdict = "fits in" if need <= avail_bytes // 2 else "exceeds"
    why = (f"async_save = auto: the host snapshot (~{need / 1e9:.1f} GB for {ranks_per_node} rank(s) on this "
           f"node) {verdict} half the free host memory ({avail_bytes / 1e9:.1f} GB)")
    return verdict == "fits in", why


def host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def drain(io: Any) -> SaveStats | None:
    """Collective: wait for this rank's pending background write; every rank learns whether all
    succeeded, and a failure is raised on every rank (the failing one with its reason)."""
    job = io.wait()
    error = job.error if job is not None else None
    if not agree(error is None):
        if isinstance(error, Exception):
            raise error
        raise OtherRankFailed()
    if job is None or job.reported:
        return None
    job.reported = True
    return SaveStats(job.step, "async", 0.0, job.write_s, job.total_bytes or None)


WRITEBACK = 256 << 20
_CRC_LOCK = threading.Lock()


class _Sink:
    """What torch.save writes into: unbuffered os.write (the GIL is released while the kernel copies),
    and every WRITEBACK bytes the kernel is told to start writing the pages out (POSIX_FADV_DONTNEED
    starts writeback of dirty pages and drops clean ones). Without it the page cache holds up to
    dirty_background_ratio of RAM (~12 GB on a 128 GB host) before any writeback starts, and the final
    fsync then writes most of the checkpoint at disk speed after the copy instead of during it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0
        self.hinted = 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        off = 0
        while off < len(mv):
            off += os.write(self.fd, mv[off:off + (1 << 30)])
        self.pos += off
        if self.pos - self.hinted >= WRITEBACK and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.hinted, self.pos - self.hinted, os.POSIX_FADV_DONTNEED)
            self.hinted = self.pos
        return off

    def flush(self) -> None:
        pass


def write_file(state: Any, path: Path) -> int:
    """torch.save's file (zip format, as DeepSpeed writes and loads it), fsynced; returns its size.
    Tensor bytes are written by parallel threads (node/checkpointing/ckpt_write.py); one thread when that declines."""
    from hpctrain.node.checkpointing.ckpt_write import write_parallel

    size = write_parallel(state, path)
    return size if size is not None else write_serial(state, path)


def write_serial(state: Any, path: Path) -> int:
    """torch.save through one thread + fsync; returns the file's size."""
    import torch

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        sink = _Sink(fd)
        # No CRC32 per record: it halves the write speed of one core (1.8 -> 0.6-1.0 GB/s measured here),
        # and torch.load does not check it. Partial files are caught by the manifest's sizes and the
        # zip directory check (validate_files). The option is global: restored right after.
        with _CRC_LOCK:
            crc = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            try:
                torch.save(state, sink)
            finally:
                torch.serialization.set_crc32_options(crc)
        os.fsync(fd)
    finally:
        os.close(fd)
    return sink.pos


def _finish(ckpt_dir: Path, tmp_tag: str, step: int, meta: dict[str, Any], keep: int) -> int:
    """Rank 0, once every rank's files are on disk: manifest marker, rename, `latest`, prune.
    Returns the checkpoint's size in bytes."""
    tmp = ckpt_dir / tmp_tag
    shutil.rmtree(tmp / ".done", ignore_errors=True)  # the async writers' per-rank markers
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    _fsync_tree(tmp)  # files DeepSpeed wrote itself (zero_to_fp32.py) and the folders' entries
    _write_atomic(tmp / MARKER, json.dumps({**meta, "step": step, "tag": f"step-{step}", "time": time.time(),
                                            "files": files}, indent=1) + "\n")
    final = ckpt_dir / f"step-{step}"
    if final.exists():  # same step saved again (e.g. after a resume): the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(ckpt_dir)
    _write_atomic(ckpt_dir / LATEST, f"step-{step}\n")
    fsync_path(ckpt_dir)
    prune(ckpt_dir, keep)
    return sum(files.values())


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        fsync_path(p)
    fsync_path(root)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and their universal copies."""
    steps = complete_steps(ckpt_dir)
    for s in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(ckpt_dir / f"step-{s}", ignore_errors=True)
        shutil.rmtree(ckpt_dir / f"universal-step-{s}", ignore_errors=True)
    for p in ckpt_dir.glob(".tmp-*"):
        if p.is_dir() and not any(p.name == f".tmp-step-{s}" for s in steps):
            shutil.rmtree(p, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng(path: Path) -> bool:
    """Restore this rank's RNG states; False when the file is absent (e.g. a new world size)."""
    import random

    import numpy as np
    import torch

    if not path.is_file():
        return False
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


# ------------------------------------------------------------------------------------------- universal
def convert_universal(ckpt_dir: Path, tag: str, zero: int) -> str:
    """ds_to_universal on step-N -> universal-step-N (rank 0 only; the caller barriers). Returns the tag."""
    out_tag = f"universal-{tag}"
    final = ckpt_dir / out_tag
    if (final / MARKER).is_file():
        return out_tag
    tmp = ckpt_dir / f".tmp-{out_tag}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt_dir / tag),
           "--output_folder", str(tmp), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    if zero <= 2:
        cmd.append("--inject_missing_state")  # ZeRO-1/2 checkpoints lack universal_checkpoint_info
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    (ckpt_dir / "latest_universal").unlink(missing_ok=True)  # the script writes it; our pointer is `latest`
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise NodeInputError(f"{ckpt_dir / tag}: cannot convert to a universal checkpoint for the new world size "
                             f"(ds_to_universal failed):\n{tail}\nFix: resume with the original number of ranks.")
    # The converter copies the model-states files (client state: step, data cursor) into the output.
    _write_atomic(tmp / MARKER, json.dumps({"source": tag, "time": time.time()}) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return out_tag
