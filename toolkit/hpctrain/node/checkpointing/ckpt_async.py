"""The checkpoint writer: DeepSpeed's checkpoint engine replaced by one that writes in the background.

DeepSpeed's `engine.save_checkpoint` hands every file it writes to `engine.checkpoint_engine.save(state,
path)`. `CheckpointIO` takes that place (`install`). In synchronous mode save() torch.saves and fsyncs
the file at once. In asynchronous mode save() copies every tensor of the state into host buffers (pinned
on GPU ranks, kept and reused across saves: pinning 15 GB takes seconds) and queues (copy, path) for a
writer thread; training goes on once the copies are done. The writer torch.saves each file (the format
DeepSpeed's own load path reads), fsyncs it, and when the rank's files are down writes
`.done/rank-R` in the checkpoint folder. Rank 0's writer then waits for every rank's marker and runs the
finalisation (marker, rename, `latest`, prune). The filesystem is the only channel between the writers:
a collective from a second thread can deadlock against the training loop's own collectives.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from hpctrain.node.checkpointing.checkpoint import fsync_path, write_file
from hpctrain.node.model.pinned import pin_in_place

DONE_DIR = ".done"
CHUNK = 64 << 20  # smallest host buffer allocated at once
ALIGN = 4096


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed or did not finish in time."""


