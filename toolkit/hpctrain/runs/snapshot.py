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

Nothing secret is copied: files named like credentials (secret.DENIED_FILES: .env*, *.pem, *.key, id_*, .netrc,
credentials*, .git-credentials, *.p12, in any folder) and files .gitignore names (also when tracked) stay out, and
a file that holds the value of a secret variable (secret.known_secret_values) refuses the snapshot, naming the
file. Every copied file is private (0600), like every other file of the run folder, whatever its mode was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from hpctrain.errors import bad_value
from hpctrain.runs import repro
from hpctrain.runs.folder import RunFolder, runs_dir_default, write_private
from hpctrain.secret import denied_file, known_secret_values, secret_in

MAX_FILES = 20_000
MAX_BYTES = 512 * 2**20
_SKIP_DIRS = {"__pycache__", "node_modules"}


def _git_files(root: Path) -> list[Path] | None:
    """The work tree's files, less those .gitignore names: untracked ones (--exclude-standard) and tracked ones
    that match it all the same (committed before the rule, or with `git add -f`)."""
    out = repro.git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    ignored = repro.git(root, "ls-files", "-z", "--cached", "--ignored", "--exclude-standard")
    if out is None or ignored is None:
        return None
    skip = set(ignored.split(b"\0"))
    return [Path(p.decode("utf-8", "surrogateescape")) for p in out.split(b"\0") if p and p not in skip]


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
        if denied_file(rel.as_posix()) or not os.path.lexists(path) or _excluded(path, root, skip, run_dirs):
            continue
        total += path.lstat().st_size
        kept.append(rel)
        if len(kept) > MAX_FILES or total > MAX_BYTES:
            raise bad_value("--snapshot", str(root), f"more than {MAX_FILES} files or {MAX_BYTES // 2**20} MiB of "
                            "code", "keep data and checkpoints out of the code folder (or in .gitignore), or "
                            "submit without --snapshot")
    return root, kept, method


def snapshot_code(src_dir: Path | str, run_folder: Path | str, secret_names: Iterable[str] = ()) -> Path:
    """Copy the code holding `src_dir` into RUN/code/; returns `src_dir`'s place inside the copy.
    SECRET_NAMES: the spec's secret_env, whose values (and every other known secret's) no copied file may hold."""
    folder = RunFolder(run_folder)
    src = Path(src_dir).absolute()
    root, files, method = plan_copy(src, folder.path)
    _refuse_secrets(root, files, known_secret_values(secret_names))
    dest = folder.code_dir
    dest.mkdir(mode=0o700)
    listing = []
    for rel in files:
        target = dest / rel
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)
        if not target.is_symlink():
            os.chmod(target, 0o600)  # private like the rest of the run folder (copy2 kept the source's 0644)
        listing.append(f"{rel}\t{(root / rel).lstat().st_size}")
    folder.repro_dir.mkdir(mode=0o700, exist_ok=True)
    write_private(folder.snapshot_files, f"# {method} snapshot of {root}\n" + "\n".join(listing) + "\n")
    return dest / src.relative_to(root) if src != root else dest


def _refuse_secrets(root: Path, files: list[Path], values: dict[str, bytes]) -> None:
    """Refuse the snapshot when a file to copy holds the value of a secret variable (before anything is copied)."""
    if not values:
        return
    for rel in files:
        path = root / rel
        if path.is_symlink() or not path.is_file():
            continue
        name = secret_in(path.read_bytes(), values)
        if name is not None:
            raise bad_value("--snapshot", str(rel), f"the file holds the value of the secret variable {name}, and a "
                            "snapshot is a copy in the run folder", "remove the secret from the file (read it from "
                            "the environment), list the file in .gitignore, or submit without --snapshot")


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
