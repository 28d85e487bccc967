"""`hpctrain.Run(ref)` and `hpctrain.runs()`: a handle on a submitted run, as a notebook or a pipeline holds it.

The CLI's `list`, `status`, `cancel`, `logs` and `summary` call the functions here and only print what they
return, so a run looks the same from Python and from the shell. Only the standard library and click's error
types load with this module; the registry, sacct and the collector load inside the calls that use them.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpctrain.states import JobState, is_final, normalize_state

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.api.resubmitting import Resubmitted
    from hpctrain.collect.logs import Line, LogFile, LogFilter
    from hpctrain.collect.summary import RunInput
    from hpctrain.runs import registry as reglib

RunRef = str | os.PathLike[str]
DEFAULT_POLL_S = 5.0  # `hpctrain status --watch`'s default interval


@dataclass(frozen=True)
class Status:
    """A run as SLURM and its folder see it now: the registry's record refreshed from sacct (`record`), one line
    per failed attempt (`failures`: who, where, what), SLURM's reason per pending job (`pending`), and what could
    not be asked (`warnings`: sacct down, a damaged registry)."""

    record: reglib.Run
    failures: dict[int, str] = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    deciding: str = ""  # a supervisor job still deciding whether to retry the ended attempt (wait() only)

    @property
    def state(self) -> str:
        return self.record.state

    @property
    def job_id(self) -> str:
        latest = self.record.latest
        return latest.job_id if latest else ""

    @property
    def ended(self) -> bool:
        """The job ended and no supervisor job is about to start a retry."""
        return is_final(self.state) and not self.deciding

    def shown_state(self, state: str, job_id: str) -> str:
        """STATE, or "PENDING (Resources)" with SLURM's reason for a pending job."""
        return f"{state} ({self.pending[job_id]})" if state == JobState.PENDING and job_id in self.pending else state

    def to_dict(self) -> dict[str, Any]:
        """What `hpctrain status --json` prints."""
        doc = self.record.to_dict()
        for a in doc.get("attempts", []):
            if a.get("job_id") in self.pending and a.get("state") == JobState.PENDING:
                a["pending_reason"] = self.pending[a["job_id"]]
        return doc


@dataclass(frozen=True)
class Listing:
    """`hpctrain list`: the newest runs, refreshed, and what could not be asked (`warnings`)."""

    records: list[reglib.Run]
    warnings: list[str]


@dataclass(frozen=True)
class Cancelled:
    """What `Run.cancel()` did: the jobs it stopped (none when the run had already ended) and the run's state."""

    run_id: str
    jobs: list[str]
    state: str

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "cancelled": self.jobs, "state": self.state}


