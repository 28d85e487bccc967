"""Which checkpoints of a run folder count: the one rule the node, the collector and the supervisor share.

    checkpoints/step-N/hpctrain.json  the completion marker (with a manifest of file sizes), written last
                                      into the folder, after every rank's files are fsynced
    checkpoints/latest                text "step-N", replaced atomically after the marker

A `step-N` folder without its marker is a save that did not finish (a crash mid-write): it never counts.
The node additionally checks the manifest before it resumes (hpctrain.node.checkpoint). Stdlib only.
"""

from __future__ import annotations

import re
from pathlib import Path

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
