"""Rebuild the run registry from the run folders on disk.

The registry is an index; the run folders are the record (hpctrain.runs.folder: spec.toml, plan.json,
attempts.jsonl, submitit/<job id>_submitted.pkl). So a registry file that is empty, truncated or no
database at all is moved aside and rebuilt from them, automatically on first use, and on demand with
`hpctrain registry rebuild` (which also adds folders a healthy registry lacks, keeping every row).
"""

from __future__ import annotations

import fcntl
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import tomllib

from hpctrain.runs import folder as runs_mod
from hpctrain.runs.schema import damage

# (run row, [attempt rows]) as plain dicts: hpctrain.runs.registry builds its records from them.
Item = tuple[dict[str, Any], list[dict[str, Any]]]


class Index(Protocol):
    """What a rebuild needs of the registry (hpctrain.runs.registry.Registry)."""

    path: Path

    def import_runs(self, items: list[Item], skipped: list[str] | None = None) -> int: ...

_PICKLE_ID = re.compile(r"(\d+(?:_\d+)?)_submitted\.pkl")


def rebuild_registry(reg: Index, reason: str | None = None, runs_dirs: list[Path] | None = None) -> list[str]:
    """Make `reg` usable again and index every run folder under `runs_dirs` (default: the runs dir).

    `reason` set: called because the file looked damaged; re-checked under a lock, so of several
    processes that saw it only the first moves it aside. Returns what was done, for the user."""
    dirs = runs_dirs or [runs_mod.runs_dir_default()]
    reg.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(reg.path):
        problem = damage(reg.path)
        if reason is not None and problem is None:
            return []  # another process has rebuilt it meanwhile
        notes = []
        if problem is not None:
            aside = _move_aside(reg.path)
            notes.append(f"the run registry {reg.path} was unusable ({problem}); moved it to {aside}")
        items: list[Item] = []
        skipped: list[str] = []
        for d in dirs:
            found, bad = scan_checked(d)
            items += found
            skipped += bad
        added = reg.import_runs(items, skipped)
    where = ", ".join(str(d) for d in dirs)
    notes.append(f"rebuilt the run registry from the run folders in {where}: {added} run(s) added, "
                 f"{len(items) - added} already known")
    notes += skipped
    return notes


@contextmanager
def _locked(db: Path) -> Iterator[None]:
    with open(db.with_name(db.name + ".rebuild.lock"), "a", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _move_aside(db: Path) -> Path:
    """db -> db.damaged-<time> (with its -wal/-shm: a stale WAL must not meet the new file)."""
    aside = db.with_name(f"{db.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}")
    for suffix in ("", "-wal", "-shm"):
        src = db.with_name(db.name + suffix)
        if src.exists():
            src.rename(aside.with_name(aside.name + suffix))
    return aside


def scan(runs_dir: Path) -> list[Item]:
    """(run, attempts) for every submitted run folder directly under `runs_dir`, oldest first.
    A folder with neither attempts.jsonl lines nor submitit job files was never queued: skipped."""
    return scan_checked(runs_dir)[0]


def scan_checked(runs_dir: Path) -> tuple[list[Item], list[str]]:
    """`scan`, and a line naming each folder that could not be read (skipped: one damaged folder never
    stops the rebuild of the others)."""
    try:
        entries = sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []
    except OSError as exc:
        return [], [f"skipped the runs folder {runs_dir}: {exc}"]
    out, skipped = [], []
    for d in entries:
        try:
            if d.name.startswith(".") or not runs_mod.RunFolder(d).spec_toml.is_file():
                continue
            item = read_run_folder(d.absolute())
        except Exception as exc:  # noqa: BLE001 - whatever one folder holds, the others are still indexed
            skipped.append(f"skipped the damaged run folder {d}: {type(exc).__name__}: {exc}")
            continue
        if item is not None:
            out.append(item)
    return sorted(out, key=lambda it: it[0]["created"]), skipped


def read_run_folder(d: Path) -> Item | None:
    """What the registry held about one run, from its folder alone."""
    folder = runs_mod.RunFolder(d)
    merged: dict[int, dict[str, Any]] = {}
    for line in folder.read_attempts():  # a submission line, then state lines: later ones win
        number = line.get("attempt")
        if isinstance(number, int) and not isinstance(number, bool) and 0 <= number <= MAX_ATTEMPT:
            merged.setdefault(number, {}).update(line)
    if not merged:
        ids = sorted((m.group(1) for p in runs_mod.RunFolder(d).submitit_dir.glob("*_submitted.pkl")
                      if (m := _PICKLE_ID.fullmatch(p.name))), key=_id_key)
        merged = {i: {"job_id": j, "executor": "slurm"} for i, j in enumerate(ids)}
    if not merged:
        return None
    first = merged[min(merged)]
    created = _float(first.get("submitted")) or d.stat().st_mtime
    attempts = [{"run_id": d.name, "attempt": i, "job_id": _str(a.get("job_id") or "") or "",
                 "state": _str(a.get("state") or "PENDING") or "PENDING", "nodes": _str(a.get("nodes") or "") or "",
                 "submitted": _float(a.get("submitted")) or created, "started": _float(a.get("started")),
                 "ended": _float(a.get("ended")), "exit_code": _str(a.get("exit_code")),
                 "failure_class": _str(a.get("failure_class")), "note": _str(a.get("note")), "tag": _str(a.get("tag"))}
                for i, a in sorted(merged.items())]
    run = {"run_id": d.name, "name": _name(d), "folder": str(d),
           "executor": _str(first.get("executor", "slurm")) or "slurm",
           "created": created, "spec": _summary(d, str(first.get("mode", "train")))}
    return run, attempts


def _id_key(job_id: str) -> tuple[int, int]:
    main, _, task = job_id.partition("_")
    return int(main), int(task or 0)


# Every value read from a run folder is bounded before it reaches SQLite (a hand-edited or damaged
# attempts.jsonl: an attempt number of 10**30 raised OverflowError in the INSERT and stopped the whole rebuild).
MAX_ATTEMPT = 1_000_000  # attempt numbers: far beyond any retry count; an INTEGER for SQLite
MAX_TIME = 1e11  # seconds since 1970 (the year 5138): a submitted/started/ended time
MAX_TEXT = 4096  # characters kept of a text field (job id, state, nodes, note, ...)


def _str(v: Any) -> str | None:
    return None if v is None else str(v)[:MAX_TEXT]


def _float(v: Any) -> float | None:
    """A time from the folder, or None when it is no number or out of range (negative, NaN, 1e400)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if 0 <= f <= MAX_TIME else None


def _name(d: Path) -> str:
    try:
        return str(tomllib.loads(runs_mod.RunFolder(d).spec_toml.read_text(encoding="utf-8")).get("name") or d.name)
    except (OSError, ValueError):
        return d.name


def _summary(d: Path, mode: str) -> dict[str, Any]:
    """The list/status columns that plan.json and spec.toml give; marked as rebuilt."""
    out: dict[str, Any] = {"mode": mode, "rebuilt": True}
    try:
        plan = json.loads(runs_mod.RunFolder(d).plan_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return out
    if isinstance(plan, dict):
        out.update({k: plan[k] for k in ("nodes", "ranks_per_node", "world_size", "micro_batch", "global_batch")
                    if k in plan})
    return out