class Run:
    """A run named as on the command line: its id, a unique prefix, its name (the newest run of it), `last`, or
    its folder's path (also a folder this registry never saw; status/wait/cancel need a registered run).

    >>> run = hpctrain.Run("last")
    >>> run.wait(timeout=600).state
    'COMPLETED'
    """

    def __init__(self, ref: RunRef, *, registry: reglib.Registry | None = None) -> None:
        from hpctrain.runs.registry import Registry
        from hpctrain.runs.resolve import resolve_run

        self.ref = os.fspath(ref)
        self._reg = registry or Registry()
        found = resolve_run(self._reg, self.ref)
        self._set(found.folder, found.run)

    def _set(self, folder: Path, record: reglib.Run | None, script: str | None = None) -> None:
        self.folder: Path = folder
        self.record: reglib.Run | None = record
        self.run_id: str = record.run_id if record else folder.name
        self.dry_run = script is not None  # hpctrain.submit(dry_run=True): rendered, never submitted
        self.notes: list[str] = []  # what the submission told the user (hpctrain submit prints them on stderr)
        self._script = script

    @classmethod
    def of(cls, record: reglib.Run, registry: reglib.Registry) -> Run:
        """The handle of a record the registry already returned (no lookup)."""
        run = cls.__new__(cls)
        run.ref, run._reg = record.run_id, registry
        run._set(Path(record.folder), record)
        return run

    @classmethod
    def rendered(cls, folder: Path, script: str, *, notes: list[str]) -> Run:
        """A dry run's handle: the folder its files were written to (or would be), and its batch script."""
        from hpctrain.runs.registry import Registry

        run = cls.__new__(cls)
        run.ref, run._reg = str(folder), Registry()
        run._set(Path(folder), None, script)
        run.notes = list(notes)
        return run

    def __repr__(self) -> str:
        dry = ", dry_run=True" if self.dry_run else ""
        return f"hpctrain.Run({self.run_id!r}, folder={str(self.folder)!r}{dry})"

    @property
    def sbatch(self) -> str:
        """The batch script as submitted (RUN_DIR/sbatch.sh), or as a dry run rendered it."""
        from hpctrain.runs.folder import RunFolder

        return self._script if self._script is not None else RunFolder(self.folder).sbatch_sh.read_text()

    def _registered(self) -> reglib.Run:
        from hpctrain.errors import HpcUsageError

        if self.dry_run:
            raise HpcUsageError(f"RUN = {self.folder}: a dry run, never submitted: it has no job. Fix: "
                                "hpctrain.submit(...) without dry_run=True")
        if self.record is None:
            raise HpcUsageError(f"RUN = {self.ref!r}: the run folder {self.folder} is not in the registry "
                                f"{self._reg.path}. Fix: `hpctrain summary {self.folder}` reads such a folder; this "
                                "command needs a registered run")
        self.record = self._reg.get_run(self.record.run_id)  # what other processes recorded since
        return self.record

    def status(self) -> Status:
        """The run refreshed from SLURM (one sacct call; squeue for pending reasons), with failed attempts
        classified by the collector when nothing classified them yet."""
        from hpctrain.slurm.refresh import refresh
        from hpctrain.slurm.uncertain import reconcile

        rec = self._registered()
        warnings = reconcile(self._reg, [rec]) + refresh(self._reg, [rec]) + self._reg.warnings
        failures = _fill_failures(self._reg, rec)
        return Status(rec, failures, pending_reasons([rec]), warnings)

    def wait(self, timeout: float, *, poll: float = DEFAULT_POLL_S) -> Status:
        """Poll `status()` every `poll` seconds until the job ended and no supervisor is deciding a retry; the
        last Status. TimeoutError after `timeout` seconds (naming the job and where its logs are)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if is_final(st.state):
                st = Status(st.record, st.failures, st.pending, st.warnings, supervisor_deciding(st.record, st.job_id))
            if st.ended:
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run {self.run_id}: job {st.job_id or '-'} is still {st.state} "
                                   f"after {timeout:g} s; logs: {self.folder / 'logs'}")
            time.sleep(min(max(poll, 0.1), left))

    def summary(self) -> dict[str, Any]:
        """The collector's record of the run (`hpctrain summary RUN --json`'s entry; also written to
        RUN_DIR/summary.json)."""
        found = summaries([str(self.folder) if self.record is None else self.run_id])
        if not found.records:
            from hpctrain.errors import HpcUsageError

            raise HpcUsageError(found.errors[0] if found.errors else f"RUN = {self.ref!r}: not found")
        return found.records[0]

    def logs(self, *, attempt: int | None = None, rank: int | None = None, host: str | None = None,
             grep: str | re.Pattern[str] | None = None) -> list[str]:
        """What `hpctrain logs` prints (`log_lines`): the per-rank log lines merged by time and tagged
        `a<attempt> r<rank> <host> | ` (submitit's task logs for attempts without rank logs), the journal's lines
        among them (a lost node, the peer errors that followed it tagged as its consequences)."""
        from hpctrain.collect import logs as cl
        from hpctrain.collect.summary import from_folder, from_registry

        pattern = re.compile(grep) if isinstance(grep, str) else grep
        inp = from_registry(self.record) if self.record is not None else from_folder(self.folder)
        return [ln.tagged() for ln in log_lines(inp, cl.LogFilter(attempt, rank, host, pattern))]

    def resubmit(self, *, exclude_failed_nodes: bool = False, exclude: Sequence[str] = (),
                 max_retries: int | None = None, time_limit: str | None = None, nodes: int | None = None,
                 tasks_per_node: int | None = None) -> Resubmitted:
        """`hpctrain resubmit RUN`: attempt K+1 in the same folder, resuming from the latest complete checkpoint
        (refused while an attempt runs or after a completed training; hpctrain.api.resubmitting)."""
        from hpctrain.api.resubmitting import resubmit

        return resubmit(self.run_id if self.record is not None else self.folder, exclude=exclude,
                        exclude_failed_nodes=exclude_failed_nodes, max_retries=max_retries, time_limit=time_limit,
                        nodes=nodes, tasks_per_node=tasks_per_node)

    def cancel(self) -> Cancelled:
        """Cancel the run's unfinished attempts (scancel, or stop the local job) and record CANCELLED."""
        import signal

        from hpctrain.slurm.refresh import refresh
        from hpctrain.slurm.uncertain import establish

        rec = self._registered()
        # An unanswered submission's job is cancelled too, once SLURM lists it; while its outcome is unknown,
        # nothing is cancelled or marked (UnknownOutcome says so): never a claim hpctrain cannot make.
        establish(self._reg, rec, "cancels")
        refresh(self._reg, [rec])
        live = [a for a in rec.attempts if not a.final]
        if live:  # first: the ranks that get SIGTERM stop as cancelled, and the supervisor calls it a user cancel
            request_cancel(rec.folder, [a.job_id for a in live])
        if rec.executor == "slurm" and live:
            from hpctrain import slurmcommands as commands

            commands.scancel([a.job_id for a in live])  # raises (nothing recorded) if slurmctld is down
        for a in live if rec.executor != "slurm" else []:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(a.job_id), signal.SIGTERM)  # submitit's controller forwards it to the tasks
        now = time.time()
        self._reg.update_attempts([(rec.run_id, a.attempt, {"state": JobState.CANCELLED, "ended": now})
                                   for a in live])
        return Cancelled(rec.run_id, [a.job_id for a in live], JobState.CANCELLED if live else rec.state)


