"""`hpctrain list`, `hpctrain status RUN`, `hpctrain cancel RUN` -- the registry's commands.

`register(group)` adds them to the main group (cli/main.py calls it). Only click at module level: the
registry, sacct wrapper and submitit-aware helpers load inside the commands.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from hpctrain.api.runs import pending_reasons as _pending_reasons
from hpctrain.states import JobState

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.runs.history import AttemptView
    from hpctrain.runs.registry import Registry, Run


def register(group: click.Group) -> None:
    group.add_command(list_runs)
    group.add_command(status)
    group.add_command(cancel)


# -- shared helpers -----------------------------------------------------------------------------
def _registry() -> Registry:
    from hpctrain.runs.registry import Registry

    return Registry()


def _shown_state(state: str, job_id: str, reasons: dict[str, str]) -> str:
    return f"{state} ({reasons[job_id]})" if state == JobState.PENDING and job_id in reasons else state


def _views(rec: Run) -> list[AttemptView]:
    """The run's attempts as every report counts them (hpctrain.runs.history): in-job restarts and requeues too."""
    from pathlib import Path

    from hpctrain.runs import history

    try:
        return history.views(history.job_rows(rec.attempts), Path(rec.folder), int(rec.spec.get("ranks_per_node") or 1))
    except (OSError, ValueError, TypeError):  # an unreadable folder: the registry's rows alone
        return [history.AttemptView.of(dict(r, how=history.SUBMITTED)) for r in history.job_rows(rec.attempts)]


def _view_dict(v: AttemptView) -> dict[str, object]:
    import dataclasses

    return {**dataclasses.asdict(v), "rank_hosts": {str(k): h for k, h in v.rank_hosts.items()}}


def _wait_line(rec: Run) -> str:
    """Why the run's latest attempt waits (the retry's decision said so), or ""."""
    from pathlib import Path

    from hpctrain.runs import history

    try:
        return history.wait_reason(history.job_rows(rec.attempts), Path(rec.folder))
    except (OSError, ValueError, TypeError):
        return ""


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0, int(time.time() - ts))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit} ago"
    return f"{s}s ago"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
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
    from hpctrain.api.runs import listing

    found = listing(None if show_all else 20)
    runs, warnings = found.records, found.warnings
    counts = {r.run_id: len(_views(r)) for r in runs}
    if as_json:
        click.echo(json.dumps([{**r.to_dict(), "attempt_count": counts[r.run_id]} for r in runs], indent=2,
                              default=str))
        _warn(warnings)
        return
    reasons = _pending_reasons(runs)
    rows = []
    for r in runs:
        a = r.latest
        rows.append([r.run_id, _shown_state(r.state, a.job_id, reasons) if a else r.state, a.job_id if a else "-",
                     str(counts[r.run_id]), r.executor,
                     str(r.spec.get("nodes", "-")), _age(r.created)])
    if rows:
        click.echo(_table(rows, ["RUN", "STATE", "JOB", "ATTEMPTS", "EXECUTOR", "NODES", "CREATED"]))
    else:
        click.echo(f"no runs yet (registry: {_registry().path})")
    _warn(warnings)


@click.command(short_help="Show one run and its attempts.")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--watch", is_flag=True, help="Follow the run live until its job ends (step, ETA, loss, checkpoint); "
              "exit 0 if it completed. Plain lines when not on a terminal.")
@click.option("--interval", type=click.FloatRange(0.5, 3600), default=5.0, show_default=True,
              help="Seconds between refreshes with --watch.")
def status(run: str, as_json: bool, watch: bool, interval: float) -> None:
    """Show RUN (id or unique prefix): state, folder, and every attempt, refreshed from SLURM."""
    from hpctrain.api.runs import Run as RunHandle

    if watch:
        from hpctrain.cli.watch import watch as follow

        raise SystemExit(follow(run, interval, as_json))

    st = RunHandle(run).status()
    rec, warnings, failures = st.record, st.warnings, st.failures
    reasons = _pending_reasons([rec])
    views = _views(rec)
    waiting = _wait_line(rec)
    if as_json:
        doc = rec.to_dict()
        for a in doc.get("attempts", []):
            if a.get("job_id") in reasons and a.get("state") == JobState.PENDING:
                a["pending_reason"] = reasons[a["job_id"]]
        doc["history"] = [_view_dict(v) for v in views]  # every attempt: in-job restarts and requeues too
        doc["waiting_because"] = waiting or None
        click.echo(json.dumps(doc, indent=2, default=str))
        _warn(warnings)
        return
    latest = rec.latest
    state = _shown_state(rec.state, latest.job_id, reasons) if latest else rec.state
    click.echo(f"run       {rec.run_id}\nstate     {state}\nfolder    {rec.folder}\n"
               f"executor  {rec.executor}\ncreated   {_age(rec.created)}")
    rows = [[str(v.attempt), v.step_id if v.how == "in_job" and v.step_id else v.job_id, v.how.replace("_", "-"),
             _shown_state(v.state, v.job_id, reasons), ",".join(v.hosts) or "-", _age(v.started), _age(v.ended),
             v.exit_code or "-", v.failure_class or "-"] for v in views]
    click.echo(_table(rows, ["ATTEMPT", "JOB", "HOW", "STATE", "NODES", "STARTED", "ENDED", "EXIT", "FAILURE"]))
    for v in views:
        for old, new in v.replaced.items():
            click.echo(f"attempt {v.attempt}: {old} replaced by the spare {new} ({v.label})")
    for k, line in sorted(failures.items()):
        click.echo(f"attempt {k}: {line}")
    if waiting:
        click.echo(f"waiting: {waiting}")
    _warn(warnings)


@click.command(short_help="Cancel a run's job.")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def cancel(run: str, as_json: bool) -> None:
    """Cancel RUN's unfinished attempts (scancel, or stop the local job) and record CANCELLED."""
    from hpctrain.api.runs import Run as RunHandle

    done = RunHandle(run).cancel()
    out = done.to_dict()
    if as_json:
        click.echo(json.dumps(out))
    elif done.jobs:
        click.echo(f"cancelled {done.run_id} (job {', '.join(done.jobs)})")
    else:
        click.echo(f"{done.run_id} is already {done.state}; nothing to cancel")