@dataclass
class Job:
    """One checkpoint being written by this rank."""

    step: int
    tmp: Path  # .tmp-step-N
    world: int
    rank: int
    started: float
    finalize: Callable[[], int] | None = None  # rank 0: marker, rename, latest, prune; returns total bytes
    midway: Callable[[], None] | None = None
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    total_bytes: int = 0
    write_s: float = 0.0
    error: BaseException | None = None
    reported: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Arena:
    """Host memory for snapshots: chunks kept across saves, handed out in order, reset per checkpoint."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.chunks: list[Any] = []  # numpy views of uint8 tensors (torch.frombuffer needs a buffer)
        self._keep: list[torch.Tensor] = []
        self.i = 0
        self.off = 0
        self._reserving: threading.Thread | None = None

    def reserve(self, nbytes: int) -> None:
        """Allocate (and on GPU ranks page-lock) one chunk of `nbytes` in the background, so that the first
        save copies into ready memory instead of allocating and pinning ~15 GB while training waits."""
        if nbytes <= 0 or self.chunks or self._reserving is not None:
            return
        device = torch.cuda.current_device() if self.pin and torch.cuda.is_available() else None

        def run() -> None:
            if device is not None:
                torch.cuda.set_device(device)
            t = self._alloc((nbytes + ALIGN - 1) // ALIGN * ALIGN)
            self._keep.append(t)
            self.chunks.append(t.numpy())

        self._reserving = threading.Thread(target=run, name="hpctrain-ckpt-reserve", daemon=True)
        self._reserving.start()

    def _ready(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def reset(self) -> None:
        self.i, self.off = 0, 0

    @property
    def capacity(self) -> int:
        self._ready()
        return sum(len(c) for c in self.chunks)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly nbytes whose storage is its own (torch.save writes whole storages)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        self._ready()
        size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        while self.i < len(self.chunks) and self.off + size > len(self.chunks[self.i]):
            self.i, self.off = self.i + 1, 0
        if self.i == len(self.chunks):
            t = self._alloc(max(size, CHUNK))
            self._keep.append(t)
            self.chunks.append(t.numpy())
        out = torch.frombuffer(self.chunks[self.i], dtype=torch.uint8, count=nbytes, offset=self.off)
        self.off += size
        return out


    def _alloc(self, n: int) -> torch.Tensor:
        """n bytes of host memory, page-locked on GPU ranks so device-to-host copies run at full speed.

        Registered with cudaHostRegister at its exact size: torch's pinned allocator (pin_memory=True)
        rounds each request up to a power of two, i.e. up to 1.7x the checkpoint in locked memory."""
        t = torch.empty(n, dtype=torch.uint8)
        if not self.pin or pin_in_place(t):
            return t
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)  # registration refused: torch's allocator


def snapshot(obj: Any, arena: Arena, memo: dict[Any, Any]) -> Any:
    """A copy of a state dict whose tensors live in `arena`; storages shared in `obj` stay shared.

    Containers (dict, list, tuple) are copied; other objects (numbers, strings, DeepSpeed's config) are
    kept by reference: they do not change during training."""
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, arena, memo)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and attributes such as state_dict()._metadata
        for k, v in obj.items():
            out[k] = snapshot(v, arena, memo)
        return out
    if type(obj) is list:
        return [snapshot(v, arena, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [snapshot(v, arena, memo) for v in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def _copy_tensor(t: torch.Tensor, arena: Arena, memo: dict[Any, Any]) -> torch.Tensor:
    if t.device.type == "meta":
        return t
    st = t.untyped_storage()
    key = (str(t.device), st.data_ptr(), st.nbytes())
    dst = memo.get(key)
    if dst is None:
        buf = arena.take(st.nbytes())
        if st.nbytes():
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
            buf.copy_(src, non_blocking=t.device.type != "cpu")
        dst = memo[key] = buf.untyped_storage()
    out = torch.empty(0, dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def wait_markers(tmp: Path, world: int, deadline: float) -> None:
    """Rank 0's writer: every rank's `.done/rank-R` exists (a `rank-R.failed` ends the wait at once)."""
    d = tmp / DONE_DIR
    while True:
        names = set(os.listdir(d)) if d.is_dir() else set()
        failed = sorted(n for n in names if n.endswith(".failed"))
        if failed:
            why = (d / failed[0]).read_text().strip()
            raise CheckpointWriteError(f"{tmp}: {failed[0].removesuffix('.failed')} could not write its files: {why}")
        missing = [r for r in range(world) if f"rank-{r}" not in names]
        if not missing:
            return
        if time.time() > deadline:
            raise CheckpointWriteError(
                f"{tmp}: ranks {missing} did not report their files written within the time limit "
                f"(HPCTRAIN_CKPT_WAIT_S). Their logs say why; the previous complete checkpoint stays the "
                "resume point.")
        time.sleep(0.05)


def _marker(tmp: Path, name: str, text: str) -> None:
    d = tmp / DONE_DIR
    d.mkdir(exist_ok=True)
    part = d / f".{name}.part"
    with open(part, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, d / name)
    fsync_path(d)


class CheckpointIO(TorchCheckpointEngine):  # type: ignore[misc]
    """DeepSpeed checkpoint engine: files go to disk at once (sync) or through the writer thread (async).

    Loading is TorchCheckpointEngine's (torch.load), so the files load through the normal path."""

    def __init__(self, config_params: Any, *, async_mode: bool, pin: bool, rank: int, world: int,
                 wait_s: float) -> None:
        super().__init__(config_params)
        self.name = "hpctrain"
        self.async_mode = async_mode
        self.rank, self.world, self.wait_s = rank, world, wait_s
        self.arena = Arena(pin)
        self.job: Job | None = None
        self.blocking_copy_s = 0.0
        self._q: queue.Queue[tuple[str, Job, Any, Path | None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        # Test hook: HPCTRAIN_CKPT_WRITE_DELAY_S slows each background file write (a crash mid-write).
        self.delay_s = float(os.environ.get("HPCTRAIN_CKPT_WRITE_DELAY_S", "0") or 0)

    # ----- DeepSpeed's interface
    def create(self, info: Any) -> None:
        pass

    def commit(self, info: Any) -> bool:
        return True

    def save(self, state_dict: Any, path: str) -> None:
        job = self.job
        if job is None:  # a save outside hpctrain's checkpoint (e.g. save_16bit_model): plain and synchronous
            write_file(state_dict, Path(path))
            return
        if not self.async_mode:
            job.bytes += write_file(state_dict, Path(path))
            job.files.append(Path(path))
            return
        t0 = time.time()
        snap = snapshot(state_dict, self.arena, {})
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are complete before training changes the source tensors
        self.blocking_copy_s += time.time() - t0
        self._q.put(("file", job, snap, Path(path)))

    # ----- hpctrain's side
    def begin(self, step: int, tmp: Path) -> Job:
        if self.job is not None and not self.job.done.is_set():
            raise CheckpointWriteError(f"checkpoint step-{self.job.step} is still being written; wait for it first")
        self.arena.reset()
        self.blocking_copy_s = 0.0
        self.job = Job(step, tmp, self.world, self.rank, time.time())
        if self.async_mode and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpctrain-ckpt-writer", daemon=True)
            self._thread.start()
        return self.job

    def seal(self, finalize: Callable[[], int] | None, midway: Callable[[], None] | None) -> Job:
        """Async: queue the end of this rank's part (marker; rank 0 finalises). Returns the job."""
        job = self.job
        assert job is not None
        job.finalize, job.midway = finalize, midway
        self._q.put(("seal", job, None, None))
        return job

    def end_sync(self) -> Job:
        """Sync mode: the files are on disk; forget the job."""
        job = self.job
        assert job is not None
        job.write_s = time.time() - job.started
        job.done.set()
        self.job = None
        return job

    def wait(self) -> Job | None:
        """Block until the pending write is complete (or failed); None when nothing was pending."""
        job = self.job
        if job is None:
            return None
        if not job.done.wait(self.wait_s + 60):
            job.error = CheckpointWriteError(
                f"checkpoint step-{job.step}: the background write did not finish within {self.wait_s:.0f} s "
                f"(rank {self.rank} wrote {len(job.files)} files, {job.bytes / 1e9:.2f} GB, into {job.tmp}). "
                "Fix: check the filesystem (space, quota, a hung mount); raise HPCTRAIN_CKPT_WAIT_S for very "
                "slow storage. The previous complete checkpoint stays the resume point.")
        self.job = None
        return job

    def finished(self) -> Job | None:
        """The pending job, once, when its write has completed without error (no waiting). It stays
        pending for wait(), which reports errors."""
        job = self.job
        if job is not None and job.done.is_set() and job.error is None and not job.reported:
            job.reported = True
            return job
        return None

    def _run(self) -> None:
        while True:
            kind, job, state, path = self._q.get()
            if kind == "seal":
                self._seal(job)  # records any error in the job, sets job.done
                continue
            try:
                if job.error is None and path is not None:
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    job.bytes += write_file(state, path)
                    job.files.append(path)
            except BaseException as exc:  # noqa: BLE001 - reported on the main thread by wait()
                job.error = exc
            del state

    def _seal(self, job: Job) -> None:
        try:
            if job.error is not None:
                raise job.error
            for d in sorted({f.parent for f in job.files} | {job.tmp}):
                fsync_path(d)
            if job.midway is not None:
                job.midway()
            _marker(job.tmp, f"rank-{job.rank}", f"{job.bytes}\n")
            if job.finalize is not None:
                wait_markers(job.tmp, job.world, job.started + self.wait_s)
                job.total_bytes = job.finalize()
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread by wait(); peers see .failed
            job.error = exc
            with contextlib.suppress(OSError):
                _marker(job.tmp, f"rank-{job.rank}.failed", f"{type(exc).__name__}: {exc}\n")
        job.write_s = time.time() - job.started
        job.done.set()


def install(engine: Any, *, async_mode: bool, pin: bool, rank: int, world: int,
            reserve_bytes: int = 0) -> CheckpointIO:
    """Replace the engine's checkpoint engine (before any save; loading is unchanged). Async: host buffers
    for `reserve_bytes` (the rank's estimated checkpoint size) are allocated in the background now."""
    io = CheckpointIO(getattr(engine, "_config", None), async_mode=async_mode, pin=pin, rank=rank, world=world,
                      wait_s=float(os.environ.get("HPCTRAIN_CKPT_WAIT_S", "1800")))
    engine.checkpoint_engine = io
    if async_mode:
        io.arena.reserve(reserve_bytes)
    return io