def runs(limit: int | None = 20) -> list[Run]:
    """The newest `limit` runs (None: every one), newest first, refreshed from SLURM."""
    from hpctrain.runs.registry import Registry

    reg = Registry()
    return [Run.of(rec, reg) for rec in listing(limit, reg).records]


def listing(limit: int | None = 20, reg: reglib.Registry | None = None) -> Listing:
    """`hpctrain list`'s content: the newest runs, unknown submissions reconciled, states refreshed."""
    from hpctrain.runs.registry import Registry
    from hpctrain.slurm.refresh import refresh
    from hpctrain.slurm.uncertain import reconcile

    reg = reg or Registry()
    records = reg.list_runs(limit=limit)
    warnings = reconcile(reg, records) + refresh(reg, records) + reg.warnings
    return Listing(records, warnings)


@dataclass(frozen=True)
class Summaries:
    """`hpctrain summary`'s content: one record per run in view, errors for references that matched nothing."""

    records: list[dict[str, Any]]
    errors: list[str]
    warnings: list[str]


def summaries(refs: list[str], all_runs: bool = False) -> Summaries:
    """The collector's records of the runs `refs` name (none: the 20 newest; `all_runs`: every one); failure
    classes stored in the registry for `status` and resubmit."""
    from hpctrain.collect import summary as co
    from hpctrain.runs.registry import Registry

    reg = Registry()
    inputs, errors, warnings = co.resolve_refs(reg, refs, all_runs)
    records = co.summarize(inputs)
    co.store_failure_classes(reg, [{**r, "_registry_attempts": i.attempts}
                                   for r, i in zip(records, inputs, strict=True)])
    return Summaries(records, errors, warnings)


def pending_reasons(records: list[reglib.Run]) -> dict[str, str]:
    """SLURM's reason for each pending SLURM attempt in view (one squeue call); {} when squeue cannot say."""
    ids = [a.job_id for r in records if r.executor == "slurm" for a in r.attempts if a.state == JobState.PENDING]
    if not ids:
        return {}
    try:
        from hpctrain import slurmcommands as commands

        return commands.pending_reasons(ids)
    except Exception:  # noqa: BLE001 - squeue down: the state alone still says PENDING
        return {}


