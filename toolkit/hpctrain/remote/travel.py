"""What a remote submit carries to the login node: the run file and every local path it names, nothing else.

The request is resolved here first (without the filesystem checks, as `hpctrain plan` does) so that the paths
are those the login node would use. A path that exists on this machine travels (its folder whole, for a
script: the code beside it) and the login node is told its new place with `--set KEY=PATH`; a path that does
not exist here is the cluster's own (`/shared/models/...`) and is left as written. Everything is mirrored under
one upload folder at its absolute local path, and the login node's hpctrain runs in the mirror of the current
directory, so relative paths resolve there as they do here.

A model folder or a prepared corpus never travels by accident: above `max_upload_mb` the submit is refused,
naming the biggest path and how to put it on the cluster.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import HpcUsageError
from hpctrain.remote.site import Remote
from hpctrain.secret import denied_file

# Never carried: version control, caches, environments, and what a run writes.
EXCLUDES = (".git", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache",
            "node_modules", "runs", "checkpoints", "wandb", "mlruns")


@dataclass(frozen=True)
class Item:
    """One local path that travels, and the spec key that named it ('' for the run file and site file)."""

    key: str
    path: Path
    size: int


def _skipped(name: str) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, x) for x in EXCLUDES) or denied_file(name) is not None


def files_of(path: Path) -> list[Path]:
    """PATH itself, or every file under folder PATH that travels (no caches, environments, credential files)."""
    if path.is_file():
        return [path]
    out: list[Path] = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        out += [Path(root) / f for f in sorted(files) if not _skipped(f) and (Path(root) / f).is_file()]
    return out


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in files_of(path))


def local_items(run_file: str | None, site_file: Path | None, named: dict[str, str]) -> list[Item]:
    """The local paths that travel: the run file, the site file, and of NAMED (spec key -> path after
    resolving) those that exist here. A script travels with the folder it sits in: the code it imports."""
    items: list[Item] = []
    for path in (run_file, site_file):
        if path is not None and Path(path).is_file():
            p = Path(path).absolute()
            items.append(Item("", p, p.stat().st_size))
    for key, value in named.items():
        if not value or not value.startswith("/"):
            continue  # a preset name, "synthetic", "byte": nothing on disk
        p = Path(value)
        try:
            exists = p.exists()
        except OSError:
            exists = False
        if not exists:
            continue  # the cluster's own path
        carried = p.parent if key == "launch.script" else p
        items.append(Item(key, carried, _size(carried)))
    return items


def check_size(remote: Remote, items: list[Item]) -> None:
    """Refuse a submit that would carry more than max_upload_mb, naming the biggest path and the fix."""
    total = sum(i.size for i in items)
    limit = int(remote.max_upload_mb * 1e6)
    if total <= limit:
        return
    big = max(items, key=lambda i: i.size)
    what = f"{big.key} = {str(big.path)!r}" if big.key else repr(str(big.path))
    raise HpcUsageError(
        f"{what}: {big.size / 1e6:.1f} MB to send to {remote.host} (all: {total / 1e6:.1f} MB), over the "
        f"{remote.max_upload_mb:g} MB a remote submit carries (sites.{remote.site}.remote.max_upload_mb). "
        f"Fix: put it on the cluster once (rsync -a {big.path} {remote.host}:PATH) and name that cluster path in "
        f"the run file; raise max_upload_mb only for code and small data")


def digest(args: list[str], items: list[Item]) -> str:
    """What makes two submits the same request: the arguments and the content of every file that travels
    (a submit interrupted by a dropped connection and typed again is recognised, never queued twice)."""
    h = hashlib.sha256("\0".join(args).encode())
    for item in sorted(items, key=lambda i: str(i.path)):
        for f in files_of(item.path):
            h.update(str(f).encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def mirrored(stage: str, path: Path | str) -> str:
    """Where local absolute PATH lies on the login node, under the upload folder STAGE."""
    return f"{stage.rstrip('/')}/{str(Path(path).absolute()).lstrip('/')}"
