"""A submission is a transaction: from the moment sbatch may queue a job until the registry holds it, no signal,
timeout or crash loses it (issue 27, item 1).

The sequence, the same for a new run, a sweep and a resubmission (hpctrain.slurm.dispatch runs it):

1. **intent**: each run folder's attempts.jsonl gets a line (fsynced) saying `SUBMIT_UNKNOWN`, with the tag the
   job will carry as its `--comment` and the name its pickle waits under; the registry gets the same row. This is
   before sbatch, so a process killed at any later point (SIGKILL, a crash, an outer `timeout -s KILL`) leaves a
   run that `list`, `status` and `registry rebuild` see, and reconcile by asking SLURM for the tag
   (hpctrain.slurm.uncertain.reconcile): the job it finds, or SUBMIT_FAILED once SLURM has listed no such job
   for the grace period.
2. **sbatch**, in a session of its own (hpctrain.slurmcommands.sbatch), so a Ctrl-C at the terminal does not kill
   it half-way through queueing the job.
3. **settle**: the job id and PENDING into attempts.jsonl and the registry. A registry that fails here costs a
   warning, never the submission: the run is recorded (step 1) and its folder holds the job id.

SIGINT, SIGTERM and SIGHUP are held from step 1 to the end of step 3. One that arrives before sbatch runs
withdraws the intent (nothing was queued: the registry forgets the run and the folder goes) and then takes
effect; one that arrives while sbatch runs stops the wait (sbatch, in its own session, finishes queueing on its
own; the run stays SUBMIT_UNKNOWN for its tag to resolve), so an outer `timeout` is obeyed at once; one that
arrives later takes effect once the job is recorded, with a line on stderr naming the job and how to cancel
it. SIGKILL cannot be held; step 1 is what makes it harmless.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Self

import click
import tomllib

from hpctrain.runs import folder as runs_mod
from hpctrain.slurm.uncertain import SubmitUncertain, submission_tag
from hpctrain.states import JobState

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.slurm.dispatch import Submitted

_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SUBMITTING = "submitting: sbatch has not answered yet"

# The tests' hook into the sequence (tests/test_submit_transaction.py): with HPCTRAIN_SUBMIT_PAUSE_AT=POINT the
# submitting process writes "PID TAG" into $HPCTRAIN_SUBMIT_PAUSE_FILE at POINT and waits there until that file is
# removed, a held signal arrives, or PAUSE_MAX_S pass, so that a test can deliver a real signal at each point.
PAUSE_POINTS = ("intent", "sbatch", "settled")
PAUSE_MAX_S = 60.0


class Interrupted(click.Abort):
    """A signal arrived before sbatch ran: the intent is withdrawn, nothing was queued."""


class HeldSignals:
    """SIGINT, SIGTERM and SIGHUP held while the block runs (main thread only; a signal the process ignores stays
    ignored), then delivered as if they arrived at its end, after `note()`'s line (if any) on stderr. For any
    sbatch whose job must not be lost to an interrupt (a submission; `data prepare --submit`'s job)."""

    def __init__(self, note: Callable[[str], str] | None = None) -> None:
        self.pending: list[int] = []
        self._old: dict[int, Any] = {}
        self._note = note

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig in _HELD:
                old = signal.getsignal(sig)
                if old in (signal.SIG_IGN, None):  # ignored (nohup), or set outside Python: left alone
                    continue
                self._old[sig] = old
                signal.signal(sig, self._hold)
        return self

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)

    @property
    def interrupted(self) -> bool:
        return bool(self.pending)

    def note(self, signame: str) -> str:
        """The line stderr gets before a held signal takes effect ("" for none)."""
        return self._note(signame) if self._note is not None else ""

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        if not self.pending:
            return
        sig = self.pending[0]
        self.pending = []
        line = self.note(signal.Signals(sig).name)
        if line:
            click.echo(line, err=True)
        os.kill(os.getpid(), sig)  # as if it arrived now: its own handler (KeyboardInterrupt, or the default)