def _fill_failures(reg: reglib.Registry, rec: reglib.Run) -> dict[int, str]:
    """Attempts that ended in failure but carry no class yet (no supervisor ran: retries 0, a sweep, a local
    run; or `summary` never ran): the collector's verdict, stored in the registry. Returns attempt -> the
    failure's one line (who, where, what)."""
    missing = {a.attempt for a in rec.attempts if a.final and a.state != JobState.COMPLETED and not a.failure_class}
    if not missing:
        return {}
    from hpctrain.collect import summary as co

    inp = co.from_registry(rec)
    try:
        record = co.summarize([inp])[0]
    except Exception:  # noqa: BLE001 - a broken run folder must not cost `status` its table
        return {}
    co.store_failure_classes(reg, [{**record, "_registry_attempts": inp.attempts}])
    lines: dict[int, str] = {}
    # A registry attempt is a job: its class is its last run's (an in-job restart or a requeue ran it again).
    rows = {str(r["job_id"]): r for r in record["attempts"]}
    for a in rec.attempts:
        row = rows.get(str(a.job_id))
        if a.attempt in missing and row and row["state"] == a.state and row.get("failure"):
            f = row["failure"]
            a.failure_class = row["failure_class"]
            where = " ".join(x for x in (f"rank {f['rank']}" if f.get("rank") is not None else "",
                                         f"on {f['host']}" if f.get("host") else "") if x)
            lines[int(row["attempt"])] = f"{f['failure_class']}{' ' + where if where else ''}: {f['message']}"
    return lines


def supervisor_deciding(rec: reglib.Run, job: str) -> str:
    """The supervisor job that watches `job` (attempts.jsonl note), while SLURM still lists it as not
    finished: its retry, if any, is about to become the run's next attempt."""
    from hpctrain import slurmcommands as commands
    from hpctrain.runs.journal import supervisors_of

    sups = supervisors_of(rec.folder, job)
    if not sups or rec.executor != "slurm":
        return ""
    try:
        state = commands.queue_state(sups[-1])
    except click.ClickException:
        return ""
    return sups[-1] if state and not is_final(normalize_state(state)) else ""


def request_cancel(folder: str, jobs: list[str]) -> None:
    """RUN/cancel-requested.json names the jobs this cancel stops (best effort: a read-only folder still cancels)."""
    from hpctrain.runs.folder import RunFolder, json_text, write_private

    run = RunFolder(folder)
    old = run.cancel_request() or {}
    jobs = list(dict.fromkeys([*(str(j) for j in old.get("jobs") or []), *jobs]))
    with contextlib.suppress(OSError):
        write_private(run.cancel_requested, json_text({"time": time.time(), "jobs": jobs, "by": "hpctrain cancel"}))


def log_lines(inp: RunInput, flt: LogFilter) -> Iterator[Line]:
    """A run's log as `hpctrain logs` prints it and `Run.logs()` returns it: every log file of the run (each
    attempt placed as every report places it), merged by time and filtered, with the journal's lines (hpctrain.
    collect.losses.LossNotes: a node lost, and the surviving ranks' peer errors after it marked as its
    consequences)."""
    from hpctrain.collect import logs as cl
    from hpctrain.collect.losses import LossNotes

    list_files, host_of = log_sources(inp)
    return cl.merged_lines(list_files(), host_of, flt, LossNotes.of_run(inp.folder))


def log_sources(inp: RunInput) -> tuple[Callable[[], list[LogFile]], Callable[[LogFile], str]]:
    """(list the files now, host of a file): hpctrain.collect.files.log_sources, each attempt placed as every
    report places it (hpctrain.runs.history)."""
    from hpctrain.collect import summary as co
    from hpctrain.collect.files import log_sources as sources

    return sources(inp.folder, inp.attempts, co._shape(inp).ranks_per_node)
