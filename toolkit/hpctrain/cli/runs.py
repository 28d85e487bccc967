"""`hpctrain list`, `hpctrain status RUN`, `hpctrain cancel RUN` -- the registry's commands.

`register(group)` adds them to the main group (cli.py calls it). Only click at module level: the
registry, sacct wrapper and submitit-aware helpers load inside the commands.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.runs.registry import Registry, Run


def register(group: click.Group) -> None:
    group.add_command(list_runs)
    group.add_command(status)
    group.add_command(cancel)


# -- shared helpers -----------------------------------------------------------------------------
def _registry() -> Registry:
    from hpctrain.runs.registry import Registry

    return Registry()


def _find(reg: Registry, ref: str) -> Run:
    from hpctrain.errors import HpcUsageError
    from hpctrain.runs.registry import RunNotFound

    try:
        return reg.get_run(ref)
    except RunNotFound as exc:
        if exc.ambiguous:
            raise HpcUsageError(f"RUN = {ref!r}: matches several runs: {', '.join(exc.close)}. "
                                "Fix: give more of the run id") from None
        hint = f" Close matches: {', '.join(exc.close)}." if exc.close else ""
        raise HpcUsageError(f"RUN = {ref!r}: no such run in {reg.path}.{hint} "
                            "Fix: pick a run id from `hpctrain list --all`") from None


def refresh(reg: Registry, runs: list[Run]) -> list[str]:
    """Bring non-final attempts up to date: ONE sacct call for all SLURM jobs, /proc for local ones.

    Finished attempts are not asked about again once settled (SETTLE_S after their end): their
    state is cached in the registry.
    Returns warnings (e.g. sacct unavailable) instead of failing: cached states are still useful.
    """
    from hpctrain.runs import folder as runs_mod
    from hpctrain.runs.registry import FINAL_STATES

    now = time.time()
    pending = [(r, a) for r in runs for a in r.attempts if _unsettled(r.executor, a, now)]
    if not pending:
        return []
    warnings: list[str] = []
    fresh: dict[str, dict[str, Any]] = {}
    slurm_ids = [a.job_id for r, a in pending if r.executor == "slurm"]
    if slurm_ids:
        from hpctrain.slurm import commands as _slurm

        try:
            for jid, rec in _slurm.sacct_states(slurm_ids).items():
                fresh[jid] = {"state": rec.state, "nodes": rec.nodelist, "started": rec.start,
                              "ended": rec.end, "exit_code": rec.exit_code or None}
        except click.ClickException as exc:
            warnings.append(f"states may be stale: {exc.format_message()}")
    updates = []
    for run, att in pending:
        if run.executor == "local":
            from pathlib import Path

            from hpctrain.slurm.dispatch import local_state

            # The reason (e.g. "see 123_0_result.pkl") is for humans; collect assigns failure classes.
            state, _ = local_state(Path(run.folder), att.job_id)
            fields: dict[str, Any] = {"state": state}
            if state in FINAL_STATES:
                fields["ended"] = time.time()
        elif att.job_id in fresh:
            fields = {k: v for k, v in fresh[att.job_id].items() if v not in (None, "")}
        else:
            continue  # sacct does not know it yet (just submitted): keep what we have
        changed = {k: v for k, v in fields.items() if getattr(att, k) != v}
        if not changed:
            continue
        updates.append((run.run_id, att.attempt, changed))
        for k, v in changed.items():
            setattr(att, k, v)
        run.state = run.attempts[-1].state
        if att.final:
            line = {"attempt": att.attempt, "job_id": att.job_id, "state": att.state, "nodes": att.nodes,
                   "started": att.started, "ended": att.ended, "exit_code": att.exit_code,
                   "failure_class": att.failure_class}
            try:
                runs_mod.append_attempt(runs_mod.RunFolder(run.folder).attempts_jsonl, line)
            except OSError:
                pass  # the run folder may be gone; the registry still has it
    return warnings + reg.cache_updates(updates)  # a busy registry must not block a read


def _reconcile(reg: Registry, runs: list[Run]) -> list[str]:
    """Submissions of unknown outcome -> their real job (hpctrain.slurm.uncertain); before refresh."""
    from hpctrain.slurm.uncertain import reconcile

    return reconcile(reg, runs)


# slurmdbd can report a just-finished job as COMPLETED before its record is whole (seen: a 4-node
# job listed on "node1" for a moment), so a SLURM attempt is re-read for this long after it ends.
SETTLE_S = 60.0


def _unsettled(executor: str, att: Any, now: float) -> bool:
    if not att.final:
        return True
    return executor == "slurm" and (att.ended is None or now - att.ended < SETTLE_S)


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0, int(time.time() - ts))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit} ago"
    return f"{s}s ago"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [header, *rows])


def _warn(warnings: list[str]) -> None:
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


# -- commands -----------------------------------------------------------------------------------
@click.command("list", short_help="List runs, newest first.")
@click.option("--all", "show_all", is_flag=True, help="Every run, not only the 20 newest.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_runs(show_all: bool, as_json: bool) -> None:
    """List runs from the registry, newest first, with states refreshed from SLURM."""
    reg = _registry()
    runs = reg.list_runs(limit=None if show_all else 20)
    warnings = _reconcile(reg, runs) + refresh(reg, runs) + reg.warnings
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in runs], indent=2, default=str))
        _warn(warnings)
        return
    rows = []
    for r in runs:
        a = r.latest
        rows.append([r.run_id, r.state, a.job_id if a else "-", str(len(r.attempts)), r.executor,
                     str(r.spec.get("nodes", "-")), _age(r.created)])
    if rows:
        click.echo(_table(rows, ["RUN", "STATE", "JOB", "ATTEMPTS", "EXECUTOR", "NODES", "CREATED"]))
    else:
        click.echo(f"no runs yet (registry: {reg.path})")
    _warn(warnings)


@click.command(short_help="Show one run and its attempts.")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(run: str, as_json: bool) -> None:
    """Show RUN (id or unique prefix): state, folder, and every attempt, refreshed from SLURM."""
    reg = _registry()
    rec = _find(reg, run)
    warnings = _reconcile(reg, [rec]) + refresh(reg, [rec]) + reg.warnings
    if as_json:
        click.echo(json.dumps(rec.to_dict(), indent=2, default=str))
        _warn(warnings)
        return
    click.echo(f"run       {rec.run_id}\nstate     {rec.state}\nfolder    {rec.folder}\n"
               f"executor  {rec.executor}\ncreated   {_age(rec.created)}")
    rows = [[str(a.attempt), a.job_id, a.state, a.nodes or "-", _age(a.started), _age(a.ended),
             a.exit_code or "-", a.failure_class or "-"] for a in rec.attempts]
    click.echo(_table(rows, ["ATTEMPT", "JOB", "STATE", "NODES", "STARTED", "ENDED", "EXIT", "FAILURE"]))
    _warn(warnings)


@click.command(short_help="Cancel a run's job.")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def cancel(run: str, as_json: bool) -> None:
    """Cancel RUN's unfinished attempts (scancel, or stop the local job) and record CANCELLED."""
    import os
    import signal

    reg = _registry()
    rec = _find(reg, run)
    _reconcile(reg, [rec])  # an unanswered submission's job is cancelled too, once SLURM lists it
    refresh(reg, [rec])
    live = [a for a in rec.attempts if not a.final]
    if rec.executor == "slurm" and live:
        from hpctrain.slurm import commands as _slurm

        _slurm.scancel([a.job_id for a in live])  # raises (nothing recorded) if slurmctld is down
    elif live:
        for a in live:
            try:
                os.kill(int(a.job_id), signal.SIGTERM)  # submitit's controller forwards it to the tasks
            except (OSError, ValueError):
                pass
    now = time.time()
    reg.update_attempts([(rec.run_id, a.attempt, {"state": "CANCELLED", "ended": now}) for a in live])
    out = {"run_id": rec.run_id, "cancelled": [a.job_id for a in live],
           "state": "CANCELLED" if live else rec.state}
    if as_json:
        click.echo(json.dumps(out))
    elif live:
        click.echo(f"cancelled {rec.run_id} (job {', '.join(out['cancelled'])})")
    else:
        click.echo(f"{rec.run_id} is already {rec.state}; nothing to cancel")