class Transaction(HeldSignals):
    """The intent, the held signals and the settling of one submission (see the module's docstring).

    Transaction(dirs, staging=..., name=..., summary=..., mode="train", attempt=0, record=None) is a context
    manager: `begin()` before sbatch, then `settle(subs)`, `unknown(exc)` or `withdraw(reason)`.
    `staging` is the folder where the pickles wait for their job id (`pickles`, one per run folder)."""

    def __init__(self, dirs: Sequence[Path], *, staging: Path, name: str, summary: dict[str, Any], mode: str,
                 attempt: int = 0, record: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.dirs = [Path(d) for d in dirs]
        self.name, self.summary, self.mode, self.attempt = name, summary, mode, attempt
        self.record = dict(record or {})
        self.tag = submission_tag(self.dirs, attempt)
        self.pickles = [staging / f".{uuid.uuid4().hex}.pkl" for _ in self.dirs]
        self.submitted = time.time()
        self.settled: list[Submitted] = []
        self.unsettled = False  # sbatch may have queued the job, its id unknown (`unknown`)

    def note(self, signame: str) -> str:
        first = self.dirs[0].name
        if self.unsettled:
            return (f"hpctrain: {signame} arrived while sbatch ran; the run {first} is kept as SUBMIT_UNKNOWN: "
                    f"`hpctrain status {first}` finds its job by its comment {self.tag}, or marks it SUBMIT_FAILED "
                    "if SLURM never lists one")
        if self.settled:
            ids = ", ".join(s.job_id for s in self.settled)
            run = self.settled[0].run_id
            return (f"hpctrain: {signame} arrived while submitting; job {ids} is queued and recorded as run "
                    f"{run}{' and more' if len(self.settled) > 1 else ''}: `hpctrain cancel {run}` stops it")
        return ""

    def pause(self, point: str) -> None:
        """The tests' hook (PAUSE_POINTS); nothing unless HPCTRAIN_SUBMIT_PAUSE_AT names `point`."""
        path = os.environ.get("HPCTRAIN_SUBMIT_PAUSE_FILE", "")
        if os.environ.get("HPCTRAIN_SUBMIT_PAUSE_AT") != point or not path:
            return
        Path(path).write_text(f"{os.getpid()} {self.tag}", encoding="utf-8")
        deadline = time.monotonic() + PAUSE_MAX_S
        while Path(path).exists() and not self.pending and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- the records --------------------------------------------------------------------------
    def _line(self, i: int, **fields: Any) -> dict[str, Any]:
        return {**self.record, "attempt": self.attempt, **fields}

    def begin(self) -> None:
        """Step 1: the durable intent, in every run folder and then in the registry (which raises when it
        cannot: nothing is queued yet, so the caller refuses the submission)."""
        from hpctrain.runs.registry import SUBMIT_UNKNOWN, Attempt, Registry

        for i, d in enumerate(self.dirs):
            runs_mod.append_attempt(runs_mod.RunFolder(d).attempts_jsonl, self._line(
                i, job_id="", state=SUBMIT_UNKNOWN, submitted=self.submitted, executor="slurm", mode=self.mode,
                note=SUBMITTING, tag=self.tag, pickle=str(self.pickles[i])), fsync=True)
        items: list[tuple[dict[str, Any] | None, Attempt]] = []
        for i, d in enumerate(self.dirs):
            att = Attempt(run_id=d.name, attempt=self.attempt, job_id="", state=SUBMIT_UNKNOWN,
                          submitted=self.submitted, note=SUBMITTING, tag=self.tag)
            run = None if self.attempt else {
                "run_id": d.name, "name": self.name, "folder": str(d), "executor": "slurm",
                "created": self.submitted,
                "spec": {**(point_summary(d, self.summary) if i else self.summary),
                         "array_index": i if len(self.dirs) > 1 else None}}
            items.append((run, att))
        try:
            Registry().record_intent(items)
        except Exception:
            if self.attempt:
                return  # a run another registry holds (another state dir): its folder is the record
            raise

    def withdraw(self, reason: str, remove: bool = False) -> None:
        """Nothing was queued: a new run is forgotten by the registry (its folder removed here with `remove`,
        when a held signal may end the process before the caller could, else by the caller); a new attempt of
        a run is recorded as SUBMIT_FAILED with the reason."""
        from hpctrain.runs.registry import SUBMIT_FAILED, Registry

        try:
            if not self.attempt:
                Registry().remove_runs([d.name for d in self.dirs])
                if remove:
                    for d in self.dirs:
                        runs_mod.remove_run_folder(d)
                return
            fields = {"state": SUBMIT_FAILED, "ended": time.time(), "note": f"not submitted: {reason}"[:500]}
            for i, d in enumerate(self.dirs):
                runs_mod.append_attempt(runs_mod.RunFolder(d).attempts_jsonl, self._line(i, **fields))
            Registry().update_attempts([(d.name, self.attempt, fields) for d in self.dirs])
        except Exception as exc:  # noqa: BLE001 - the refusal the caller raises matters more than this note
            click.echo(f"warning: the withdrawn submission could not be cleared from the registry ({exc}); "
                       "`hpctrain list` marks it SUBMIT_FAILED after the grace period", err=True)

    def unknown(self, exc: Any) -> SubmitUncertain:
        """sbatch may have queued the job: the intent stays, with sbatch's reason; the error says what to do."""
        from hpctrain.runs.registry import SUBMIT_UNKNOWN, Registry

        reason = str(exc.reason)
        self.unsettled = True
        for i, d in enumerate(self.dirs):
            runs_mod.append_attempt(runs_mod.RunFolder(d).attempts_jsonl, self._line(i, note=reason))
        recorded = ""
        try:
            Registry().update_attempts([(d.name, self.attempt, {"note": reason}) for d in self.dirs])
        except Exception as rexc:  # noqa: BLE001 - attempts.jsonl holds the record; `registry rebuild` reads it
            recorded = f" (the registry could not take the reason: {rexc}; `hpctrain registry rebuild` will)"
        first = self.dirs[0].name
        more = f" and {len(self.dirs) - 1} more" if len(self.dirs) > 1 else ""
        return SubmitUncertain(
            f"run {first}{more}: {reason}. The job may or may not be queued, so its run folder is kept and the run "
            f"is recorded as {SUBMIT_UNKNOWN}{recorded}. Fix: do not submit it again; `hpctrain status {first}` "
            f"finds the job by its comment {self.tag} once SLURM lists it, or marks the run SUBMIT_FAILED if SLURM "
            "never does (`squeue --me -o '%i %k'` shows comments too)")

    def settle(self, subs: list[Submitted]) -> None:
        """Step 3: the job ids, into every run folder and the registry. Never raises for the registry."""
        from hpctrain.runs.registry import Registry

        self.settled = list(subs)
        for i, s in enumerate(subs):
            try:
                runs_mod.append_attempt(runs_mod.RunFolder(s.run_dir).attempts_jsonl, self._line(
                    i, job_id=s.job_id, state=JobState.PENDING, submitted=self.submitted, executor=s.executor,
                    mode=self.mode, note=None, ended=None))
            except OSError as exc:  # the intent line stays: `status` finds the job by its tag
                click.echo(f"warning: job {s.job_id} is queued, but {s.run_dir} could not record its id ({exc})",
                           err=True)
        # `ended` cleared too: a `list` elsewhere may have marked the intent SUBMIT_FAILED meanwhile (a grace
        # period shorter than this sbatch took); the job's id and state are the truth now.
        fields = [(s.run_id, self.attempt, {"job_id": s.job_id, "state": JobState.PENDING, "note": None,
                                            "ended": None}) for s in subs]
        try:
            Registry().update_attempts(fields)
        except Exception as exc:  # noqa: BLE001 - the job IS queued and recorded (the intent); say so, go on
            ids = ", ".join(sorted({s.job_id.split("_")[0] for s in subs}))
            click.echo(f"warning: job {ids} is queued and its run folder records it, but the registry could not "
                       f"take its job id now ({exc}); `hpctrain status {subs[0].run_id}` finds it by its comment "
                       f"{self.tag}, and `hpctrain registry rebuild` restores the registry", err=True)


def point_summary(run_dir: Path, first: dict[str, Any]) -> dict[str, Any]:
    """A sweep point differs from the first only in train/parallel/data/model keys (an array has one
    allocation shape): patch the first point's list/status columns from this point's spec.toml and plan.json.

    Plain tomllib/json reads, not a re-validation: this runs 1,000 times for a 1,000-point sweep.
    """
    out = dict(first)
    folder = runs_mod.RunFolder(run_dir)
    try:
        doc = tomllib.loads(folder.spec_toml.read_text(encoding="utf-8"))
        facts = json.loads(folder.plan_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return out  # informative only: never fail a submission over a summary
    train, par, model = doc.get("train", {}), doc.get("parallel", {}), doc.get("model", {})
    picks = {"steps": train.get("steps"), "lr": train.get("lr"), "offload": par.get("offload"),
             "pp": par.get("pp"), "tp": par.get("tp"), "data": doc.get("data", {}).get("source"),
             "model": model.get("path") or model.get("config"), "micro_batch": facts.get("micro_batch"),
             "global_batch": facts.get("global_batch"), "zero": facts.get("zero_stage")}
    out.update({k: v for k, v in picks.items() if v is not None})
    return out
