"""Checkpoints that survive a crash at any instant, automatic resume, universal conversion.

Layout under RUN/checkpoints/:
    .tmp-step-N/          DeepSpeed writes here first (every rank), plus rng-rank-R.pt per rank
    step-N/               renamed by rank 0 after a barrier, once every rank has written
    step-N/hpctrain.json  the completion marker: step, world/dp/pp, zero stage, file sizes (manifest)
    latest                text "step-N", replaced atomically, written last
    universal-step-N/     DeepSpeed universal checkpoint, made on demand when the DP size changed
Only folders with a marker count; a crash mid-save leaves a .tmp-* folder that is ignored and removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.node.runconf import NodeInputError

MARKER = "hpctrain.json"
STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class ResumePoint:
    tag: str  # "step-N"
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


# ------------------------------------------------------------------------------------------- finding
def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (marker present), ascending."""
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / MARKER).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def find_resume(ckpt_dir: Path) -> ResumePoint | None:
    """The checkpoint to resume from: the one `latest` names (validated), else the newest complete one."""
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        path = ckpt_dir / tag
        if not (path / MARKER).is_file():
            raise NodeInputError(
                f"{latest} names {tag!r} but {path} is missing or incomplete (no {MARKER}). Fix: delete {latest} "
                f"to resume from the newest complete checkpoint, or write an existing step-N folder name into it.")
    else:
        steps = complete_steps(ckpt_dir)
        if not steps:
            return None
        tag = f"step-{steps[-1]}"
        path = ckpt_dir / tag
    meta = read_marker(path)
    validate_files(path, meta)
    return ResumePoint(tag, path, meta)


def read_marker(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / MARKER).read_text())
        int(meta["step"])
        return dict(meta)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NodeInputError(f"{path / MARKER}: unreadable checkpoint marker ({exc}). Fix: delete {path} (training "
                             "resumes from the previous complete checkpoint) or restore it from a backup.") from exc


def validate_files(path: Path, meta: dict[str, Any]) -> None:
    """Every file in the manifest exists with its recorded size, and torch files have a readable index."""
    for rel, size in dict(meta.get("files", {})).items():
        f = path / rel
        problem = ""
        if not f.is_file():
            problem = "is missing"
        elif f.stat().st_size != size:
            problem = f"has {f.stat().st_size} bytes, expected {size} (partial write?)"
        elif f.suffix == ".pt" and not _zip_ok(f):
            problem = "is not a readable torch file"
        if problem:
            raise NodeInputError(f"checkpoint file {f} {problem}. Fix: delete {path} and remove or edit "
                                 f"{path.parent / 'latest'} so training resumes from an earlier complete checkpoint.")


def _zip_ok(f: Path) -> bool:
    try:
        with zipfile.ZipFile(f) as z:  # torch.save format: reads only the central directory at the end
            return bool(z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def needs_universal(meta: dict[str, Any], dp: int, pp: int, tp: int) -> bool:
    """True when the data-parallel size changed and the optimizer state is partitioned (ZeRO >= 1)."""
    if int(meta.get("pp", 1)) != pp or int(meta.get("tp", 1)) != tp:
        raise NodeInputError(
            f"checkpoint {meta.get('tag')} was written with pp={meta.get('pp', 1)} tp={meta.get('tp', 1)}, this run "
            f"has pp={pp} tp={tp}: DeepSpeed cannot convert across pipeline/tensor layouts. Fix: resume with "
            f"[parallel] pp={meta.get('pp', 1)} tp={meta.get('tp', 1)}, or start a new run from the exported model.")
    return int(meta.get("dp", dp)) != dp and int(meta.get("zero", 0)) >= 1


# ------------------------------------------------------------------------------------------- saving
def save(engine: Any, ckpt_dir: Path, step: int, client_state: dict[str, Any], meta: dict[str, Any],
         keep: int, midway: Any = None) -> float:
    """Collective: every rank calls it. Returns the seconds it took. `midway()` (fault-injection tests)
    runs once the shards are written and before the checkpoint counts as complete."""
    import torch.distributed as dist

    t0 = time.time()
    rank = dist.get_rank()
    tmp_tag = f".tmp-step-{step}"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(ckpt_dir / tmp_tag, ignore_errors=True)  # leftover of a crash mid-save
    dist.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state=client_state, save_latest=False)
    _save_rng(ckpt_dir / tmp_tag / f"rng-rank-{rank}.pt")
    if midway is not None:
        midway()
    dist.barrier()  # every rank's shards are on disk before the folder counts as complete
    if rank == 0:
        _finish(ckpt_dir, tmp_tag, step, meta)
        prune(ckpt_dir, keep)
    dist.barrier()
    return time.time() - t0


def _finish(ckpt_dir: Path, tmp_tag: str, step: int, meta: dict[str, Any]) -> None:
    tmp = ckpt_dir / tmp_tag
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    _write_atomic(tmp / MARKER, json.dumps({**meta, "step": step, "tag": f"step-{step}", "time": time.time(),
                                            "files": files}, indent=1) + "\n")
    final = ckpt_dir / f"step-{step}"
    if final.exists():  # same step saved again (e.g. after a resume): the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(ckpt_dir / "latest", f"step-{step}\n")


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


def _save_rng(path: Path) -> None:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, path)


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
