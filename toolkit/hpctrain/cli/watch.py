"""`hpctrain status RUN --watch` (the live view; `cli/runs.py`'s status calls `watch`) and `hpctrain stacks RUN`.

The watch refreshes the run from SLURM every `--interval` seconds (one sacct call, plus squeue for the
pending reason) and reads the run folder's progress (hpctrain.collect.progress). On a terminal it draws a
rich Live panel; otherwise it prints one plain line whenever what it shows changes. It ends when the job
has ended and no supervisor job is still deciding about a retry, with exit code 0 when the run completed
and 1 otherwise. Only click at module level: rich, the registry and SLURM load inside the commands.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpctrain.states import JobState, normalize_state

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.collect.progress import Progress
    from hpctrain.runs.history import AttemptView
    from hpctrain.runs.registry import Registry, Run


def register(group: click.Group) -> None:
    group.add_command(stacks)


# -- the watch ------------------------------------------------------------------------------------------
STALL_S = 30  # a newest step record older than this is shown ("no step for 60 s"): a hang, a slow save


class Snapshot:
    """One look at the run: its current attempt (hpctrain.runs.history: an in-job restart or a requeue is one),
    its state as SLURM sees it, why it waits, and its progress."""

    def __init__(self, rec: Run, progress: Progress, state: str, reason: str, deciding: str,
                 now: float | None = None, current: AttemptView | None = None, waiting: str = "") -> None:
        self.rec, self.progress, self.state, self.reason, self.deciding = rec, progress, state, reason, deciding
        self.now = time.time() if now is None else now
        self.current, self.waiting = current, waiting
        att = rec.latest
        self.job = att.job_id if att else "-"
        self.attempt = current.attempt if current else att.attempt if att else 0
        self.where = current.label if current else f"job {self.job}"

    @property
    def ended(self) -> bool:
        from hpctrain.states import is_final

        return is_final(self.state) and not self.deciding

    def fields(self) -> list[tuple[str, str]]:
        p = self.progress
        state = self.state + (f" ({self.reason})" if self.reason and self.reason != "None" else "")
        if self.waiting:
            state += f"; waiting: {self.waiting}"
        if self.deciding:
            state += f"; supervisor job {self.deciding} is deciding about a retry"
        step = "-" if p.step is None else str(p.step)
        total = "?" if p.total is None else str(p.total)
        pct = f" ({100 * p.step / p.total:.0f}%)" if p.step is not None and p.total else ""
        quiet = self.now - p.updated if p.updated is not None and not self.ended else 0.0
        if quiet >= STALL_S:  # in whole STALL_S steps: a plain line per change, not one per second
            pct += f", no step for {int(quiet // STALL_S * STALL_S)} s"
        swaps = ", ".join(f"{old} replaced by the spare {new}" for old, new in (self.current.replaced.items()
                                                                             if self.current else ()))
        return [("run", self.rec.run_id), ("job", f"{self.where} (attempt {self.attempt})"), ("state", state),
                *([("nodes", swaps)] if swaps else []),
                ("step", f"{step}/{total}{pct}"), ("loss", "-" if p.loss is None else f"{p.loss:.4f}"),
                ("tokens/s", "-" if p.tokens_per_s is None else f"{p.tokens_per_s:,.0f}"),
                ("ETA", _eta(p.eta_s, p.step_s)),
                ("checkpoint", "none yet" if p.checkpoint is None else f"step-{p.checkpoint}")]

    def line(self) -> str:
        return " | ".join(f"{k} {v}" for k, v in self.fields() if k != "run")


def _eta(eta_s: float | None, step_s: float | None) -> str:
    if eta_s is None:
        return "-"
    s = round(eta_s)
    h, rest = divmod(s, 3600)
    text = f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"
    return text + (f" ({step_s:.2f} s/step)" if step_s else "")


def snapshot(reg: Registry, run_id: str) -> Snapshot:
    from hpctrain import slurmcommands as commands
    from hpctrain.api.runs import supervisor_deciding
    from hpctrain.collect.progress import read_progress
    from hpctrain.slurm.refresh import refresh
    from hpctrain.states import is_final

    rec = reg.get_run(run_id)
    refresh(reg, [rec])
    att = rec.latest
    state, reason, deciding = (att.state if att else rec.state), "", ""
    if att is not None and rec.executor == "slurm" and not att.final:
        try:
            live, reason = commands.queue_reason(att.job_id)
            state = normalize_state(live) if live else state  # squeue is fresher than sacct
        except click.ClickException:
            pass
    if att is not None and is_final(state):
        deciding = supervisor_deciding(rec, att.job_id)  # what Run.wait() asks too
    current, waiting = _current(rec)
    # No ETA while the attempt waits in the queue; an in-job restart has none until its own steps give a rate.
    queued = state in (JobState.PENDING, JobState.REQUEUE_HOLD, JobState.SUBMIT_UNKNOWN)
    progress = read_progress(Path(rec.folder), started=current.started if current else None, waiting=queued)
    return Snapshot(rec, progress, state, reason, deciding, current=current, waiting=waiting)


def _current(rec: Run) -> tuple[AttemptView | None, str]:
    """The run's current attempt as every report counts them, and why it waits ("" when nothing says)."""
    from hpctrain.runs import history

    folder = Path(rec.folder)
    try:
        rows = history.job_rows(rec.attempts)
        views = history.views(rows, folder, int(rec.spec.get("ranks_per_node") or 1))
        return (views[-1] if views else None), history.wait_reason(rows, folder)
    except (OSError, ValueError, TypeError):  # an unreadable folder: the registry's latest attempt alone
        return None, ""


