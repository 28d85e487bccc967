"""Which checkpoints of a run folder count, and which one a resume starts from: the one rule the node's trainer,
`hpctrain.runtime`, the collector and the supervisor share.

    checkpoints/step-N/hpctrain.json  the completion marker (with a manifest of file sizes), written last
                                      into the folder, after every rank's files are fsynced
    checkpoints/latest                text "step-N", replaced atomically after the marker

A `step-N` folder without its marker is a save that did not finish (a crash mid-write): it never counts.

The resume rule (`choose_resume`): `latest` first, when it names a `step-N` folder of this run whose marker is
readable and whose files match their manifest (a user may write an older step there to go back to it); else the
newest such checkpoint. Every checkpoint passed over is reported with its reason, for the caller's log. When
checkpoints were marked complete but none of them is whole, there is no answer (`refused`): training must not
start again from step 0 over a run's damaged checkpoints without a person deciding so. Stdlib only.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = "hpctrain.json"
LATEST = "latest"
STEP_RE = re.compile(r"step-(\d+)")  # used with fullmatch: `$` also matches before a final newline


def step_tag(step: int) -> str:
    return f"step-{step}"


def is_complete(path: Path) -> bool:
    """A checkpoint folder whose save finished: its marker is there."""
    return (path / MARKER).is_file()


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the complete `step-N` checkpoints, ascending; [] when the folder is missing or unreadable."""
    try:
        entries = list(ckpt_dir.iterdir())
    except OSError:
        return []
    steps = []
    for p in entries:
        m = STEP_RE.fullmatch(p.name)
        if m and is_complete(p):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag `latest` names (not checked), or None without a `latest` file."""
    try:
        return (ckpt_dir / LATEST).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


# ------------------------------------------------------------------------------------------- the resume rule
@dataclass(frozen=True)
class Checkpoint:
    """A whole checkpoint: `folder` is checkpoints/step-N (its marker's), `files` where its files are (the
    marker's `path` for a checkpoint saved elsewhere, e.g. HF Trainer's checkpoint-N; else `folder`)."""

    step: int
    folder: Path
    files: Path
    meta: dict[str, Any] = field(compare=False)

    @property
    def tag(self) -> str:
        return step_tag(self.step)


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint to resume from (None: start from step 0) and why others were passed over."""

    checkpoint: Checkpoint | None
    skipped: tuple[str, ...] = ()  # one line per candidate passed over, in the order they were tried
    refused: str | None = None  # set when marked checkpoints exist and none is whole: a message with its fix

    @property
    def step(self) -> int | None:
        return self.checkpoint.step if self.checkpoint else None


class UnusableCheckpoints(ValueError):
    """Every checkpoint marked complete is damaged: resuming needs a person's decision (the message says which)."""


def decide(latest: str | None, marked: list[int], problem: Callable[[int], str | None]) -> tuple[int | None, list[str]]:
    """The pure rule: (step to resume from or None, reasons for the candidates passed over).

    `latest` is the text of the `latest` file (None without one), `marked` the steps with a marker, `problem(step)`
    why that checkpoint is not whole (None when it is). It is asked lazily, in the order the candidates are tried."""
    skipped: list[str] = []
    order = sorted(set(marked), reverse=True)
    if latest is not None:
        m = STEP_RE.fullmatch(latest)
        if m is None:
            skipped.append(f"`latest` names {latest!r}, not a step-N folder of this run")
        elif int(m.group(1)) not in order:
            skipped.append(f"`latest` names {latest}, which is missing or incomplete (no {MARKER})")
        else:
            order.remove(int(m.group(1)))
            order.insert(0, int(m.group(1)))
    for step in order:
        why = problem(step)
        if why is None:
            return step, skipped
        skipped.append(f"{step_tag(step)}: {why}")
    return None, skipped


def choose_resume(ckpt_dir: Path) -> ResumeChoice:
    """The checkpoint a resume starts from, by the rule in this module's docstring. Never raises."""
    checked: dict[int, Checkpoint | str] = {}

    def problem(step: int) -> str | None:
        found = _check(ckpt_dir / step_tag(step), step)
        checked[step] = found
        return found if isinstance(found, str) else None

    marked = complete_steps(ckpt_dir)
    step, skipped = decide(latest_tag(ckpt_dir), marked, problem)
    if step is not None:
        point = checked[step]
        assert isinstance(point, Checkpoint)
        return ResumeChoice(point, tuple(skipped))
    refused = None
    if marked:
        refused = (f"{ckpt_dir}: no checkpoint there is whole (" + "; ".join(skipped) + "). Fix: restore a "
                   "checkpoint from a backup, or delete the damaged step-N folders and `latest` to start again "
                   "from step 0.")
    return ResumeChoice(None, tuple(skipped), refused)


def resume_point(ckpt_dir: Path) -> Checkpoint | None:
    """choose_resume's checkpoint; raises UnusableCheckpoints where it refused."""
    choice = choose_resume(ckpt_dir)
    if choice.refused:
        raise UnusableCheckpoints(choice.refused)
    return choice.checkpoint


def read_marker(folder: Path) -> dict[str, Any]:
    """The marker's fields, its "step" an int (taken from the folder's name `step-N` when the marker has none);
    OSError, ValueError, KeyError or TypeError naming what is wrong when it is unreadable."""
    meta = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    if not isinstance(meta, dict):
        raise TypeError("not a JSON object")
    if "step" in meta:
        return {**meta, "step": int(meta["step"])}
    named = STEP_RE.fullmatch(folder.name)
    if named is None:
        raise KeyError("step")
    return {**meta, "step": int(named.group(1))}


def manifest_problem(files: Path, meta: dict[str, Any]) -> str | None:
    """Why the files under `files` do not match the marker's manifest (None when each is there with its recorded
    size, and a torch file's zip index is readable)."""
    manifest = meta.get("files", {})
    if not isinstance(manifest, dict):
        return f"its marker's manifest is not a mapping ({type(manifest).__name__})"
    for rel, size in manifest.items():
        f = files / rel
        if not f.is_file():
            return f"checkpoint file {f} is missing"
        if f.stat().st_size != size:
            return f"checkpoint file {f} has {f.stat().st_size} bytes, expected {size} (partial write?)"
        if f.suffix == ".pt" and not _zip_ok(f):
            return f"checkpoint file {f} is not a readable torch file"
    return None


def _check(folder: Path, step: int) -> Checkpoint | str:
    """The checkpoint in `folder`, or why it is not whole."""
    try:
        meta = read_marker(folder)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable marker {folder / MARKER} ({exc})"
    if int(meta["step"]) != step:
        return f"its marker says step {meta['step']}"
    files = Path(meta["path"]) if isinstance(meta.get("path"), str) and meta["path"] else folder
    if not files.is_dir():
        return f"its files' folder {files} is missing"
    try:
        why = manifest_problem(files, meta)
    except (OSError, TypeError) as exc:
        why = f"its files cannot be checked ({exc})"
    return why if why is not None else Checkpoint(step, folder, files, meta)


def _zip_ok(f: Path) -> bool:
    try:
        with zipfile.ZipFile(f) as z:  # torch.save format: reads only the central directory at the end
            return bool(z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False
