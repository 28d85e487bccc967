"""`hpctrain submit --after RUN[:ok|any]`: wait for other runs, through SLURM's --dependency.

RUN is any run reference (hpctrain.runs.resolve: `last`, an id or prefix, a name, a run folder); its current
SLURM job is the latest attempt's job id, with its state refreshed from SLURM first. `ok` (the default) is
`afterok` (start only if that job completes), `any` is `afterany` (start when it ends, however). Refused: a
run without a SLURM job id (local, or a submission of unknown outcome), and `ok` on a run that already
failed (the job would pend forever with DependencyNeverSatisfied). A run that already ended in a way that
satisfies the wait adds no dependency (SLURM forgets finished jobs, and sbatch refuses a dependency on a job
it no longer knows). Several --after must all hold (joined with ',').

The dependency names the job id of the moment: when the supervisor retries RUN under a new job id, a job
waiting `afterok` on the failed attempt stays pending (DependencyNeverSatisfied); cancel and submit it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import HpcUsageError
from hpctrain.runs.folder import RunFolder
from hpctrain.states import JobState, is_final

KINDS = {"ok": "afterok", "any": "afterany"}


@dataclass(frozen=True)
class Wait:
    """One --after: the run it names, its job, what SLURM is asked; `item` is "" when already satisfied."""

    ref: str
    run_id: str
    job_id: str
    state: str
    item: str  # "afterok:123", or "" when the wait is already over
    note: str = ""


def parse(text: str) -> tuple[str, str]:
    """`RUN`, `RUN:ok`, `RUN:any` -> (RUN, kind)."""
    ref, sep, kind = text.rpartition(":")
    if not sep or kind not in KINDS:
        ref, kind = text, "ok"
    if not ref.strip():
        raise HpcUsageError(f"--after = {text!r}: no run named. Fix: write --after RUN[:ok|any], e.g. --after last")
    return ref, kind


def resolve_waits(refs: Sequence[str]) -> list[Wait]:
    """Each --after resolved against the registry and SLURM (one refresh for all)."""
    if not refs:
        return []
    from hpctrain.runs.registry import Registry
    from hpctrain.runs.resolve import resolve_run
    from hpctrain.slurm.refresh import refresh

    reg = Registry()
    parsed = [(text, *parse(text)) for text in refs]
    found = [(text, kind, resolve_run(reg, ref)) for text, ref, kind in parsed]
    refresh(reg, [f.run for _, _, f in found if f.run is not None])
    return [_wait(text, kind, f.folder, f.run) for text, kind, f in found]


def _wait(text: str, kind: str, folder: Path, run: object) -> Wait:
    executor, job_id, state = _latest(folder, run)
    run_id = folder.name
    if executor == "local":
        raise HpcUsageError(f"--after = {text!r}: run {run_id} ran on the local executor, which SLURM cannot wait "
                            "for. Fix: wait for it by hand, or submit without --after")
    if not job_id or state == JobState.SUBMIT_UNKNOWN:
        raise HpcUsageError(f"--after = {text!r}: run {run_id} has no SLURM job id (state {state or 'unknown'}). "
                            f"Fix: `hpctrain status {run_id}` reconciles it; submit again once it has a job")
    if is_final(state):
        if kind == "ok" and state != JobState.COMPLETED:
            raise HpcUsageError(f"--after = {text!r}: run {run_id} already ended {state} (job {job_id}), so a job "
                                f"waiting for it to succeed would never start. Fix: `hpctrain resubmit {run_id}` "
                                f"and wait for the new attempt, or use --after {run_id}:any")
        return Wait(text, run_id, job_id, state, "", f"run {run_id} already ended {state}: nothing to wait for")
    return Wait(text, run_id, job_id, state, f"{KINDS[kind]}:{job_id}")


def _latest(folder: Path, run: object) -> tuple[str, str, str]:
    """(executor, job id, state) of the run's latest attempt: the registry's, else its attempts.jsonl."""
    latest = getattr(run, "latest", None)
    if latest is not None:
        return str(getattr(run, "executor", "")), str(latest.job_id or ""), str(latest.state or "")
    records = [r for r in RunFolder(folder).read_attempts() if "attempt" in r]
    if not records:
        return "", "", ""
    last = max(records, key=lambda r: int(r.get("attempt", 0)))
    same = [r for r in records if r.get("attempt") == last.get("attempt")]
    state = str(same[-1].get("state", ""))
    executor = str(next((r["executor"] for r in records if r.get("executor")), ""))
    # The submission's intent line (hpctrain.slurm.transaction) has no job id yet; the settling line has it.
    job_id = next((str(r["job_id"]) for r in reversed(same) if r.get("job_id")), "")
    return executor, job_id, state


def dependency(waits: Sequence[Wait]) -> str:
    """sbatch's --dependency value: every wait must hold ("afterok:1,afterany:2"), "" when none is left."""
    return ",".join(dict.fromkeys(w.item for w in waits if w.item))
