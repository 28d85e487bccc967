"""From a run reference, as a user types it after `hpctrain status/logs/summary/resubmit`, to a run.

A reference is `last` (the run created last), or else tried as, in this order: a run id or a unique prefix
of one; a run name (the newest run of that name); a run folder's path (also for runs this registry never
saw: its attempts.jsonl is then the record). Anything else is refused with the close matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import HpcUsageError, check_path
from hpctrain.runs.folder import RunFolder
from hpctrain.runs.registry import Registry, Run, RunNotFound

LAST = "last"
_PICK = "pick a run id from `hpctrain list --all`, `last`, a run name, or the run folder's path"


@dataclass(frozen=True)
class RunRef:
    """A resolved reference: the run folder, and the registry's record when it has one."""

    folder: Path
    run: Run | None  # None: a run folder the registry never saw


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and (RunFolder(path).spec_toml.is_file() or RunFolder(path).attempts_jsonl.is_file())


def resolve_run(reg: Registry, ref: str) -> RunRef:
    """The run `ref` names; HpcUsageError (naming the close matches) when it names none or several."""
    if not ref.strip():
        raise HpcUsageError(f"RUN = {ref!r}: empty run id. Fix: {_PICK}")
    check_path("RUN", ref, _PICK)  # before a lookup stats it as a folder
    if ref == LAST:
        newest = reg.newest()
        if newest is None:
            raise HpcUsageError(f"RUN = {ref!r}: the registry {reg.path} has no runs yet. Fix: submit one first")
        return _found(newest)
    try:
        return _found(reg.get_run(ref))  # the exact id first, then a unique prefix
    except RunNotFound as exc:
        miss = exc
    named = reg.newest(ref)
    if named is not None:
        return _found(named)
    path = Path(ref).expanduser()
    if is_run_folder(path):
        return _registered_folder(reg, path) or RunRef(path.absolute(), None)
    if miss.ambiguous:
        raise HpcUsageError(f"RUN = {ref!r}: matches several runs: {', '.join(miss.close)}. "
                            "Fix: give more of the run id") from None
    hint = f" Close matches: {', '.join(miss.close)}." if miss.close else ""
    raise HpcUsageError(f"RUN = {ref!r}: no such run in {reg.path}.{hint} Fix: {_PICK}") from None


def registered_run(reg: Registry, ref: str) -> Run:
    """The registered run `ref` names, for the commands that need the registry's record (status, list's
    details, the watch, export by id); HpcUsageError naming the folder when `ref` is a run folder the registry
    never saw (summary, logs and sync read such a folder through resolve_run)."""
    found = resolve_run(reg, ref)
    if found.run is None:
        raise HpcUsageError(f"RUN = {ref!r}: the run folder {found.folder} is not in the registry {reg.path}. "
                            f"Fix: name a run that `hpctrain list` shows (`hpctrain summary {found.folder}` reads "
                            "such a folder)")
    return found.run


def _registered_folder(reg: Registry, path: Path) -> RunRef | None:
    """The registry's record of a run folder given by its path (`hpctrain stacks RUN_DIR` refused a registered
    folder as unknown): the run whose id is the folder's name, when its folder is this one."""
    try:
        run = reg.get_run(path.name)
    except RunNotFound:
        return None
    same = run.run_id == path.name and Path(run.folder).resolve() == path.resolve()
    return _found(run) if same else None


def _found(run: Run) -> RunRef:
    return RunRef(Path(run.folder), run)
