"""`submit --snapshot`: a copy of the code in the run folder, so that edits after submit do not change a queued job.

`snapshot_code(src_dir, run_folder)` copies "the code" into RUN/code/ and returns where `src_dir` lies inside the
copy; the job then runs there (the batch script `cd`s into it and puts it first on PYTHONPATH: spec `code.dir`),
and a user script's path maps into it the same way (`dest / script.relative_to(src_dir)`).

What "the code" is:
- in a git work tree: the whole work tree as `git ls-files --cached --others --exclude-standard` lists it, read
  from the working tree. That is `git archive HEAD` with the uncommitted diff applied, plus new files that are
  not ignored; ignored files (data, checkpoints, venvs) stay out. Files deleted in the tree are not copied.
- elsewhere: the files under `src_dir`, without hidden folders (.git, .venv) and __pycache__.
Either way, run folders (the runs folder and any folder holding a spec.toml) are skipped, symlinks are
copied as links, and a snapshot larger than MAX_FILES files or MAX_BYTES bytes is refused before copying.
The list of files copied (path, size) is RUN/repro/snapshot-files.txt.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from hpctrain.errors import bad_value
from hpctrain.runs import repro
from hpctrain.runs.folder import RunFolder, runs_dir_default, write_private

MAX_FILES = 20_000
MAX_BYTES = 512 * 2**20
_SKIP_DIRS = {"__pycache__", "node_modules"}


def _git_files(root: Path) -> list[Path] | None:
    out = repro.git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if out is None:
        return None
    return [Path(p.decode("utf-8", "surrogateescape")) for p in out.split(b"\0") if p]


def _walk(src: Path) -> Iterator[Path]:
    for top, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
        for f in sorted(files):
            yield (Path(top) / f).relative_to(src)


def _excluded(path: Path, root: Path, skip: list[Path], run_dirs: dict[Path, bool]) -> bool:
    """Under the runs folder, the new run folder, or any folder holding a spec.toml (another run folder)."""
    if any(path == s or s in path.parents for s in skip):
        return True
    for parent in path.parents:
        if parent == root or root not in parent.parents:
            return False
        if parent not in run_dirs:
            run_dirs[parent] = RunFolder(parent).spec_toml.is_file()
        if run_dirs[parent]:
            return True
    return False


def plan_copy(src_dir: Path, run_folder: Path) -> tuple[Path, list[Path], str]:
    """(the root copied, the relative files to copy, "git" or "files"); refused when too large."""
    src = src_dir.absolute()
    root = repro.git_root(src)
    files = _git_files(root) if root is not None else None
    method = "git"
    if root is None or files is None:
        root, files, method = src, list(_walk(src)), "files"
    skip = [runs_dir_default().absolute(), run_folder.absolute()]
    kept: list[Path] = []
    total, run_dirs = 0, dict[Path, bool]()
    for rel in files:
        path = root / rel
        if not os.path.lexists(path) or _excluded(path, root, skip, run_dirs):
            continue
        total += path.lstat().st_size
        kept.append(rel)
        if len(kept) > MAX_FILES or total > MAX_BYTES:
            raise bad_value("--snapshot", str(root), f"more than {MAX_FILES} files or {MAX_BYTES // 2**20} MiB of "
                            "code", "keep data and checkpoints out of the code folder (or in .gitignore), or "
                            "submit without --snapshot")
    return root, kept, method


def snapshot_code(src_dir: Path | str, run_folder: Path | str) -> Path:
    """Copy the code holding `src_dir` into RUN/code/; returns `src_dir`'s place inside the copy."""
    folder = RunFolder(run_folder)
    src = Path(src_dir).absolute()
    root, files, method = plan_copy(src, folder.path)
    dest = folder.code_dir
    dest.mkdir(mode=0o700)
    listing = []
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)
        listing.append(f"{rel}\t{(root / rel).lstat().st_size}")
    folder.repro_dir.mkdir(mode=0o700, exist_ok=True)
    write_private(folder.snapshot_files, f"# {method} snapshot of {root}\n" + "\n".join(listing) + "\n")
    return dest / src.relative_to(root) if src != root else dest


def describe(src_dir: Path | str, run_folder: Path | str, workdir: Path) -> dict[str, object]:
    """What the manifest says of a snapshot."""
    folder = RunFolder(run_folder)
    try:
        lines = folder.snapshot_files.read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    return {"from": str(Path(src_dir).absolute()), "dir": str(folder.code_dir), "workdir": str(workdir),
            "method": lines[0].split()[1] if lines else "", "files": max(0, len(lines) - 1),
            "list": str(folder.snapshot_files)}