def watch(ref: str, interval: float, as_json: bool = False) -> int:
    """Refresh until the run's job ended (see module docstring); the exit code says how it ended."""
    from hpctrain.runs.registry import Registry
    from hpctrain.runs.resolve import registered_run

    reg = Registry()
    run_id = registered_run(reg, ref).run_id
    interval = max(0.5, interval)
    live = sys.stdout.isatty() and not as_json
    snap = _rich_loop(reg, run_id, interval) if live else _plain_loop(reg, run_id, interval, as_json)
    ok = snap.state == JobState.COMPLETED
    if not as_json:
        click.echo(f"run {run_id} ended: job {snap.job} {snap.state}"
                   + ("" if ok else f"; `hpctrain summary {run_id}` says why"))
    return 0 if ok else 1


def _plain_loop(reg: Registry, run_id: str, interval: float, as_json: bool) -> Snapshot:
    last = ""
    while True:
        snap = snapshot(reg, run_id)
        text = json.dumps(_as_dict(snap)) if as_json else snap.line()
        if text != last:
            click.echo(text if as_json else f"{time.strftime('%H:%M:%S')} {text}")
            last = text
        if snap.ended:
            return snap
        time.sleep(interval)


def _as_dict(snap: Snapshot) -> dict[str, Any]:
    cur = snap.current
    return {"run_id": snap.rec.run_id, "job_id": snap.job, "attempt": snap.attempt, "state": snap.state,
            "step_id": cur.step_id if cur else "", "how": cur.how if cur else None,
            "replaced": cur.replaced if cur else {}, "waiting_because": snap.waiting or None,
            "reason": snap.reason, "supervisor_deciding": snap.deciding or None, **snap.progress.to_dict()}


def _rich_loop(reg: Registry, run_id: str, interval: float) -> Snapshot:
    from rich.live import Live

    snap = snapshot(reg, run_id)
    with Live(_panel(snap), refresh_per_second=4, transient=False) as view:
        while not snap.ended:
            time.sleep(interval)
            snap = snapshot(reg, run_id)
            view.update(_panel(snap))
    return snap


def _panel(snap: Snapshot) -> Any:
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in snap.fields()[1:]:
        grid.add_row(key, value)
    p = snap.progress
    if p.total:
        grid.add_row("", ProgressBar(total=p.total, completed=p.step or 0, width=40))
    return Panel(grid, title=f"hpctrain {snap.rec.run_id}", subtitle=f"{time.strftime('%H:%M:%S')}, Ctrl-C leaves")


# -- stacks ---------------------------------------------------------------------------------------------
@click.command(short_help="Print every rank's Python stack, grouped by identical frames.")
@click.argument("run")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1, 600), default=15.0, show_default=True,
              help="Seconds to wait for every rank's dump.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def stacks(run: str, timeout_s: float, as_json: bool) -> None:
    """Ask every rank of RUN's running job to dump its Python stack (SIGURG, see hpctrain.runs.stacks) into
    RUN_DIR/stacks/, wait for the dumps (bounded by --timeout), and print them with ranks whose stacks are
    identical collapsed into one group. Exit 1 when no rank answered."""
    from hpctrain.collect import stacks as cs
    from hpctrain.errors import HpcUsageError
    from hpctrain.runs.registry import Registry
    from hpctrain.runs.resolve import registered_run

    reg = Registry()
    snap = snapshot(reg, registered_run(reg, run).run_id)
    rec, folder = snap.rec, Path(snap.rec.folder)
    if snap.state != JobState.RUNNING:
        raise HpcUsageError(f"RUN = {run!r}: job {snap.job} is {snap.state}, not RUNNING: only a running job's ranks "
                            f"can dump their stacks. Fix: wait until it runs; earlier dumps (the watchdog's before it "
                            f"cancelled a hung job) are in {folder / 'stacks'}")
    send = cs.slurm_sender(snap.job) if rec.executor == "slurm" else cs.local_sender(folder)
    rep = cs.request(folder, send, cs.expected_ranks(folder), timeout_s=timeout_s)
    if as_json:
        click.echo(json.dumps({"run_id": rec.run_id, "job_id": snap.job, **rep.to_dict()}, indent=1))
    else:
        click.echo(cs.format_report(rep, f"run {rec.run_id}, job {snap.job}"))
    if not rep.dumps:
        raise SystemExit(1)
