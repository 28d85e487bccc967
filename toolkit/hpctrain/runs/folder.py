"""Run folders: one private directory per run, created whole or not at all.

Layout (the run folder is the contract between the login side and the ranks):

    <runs_dir>/<run_id>/
      spec.toml                 the resolved request, exactly as dispatched
      plan.json                 the plan (`Plan.from_json` reads it back)
      ds_config.json            the DeepSpeed config as built at submit (hpctrain.render.deepspeed)
      ds_config.effective.json  only when the allocation changed something; the node logs each edit
      sbatch.sh                 the batch script
      hostfile                  written on the allocation from SLURM_JOB_NODELIST
      submitit/ logs/ metrics/ checkpoints/ hf/ stacks/
      attempts.jsonl summary.json
      repro/                    what reproduces the run (hpctrain.runs.repro): manifest.json (hpctrain version,
                                git SHA, container image), git.diff, pip-freeze.attempt-K.txt (written by rank 0)
      code/                     `submit --snapshot`: the copy of the code the job runs from (runs.snapshot)

Every path into a run folder goes through `RunFolder`; the checkpoint rules live in
`hpctrain.runs.checkpoints`. Stdlib only: the CLI imports this on the login node, the ranks too.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPEC_TOML = "spec.toml"
PLAN_JSON = "plan.json"
DS_CONFIG_JSON = "ds_config.json"
DS_CONFIG_EFFECTIVE_JSON = "ds_config.effective.json"
SBATCH_SH = "sbatch.sh"
HOSTFILE = "hostfile"
ATTEMPTS_JSONL = "attempts.jsonl"
SUMMARY_JSON = "summary.json"
# A user script's stop request: the node entry writes the signal here, hpctrain.runtime.should_stop() reads it.
STOP_REQUEST_JSON = "stop-request.json"
# Written by `hpctrain cancel` before it signals the job: the ranks that get SIGTERM then stop as cancelled by
# the user (not "for requeue"), and the supervisor calls it a user cancel.
CANCEL_REQUESTED = "cancel-requested.json"
SUBMITIT, LOGS, METRICS, CHECKPOINTS, EXPORT = "submitit", "logs", "metrics", "checkpoints", "hf"
REPRO, CODE = "repro", "code"
REPRO_MANIFEST, GIT_DIFF, SNAPSHOT_FILES = "manifest.json", "git.diff", "snapshot-files.txt"
STACKS = "stacks"  # each rank's Python stacks, dumped on a signal (hpctrain.runs.stacks)
# Inside metrics/: the rank-0 step records, the heartbeat, the node's structured events, the watchdog's verdicts.
METRICS_JSONL, HEARTBEAT, EVENTS_JSONL, WATCHDOG_JSONL = "metrics.jsonl", "heartbeat", "events.jsonl", "watchdog.jsonl"
# Inside metrics/: the trackers' files (hpctrain.runs.tracking). DeepSpeed writes TensorBoard's and the CSV files into
# metrics/<name> (ds_config.json says "output_path": "metrics", relative to the run folder, where the ranks run);
# W&B makes its own wandb/ folder in metrics/ (WANDB_DIR), MLflow's file store is metrics/mlruns.
TENSORBOARD, CSV, WANDB, MLRUNS = "tensorboard", "csv", "wandb", "mlruns"
# Sub-folders every run folder has from the start, so the node never races to create them.
SUBDIRS = (SUBMITIT, LOGS, METRICS, CHECKPOINTS)
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def runs_dir_default() -> Path:
    """$HPCTRAIN_RUNS_DIR, else ./runs."""
    return Path(os.environ.get("HPCTRAIN_RUNS_DIR") or "runs")


def sanitize_name(name: str) -> str:
    """Map a free-form job name onto [A-Za-z0-9_.-] so it is safe in paths, sbatch and sacct."""
    cleaned = _NAME_BAD.sub("_", name).strip("._-")
    return cleaned[:64] or "run"


_ISSUED: set[str] = set()  # ids handed out by this process: a 100-point sweep shares one second
_ID_SUFFIX = re.compile(r"(.*-\d{8}-\d{6}-)[0-9a-f]{4}")


def new_run_id(name: str, now: float | None = None) -> str:
    """`<name>-YYYYmmdd-HHMMSS-<4hex>`, never the same twice in one process.

    16 random bits alone collide within a second (7% for a 100-point sweep), so ids already
    issued here are redrawn; `create_run_folder_atomically` redraws on a clash with other processes.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    while True:
        run_id = f"{sanitize_name(name)}-{stamp}-{secrets.token_hex(2)}"
        if run_id not in _ISSUED:
            _ISSUED.add(run_id)
            return run_id


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder; knows nothing about what is inside them."""

    path: Path

    def __init__(self, path: Path | str) -> None:
        object.__setattr__(self, "path", Path(path))

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def spec_toml(self) -> Path:
        return self.path / SPEC_TOML

    @property
    def plan_json(self) -> Path:
        return self.path / PLAN_JSON

    @property
    def sbatch_sh(self) -> Path:
        return self.path / SBATCH_SH

    @property
    def ds_config_json(self) -> Path:
        return self.path / DS_CONFIG_JSON

    @property
    def ds_config_effective_json(self) -> Path:
        return self.path / DS_CONFIG_EFFECTIVE_JSON

    @property
    def hostfile(self) -> Path:
        return self.path / HOSTFILE

    @property
    def submitit_dir(self) -> Path:
        return self.path / SUBMITIT

    @property
    def logs_dir(self) -> Path:
        return self.path / LOGS

    @property
    def metrics_dir(self) -> Path:
        return self.path / METRICS

    @property
    def events_jsonl(self) -> Path:
        """What the ranks say happened (hpctrain.runs.events): start, training milestones, stop, failure."""
        return self.path / EVENTS_JSONL

    @property
    def watchdog_jsonl(self) -> Path:
        return self.metrics_dir / WATCHDOG_JSONL

    def health_dir(self, job: str, attempt: int) -> Path:
        """One health step's reports (hpctrain.node.launch.health writes HOST.json, hpctrain.fault.health judges)."""
        return self.metrics_dir / "health" / f"{job or 'local'}-{attempt}"

    @property
    def export_dir(self) -> Path:
        """The consolidated Hugging Face model (`hpctrain export`, checkpoint.export_hf)."""
        return self.path / EXPORT

    @property
    def metrics_jsonl(self) -> Path:
        return self.metrics_dir / METRICS_JSONL

    @property
    def heartbeat(self) -> Path:
        return self.metrics_dir / HEARTBEAT

    @property
    def stacks_dir(self) -> Path:
        """attempt-K.rank-R.txt: rank R's stack dumps (`hpctrain stacks`, the watchdog before a cancel)."""
        return self.path / STACKS

    @property
    def tensorboard_dir(self) -> Path:
        """TensorBoard's event files (DeepSpeed's monitor on rank 0; `hpctrain sync --to tensorboard`)."""
        return self.metrics_dir / TENSORBOARD

    @property
    def csv_dir(self) -> Path:
        """DeepSpeed's CSV monitor: one <tag>.csv per figure."""
        return self.metrics_dir / CSV

    @property
    def wandb_dir(self) -> Path:
        """W&B's run folders (offline-run-*/run-*), under WANDB_DIR = metrics/."""
        return self.metrics_dir / WANDB

    @property
    def mlflow_dir(self) -> Path:
        """MLflow's file store when no tracking URI is given."""
        return self.metrics_dir / MLRUNS

    def sync_ledger(self, backend: str) -> Path:
        """What `hpctrain sync --to BACKEND` has written so far (the last step), so a second sync adds nothing."""
        return self.metrics_dir / f"synced-{backend}.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def repro_dir(self) -> Path:
        """The reproducibility bundle (hpctrain.runs.repro)."""
        return self.path / REPRO

    @property
    def repro_manifest(self) -> Path:
        return self.repro_dir / REPRO_MANIFEST

    @property
    def git_diff(self) -> Path:
        """`git diff --binary HEAD` of the code's repository at submit (absent when clean or too large)."""
        return self.repro_dir / GIT_DIFF

    @property
    def snapshot_files(self) -> Path:
        """The files `submit --snapshot` copied (path and size per line)."""
        return self.repro_dir / SNAPSHOT_FILES

    def pip_freeze(self, attempt: int) -> Path:
        """The Python packages of the environment that ran attempt K (rank 0 writes it on the node)."""
        return self.repro_dir / f"pip-freeze.attempt-{attempt}.txt"

    @property
    def code_dir(self) -> Path:
        """`submit --snapshot`: the copy of the code the job runs from."""
        return self.path / CODE

    @property
    def stop_request(self) -> Path:
        return self.path / STOP_REQUEST_JSON

    @property
    def attempts_jsonl(self) -> Path:
        return self.path / ATTEMPTS_JSONL

    @property
    def summary_json(self) -> Path:
        return self.path / SUMMARY_JSON

    @property
    def cancel_requested(self) -> Path:
        return self.path / CANCEL_REQUESTED

    def cancel_request(self) -> dict[str, Any] | None:
        """What `hpctrain cancel` wrote ({"time", "jobs", "by"}), or None: nobody asked to cancel this run."""
        try:
            obj = json.loads(self.cancel_requested.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return obj if isinstance(obj, dict) else None

    def is_run_folder(self) -> bool:
        """A folder hpctrain made: it has a spec.toml (or, for an old run, an attempts.jsonl)."""
        return self.path.is_dir() and (self.spec_toml.is_file() or self.attempts_jsonl.exists())

    def rank_log(self, attempt: int, rank: int) -> Path:
        return self.logs_dir / f"attempt-{attempt}.rank-{rank}.log"

    def append_attempt(self, record: dict[str, Any]) -> None:
        append_attempt(self.attempts_jsonl, record)

    def read_attempts(self) -> list[dict[str, Any]]:
        return read_attempts(self.attempts_jsonl)


def json_text(obj: Any) -> str:
    """The run folder's JSON files (ds_config.json, ds_config.effective.json): sorted keys, indented, so
    two of them diff line by line."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def write_private(path: Path, text: str) -> None:
    """Write `text` via a temp file + rename (readers never see half a file), mode 0600: run folders
    hold scripts and specs that are the user's alone."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_run_files(path: Path | str, files: dict[str, str]) -> Path:
    """Write `files` (relative name -> text) into the folder `path`, created when missing (mode 0700,
    files 0600, each replaced atomically). What else is there stays (checkpoints, logs, metrics: a
    resubmission, a test's run resumed with a changed spec); the ranks create the sub-folders they
    write, so a dry run's --out folder holds the files alone."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    for rel, text in files.items():
        target = _inside(root, rel)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(target, text)
    return root


def create_run_folder_atomically(runs_dir: Path | str, run_id: str, files: dict[str, str]) -> Path:
    """Create `<runs_dir>/<run_id>` (mode 0700) holding `files` (relative name -> text), all or nothing.

    Everything is written into a hidden sibling first and renamed into place, so a crash or a
    rejected submission never leaves a half-written run folder that `list` could trip over.
    Returns the folder created: when another process took the same id, a `new_run_id`-style id
    gets a fresh random suffix (so use the returned path); any other existing id raises
    FileExistsError.
    """
    runs = Path(runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    for _ in range(64):
        try:
            return _create_once(runs, run_id, files)
        except FileExistsError:
            m = _ID_SUFFIX.fullmatch(run_id)
            if not m:
                raise
            run_id = f"{m.group(1)}{secrets.token_hex(2)}"
    raise FileExistsError(f"no free run id like {run_id} in {runs}")


def _create_once(runs: Path, run_id: str, files: dict[str, str]) -> Path:
    final = runs / run_id
    if final.exists():
        raise FileExistsError(f"run folder already exists: {final}")
    tmp = runs / f".{run_id}.tmp-{secrets.token_hex(4)}"
    old_umask = os.umask(0o077)  # private from the first byte, not chmod'ed afterwards
    try:
        tmp.mkdir(mode=0o700)
        for sub in SUBDIRS:
            (tmp / sub).mkdir(mode=0o700)
        for rel, text in files.items():
            _write_inside(tmp, rel, text)
        try:
            os.rename(tmp, final)  # atomic on one filesystem
        except OSError as exc:  # `final` appeared meanwhile (ENOTEMPTY/EEXIST): another process won
            if final.exists():
                raise FileExistsError(f"run folder already exists: {final}") from exc
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.umask(old_umask)
    return final


def remove_run_folder(path: Path | str) -> None:
    """Remove a run folder that was never submitted (caller's cleanup after a rejection)."""
    shutil.rmtree(path, ignore_errors=True)


def _inside(root: Path, rel: str) -> Path:
    # Names come from hpctrain itself; a lexical check is enough and avoids resolve().
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"run folder file name escapes the folder: {rel!r}")
    return root / norm


def _write_inside(root: Path, rel: str, text: str) -> None:
    target = _inside(root, rel)  # the temp dir is fresh: no symlinks in it
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def append_attempt(path: Path, record: dict[str, Any], fsync: bool = False) -> None:
    """Append one JSON line; O_APPEND + one write() keeps concurrent writers' lines whole. `fsync`: on disk
    before this returns (a submission's intent, hpctrain.slurm.transaction: it must outlive a power cut too)."""
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode("utf-8"))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_attempts(path: Path) -> list[dict[str, Any]]:
    """All attempt records; a torn last line (writer killed mid-write) is skipped, not fatal."""
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a run folder's .jsonl file, one per line; blank, torn or non-object lines (a writer
    killed mid-line) are skipped. A missing file has none; other OSErrors reach the caller."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj
