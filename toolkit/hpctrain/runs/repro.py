"""The reproducibility bundle of every run folder: `repro/` (paths: hpctrain.runs.folder.RunFolder).

At submit (login side), `write_bundle` records in `repro/manifest.json`: the hpctrain version, the Python that
submitted, the folder submitted from, the git state of the code (repository root, HEAD's SHA, branch, whether
the tree is dirty, how many untracked files), the container image and what is knowable of its identity
(render.containers.image_identity), and the snapshot when `--snapshot` made one. The working tree's changes
against HEAD go to `repro/git.diff` (`git diff --binary HEAD`: binary-safe, `git apply` re-creates the tree);
a diff over DIFF_CAP bytes is not kept, and the manifest says so with its size and `git diff --stat`. Nothing
secret: files .gitignore names or named like credentials (secret.DENIED_FILES) are left out of the diff, and a
diff holding the value of a secret variable is not kept (`git_state`).

On the node, rank 0 writes `repro/pip-freeze.attempt-K.txt` at the start of every attempt: the packages of
the environment that really ran (a container's, a node's venv), which may differ from the login node's.
It is read from importlib.metadata (pip freeze's `name==version` lines, `name @ URL` for direct installs,
`-e URL` for editable ones) so that no pip subprocess starts on the node.

This module alone runs git. Stdlib only: the node imports it too.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpctrain import __version__
from hpctrain.runs.folder import RunFolder, json_text, write_private
from hpctrain.secret import DENIED_FILES, denied_file, known_secret_values, secret_in

DIFF_CAP = 8 * 2**20  # bytes of `git diff --binary` kept; a bigger diff is usually data committed by mistake
_GIT_TIMEOUT_S = 30.0


def git(cwd: Path, *args: str) -> bytes | None:
    """stdout of `git -C CWD ARGS`, None when git is missing, fails or times out."""
    try:
        proc = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, timeout=_GIT_TIMEOUT_S,
                              check=False, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _text(out: bytes | None) -> str:
    return out.decode("utf-8", "replace").strip() if out is not None else ""


def git_root(code_dir: Path) -> Path | None:
    """The top of the git work tree holding `code_dir`, None when it is in none (or git is missing)."""
    top = _text(git(code_dir, "rev-parse", "--show-toplevel"))
    return Path(top) if top else None


def git_state(code_dir: Path, secret_names: Iterable[str] = ()) -> tuple[dict[str, Any], bytes | None]:
    """(what the manifest says of the repository, the binary diff to keep or None).

    Nothing secret goes into the diff: files that .gitignore names (tracked anyway) or whose names say they
    hold credentials (secret.DENIED_FILES: .env, *.pem, id_rsa, ...) are left out of it, and a diff that still
    holds the value of a secret variable (secret.known_secret_values: HF_TOKEN, SECRET_NAMES, ...) is not kept;
    the manifest names what was left out and why."""
    root = git_root(code_dir)
    if root is None:
        return {"repository": None, "note": f"{code_dir} is not in a git work tree (or git is not installed)"}, None
    sha = _text(git(root, "rev-parse", "--verify", "-q", "HEAD"))
    status = _text(git(root, "status", "--porcelain", "--untracked-files=normal")).splitlines()
    info: dict[str, Any] = {"repository": str(root), "sha": sha or None,
                            "branch": _text(git(root, "rev-parse", "--abbrev-ref", "HEAD")) or None,
                            "dirty": any(not ln.startswith("??") for ln in status),
                            "untracked_files": sum(ln.startswith("??") for ln in status)}
    if not sha:
        info["note"] = "the repository has no commit yet"
        return info, None
    kept, left_out = _diff_paths(root)
    if left_out:
        info["diff_left_out"] = left_out[:_LIST_CAP]
        info["diff_left_out_why"] = ("ignored by .gitignore, or named like a credential file "
                                     f"({', '.join(DENIED_FILES)})")
    if len(left_out) > _LIST_CAP:
        info["note"] = f"{len(left_out)} changed files would have to be left out of the diff: not kept"
        return info, None
    diff = (git(root, "diff", "--binary", "--no-renames", "HEAD", "--", ".",
                *(f":(exclude,literal){p}" for p in left_out)) if kept else b"")
    if diff is None:
        info["note"] = "`git diff --binary HEAD` failed"
        return info, None
    info["diff_bytes"] = len(diff)
    if len(diff) > DIFF_CAP:
        info["diff"] = None
        info["note"] = (f"the diff against HEAD is {len(diff)} bytes, over the cap of {DIFF_CAP}: not kept "
                        "(commit the changes, or use --snapshot to keep the code itself)")
        info["diff_stat"] = _text(git(root, "diff", "--stat", "HEAD")).splitlines()[-1:]
        return info, None
    leaked = secret_in(diff, known_secret_values(secret_names))
    if leaked is not None:
        info["diff"] = None
        info["note"] = (f"the diff against HEAD holds the value of the secret variable {leaked}: not kept (move the "
                        "secret out of the code, e.g. into the environment, or list its file in .gitignore)")
        return info, None
    info["diff"] = "git.diff" if diff else None
    return info, diff or None


_LIST_CAP = 1000  # paths named in the manifest / passed to git as exclusions


def _diff_paths(root: Path) -> tuple[list[str], list[str]]:
    """(changed tracked paths the diff may hold, those it may not: ignored by .gitignore or DENIED_FILES)."""
    changed = _paths(git(root, "diff", "--name-only", "-z", "--no-renames", "HEAD"))
    ignored = set(_paths(git(root, "ls-files", "-z", "--cached", "--ignored", "--exclude-standard")))
    left_out = [p for p in changed if p in ignored or denied_file(p) is not None]
    return [p for p in changed if p not in left_out], left_out


def _paths(out: bytes | None) -> list[str]:
    return [p.decode("utf-8", "surrogateescape") for p in (out or b"").split(b"\0") if p]


def manifest(code_dir: Path, container: dict[str, Any], snapshot: dict[str, Any] | None,
             secret_names: Iterable[str] = ()) -> tuple[dict[str, Any], bytes | None]:
    """The manifest of a run submitted from `code_dir`, and its git diff (SECRET_NAMES: the spec's secret_env)."""
    git, diff = git_state(code_dir, secret_names)
    doc = {"hpctrain_version": __version__, "submitted": time.time(), "submitted_from": str(code_dir),
           "host": socket.gethostname(), "python": sys.version.split()[0], "python_executable": sys.executable,
           "git": git, "container": container, "snapshot": snapshot}
    return doc, diff


def write_bundle(run_dir: Path, code_dir: Path, container: dict[str, Any],
                 snapshot: dict[str, Any] | None = None) -> Path:
    """Write repro/manifest.json (and repro/git.diff) into the run folder; returns the manifest's path."""
    return write_manifest(run_dir, *manifest(code_dir, container, snapshot))


def write_manifest(run_dir: Path, doc: dict[str, Any], diff: bytes | None) -> Path:
    """Write a manifest made once (a sweep's points share it) and its diff into one run folder."""
    folder = RunFolder(run_dir)
    folder.repro_dir.mkdir(mode=0o700, exist_ok=True)
    if diff is not None:
        _write_bytes(folder.git_diff, diff)
    write_private(folder.repro_manifest, json_text(doc))
    return folder.repro_manifest


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """repro/manifest.json of a run; {} when the run has none (a run submitted before bundles existed)."""
    try:
        doc = json.loads(RunFolder(run_dir).repro_manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


# --------------------------------------------------------------------------------------------------
# On the node: the environment that ran.

def freeze_lines() -> list[str]:
    """The installed distributions of this interpreter as `pip freeze` prints them, sorted by name."""
    from importlib import metadata

    lines: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if not name:
            continue
        line = f"{name}=={dist.version}"
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "null")
        except ValueError:
            direct = None
        if isinstance(direct, dict) and direct.get("url"):
            editable = bool(direct.get("dir_info", {}).get("editable"))
            line = f"-e {direct['url']}" if editable else f"{name} @ {direct['url']}"
        lines.setdefault(name.lower().replace("_", "-"), line)  # the first on sys.path wins, as for imports
    return [lines[k] for k in sorted(lines)]


def write_freeze(run_dir: Path | str, attempt: int) -> Path:
    """repro/pip-freeze.attempt-K.txt for this process' environment (rank 0, at the start of an attempt)."""
    folder = RunFolder(run_dir)
    folder.repro_dir.mkdir(mode=0o700, exist_ok=True)
    header = [(f"# hpctrain {__version__}, attempt {attempt}, host {socket.gethostname()}, "
               f"python {platform.python_version()} ({sys.executable})"),
              f"# job {os.environ.get('SLURM_JOB_ID', '-')}; read from importlib.metadata in pip freeze's format"]
    path = folder.pip_freeze(attempt)
    write_private(path, "\n".join([*header, *freeze_lines()]) + "\n")
    return path
