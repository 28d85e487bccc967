"""`hpctrain logs RUN` and `hpctrain summary [RUN ...|--all]` -- the collector's commands.

`register(group)` adds them to the main group (cli/main.py calls it). Only click at module level: rich,
the registry, sacct and matplotlib load inside the commands.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpctrain.states import FailureClass, is_final

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.collect.summary import RunInput
    from hpctrain.runs.registry import Registry


def register(group: click.Group) -> None:
    group.add_command(logs)
    group.add_command(summary)


def _registry() -> Registry:
    from hpctrain.runs.registry import Registry

    return Registry()


def _one_run(ref: str) -> tuple[RunInput, Registry]:
    from hpctrain.collect.summary import resolve_refs
    from hpctrain.errors import HpcUsageError

    reg = _registry()
    found, errors, _ = resolve_refs(reg, [ref], all_runs=False)
    if not found:
        raise HpcUsageError(errors[0] if errors else f"RUN = {ref!r}: not found")
    for w in found[0].warnings:
        click.echo(f"warning: {w}", err=True)
    return found[0], reg


# -- logs -------------------------------------------------------------------------------------------
@click.command(short_help="Per-rank logs of a run, merged by time.")
@click.argument("run")
@click.option("--attempt", "-a", type=int, default=None, help="Only attempt K (0 = first).")
@click.option("--rank", "-r", type=int, default=None, help="Only rank N.")
@click.option("--host", default=None, help="Only ranks on host H.")
@click.option("--grep", "pattern", default=None, metavar="RE", help="Only lines matching this regular expression.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends (Ctrl-C stops).")
def logs(run: str, attempt: int | None, rank: int | None, host: str | None, pattern: str | None,
         follow: bool) -> None:
    """Print RUN's per-rank logs across attempts, merged by time; each line is tagged
    `a<attempt> r<rank> <host>`. Attempts without rank logs show submitit's task logs instead. Where the run's
    journal records a lost node, a `journal` line says which, and the surviving ranks' peer errors after it are
    marked as its consequences."""
    from hpctrain.api.runs import log_lines, log_sources
    from hpctrain.collect import logs as cl
    from hpctrain.collect.losses import LossNotes
    from hpctrain.errors import HpcUsageError

    grep = None
    if pattern is not None:
        try:
            grep = re.compile(pattern)
        except re.error as exc:
            raise HpcUsageError(f"--grep = {pattern!r}: not a regular expression ({exc}). "
                                "Fix: escape special characters, e.g. 'loss \\d'") from None
    inp, reg = _one_run(run)
    if not inp.folder.is_dir():
        raise click.ClickException(f"run folder {inp.folder} of {inp.run_id} is missing (moved, deleted, or its "
                                   "filesystem is not mounted here): no logs to show")
    flt = cl.LogFilter(attempt, rank, host, grep)

    def emit(ln: cl.Line) -> None:
        click.echo(ln.tagged())

    if not follow:
        shown = 0
        for line in log_lines(inp, flt):  # what Run.logs() returns too
            emit(line)
            shown += 1
        if not shown and flt == cl.LogFilter(None, None, None, None):
            click.echo(f"no logs yet in {inp.folder / 'logs'} (the job may still be pending)", err=True)
        return
    list_files, host_of = log_sources(inp)
    try:
        cl.follow(list_files, host_of, flt, _finished_check(inp, reg), emit, notes=LossNotes.of_run(inp.folder))
    except KeyboardInterrupt:
        click.echo("", err=True)


def _finished_check(inp: RunInput, reg: Registry, every_s: float = 10.0) -> Callable[[], bool]:
    """True once the run's latest attempt is final; asks sacct at most every `every_s` seconds."""

    last = {"t": 0.0, "done": False}

    def finished() -> bool:
        if last["done"] or time.monotonic() - last["t"] < every_s:
            return bool(last["done"])
        last["t"] = time.monotonic()
        try:
            from hpctrain.slurm.refresh import refresh

            run = reg.get_run(inp.run_id)
            refresh(reg, [run])
            last["done"] = bool(run.attempts) and is_final(run.attempts[-1].state)
        except Exception:  # noqa: BLE001 - not in the registry, or sacct down: trust attempts.jsonl
            from hpctrain.collect.summary import from_folder

            atts = from_folder(inp.folder).attempts
            last["done"] = bool(atts) and is_final(str(atts[-1].get("state")))
        return bool(last["done"])

    return finished


# -- summary ----------------------------------------------------------------------------------------
@click.command(short_help="What happened to runs: states, failures, speed, cost.")
@click.argument("runs", nargs=-1)
@click.option("--all", "all_runs", is_flag=True, help="Every run in the registry (default: the 20 newest).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema: hpctrain/collect/summary_schema.json).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
              help="Draw loss and tokens/s over steps, attempt starts marked (needs hpctrain[plot]).")
def summary(runs: tuple[str, ...], all_runs: bool, as_json: bool, plot: str | None) -> None:
    """One record per run (one row per attempt): job id, state, failure class and where it came
    from, nodes, times, GPU-hours, steps, loss, tokens/s, TFLOPS/MFU and steps lost since the last
    checkpoint. Also writes RUN_DIR/summary.json. RUN may be a run id, a prefix or a run folder."""
    from hpctrain.api.runs import summaries
    from hpctrain.collect import summary as co
    from hpctrain.errors import HpcUsageError

    if runs and all_runs:
        raise HpcUsageError("RUN and --all together: give run ids, or --all for every run, not both")
    found = summaries(list(runs), all_runs)
    records, errors, warnings = found.records, found.errors, found.warnings
    if as_json:
        doc = {"schema_version": co.SCHEMA_VERSION, "generated": time.time(), "runs": records,
               "errors": errors, "warnings": warnings}
        # Indented for people reading a few runs; compact past 100 (json's fast C encoder ignores indent).
        click.echo(json.dumps(doc, indent=2 if len(records) <= 100 else None, sort_keys=True))
    else:
        _print_table(records, warnings)
    if plot:
        _plot(records, Path(plot))
    for e in errors:
        click.echo(f"error: {e}", err=True)
    if errors:
        sys.exit(1 if records else 2)


def _plot(records: list[dict[str, Any]], out: Path) -> None:
    from hpctrain.collect.plot import PlotUnavailable, plot_runs

    try:
        n = plot_runs(records, out)
    except PlotUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"plot: {out} ({n} points)", err=True)


def _fmt(v: Any, spec: str = "", none: str = "-") -> str:
    if v is None:
        return none
    return format(v, spec) if spec else str(v)


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _when(t: float | None) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


# The table's columns, most important first: a narrow terminal loses columns from the end of this list
# (each line of the table stays one line). Hours are GPU-hours for GPU runs, CPU-hours for CPU runs.
_COLUMNS = ["RUN", "A", "STATE", "FAILURE", "STEP", "LOSS", "LOST", "ELAPSED", "HOURS", "TOK/S", "TRAINED/S", "JOB",
            "TFLOPS", "MFU%", "NODES", "START"]
_RIGHT = {"STEP", "LOSS", "LOST", "TOK/S", "TRAINED/S", "TFLOPS", "MFU%", "HOURS", "NODES"}
_GPU_ONLY = ("TFLOPS", "MFU%")  # a CPU run has no peak to compare with: not shown when no run in view has GPUs
_BORDER = 3  # rich's default box: one space each side of a cell and one rule between cells


def _row(run: dict[str, Any], a: dict[str, Any]) -> dict[str, str]:
    hours = a["gpu_hours"] if run["gpus_per_node"] > 0 else a["cpu_hours"]
    return {"RUN": run["run_id"], "A": str(a["attempt"]), "JOB": a.get("step_id") or a["job_id"], "STATE": a["state"],
            "FAILURE": a["failure_class"] or "-", "NODES": str(a["nodes"]), "START": _when(a["start"]),
            "ELAPSED": _dur(a["elapsed_s"]), "HOURS": f"{hours:.3f}", "STEP": _fmt(a["last_step"]),
            "LOSS": _fmt(a["last_loss"], ".4f"), "TOK/S": _fmt(a["tokens_per_s"], ".0f"),
            "TRAINED/S": _fmt(a.get("trained_tokens_per_s"), ".0f"),  # tokens the loss covers (SFT: responses)
            "TFLOPS": _fmt(a["tflops"], ".2f"), "MFU%": _fmt(None if a["mfu"] is None else 100 * a["mfu"], ".1f"),
            "LOST": _fmt(a["lost_steps"])}


def _total_row(run: dict[str, Any]) -> dict[str, str]:
    t = run["totals"]
    hours = t["gpu_hours"] if run["gpus_per_node"] > 0 else t["cpu_hours"]
    return {"RUN": run["run_id"], "A": "all", "STATE": run["state"], "FAILURE": run["failure_class"] or "-",
            "ELAPSED": _dur(t["elapsed_s"]), "HOURS": f"{hours:.3f}", "STEP": _fmt(t["last_step"]),
            "LOSS": _fmt(t["last_loss"], ".4f"), "LOST": _fmt(t["lost_steps"])}


def _hours_header(records: list[dict[str, Any]]) -> str:
    gpu = {r["gpus_per_node"] > 0 for r in records}
    return "GPU-H" if gpu == {True} else "CPU-H" if gpu == {False} else "GPU-H*"


def fit_columns(rows: list[dict[str, str]], width: int | None, gpu: bool, border: int = _BORDER) -> list[str]:
    """The columns shown: every one that has a value in some row (TFLOPS/MFU only with a GPU run in view),
    then, when `width` is given, the most important ones that fit it (at least RUN, A, STATE, FAILURE)."""
    cols = [c for c in _COLUMNS if gpu or c not in _GPU_ONLY]
    widths = {c: max([len(c)] + [len(r.get(c, "")) for r in rows]) for c in cols}
    if width is None:
        return cols
    shown: list[str] = []
    used = 1
    for c in cols:
        if used + widths[c] + border > width and len(shown) >= 4:
            continue  # a later, narrower column may still fit
        shown.append(c)
        used += widths[c] + border
    return shown


def _terminal_width() -> int | None:
    """The terminal's width ($COLUMNS first); None when printing to a pipe or a file: every column."""
    import os
    import shutil

    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return shutil.get_terminal_size((100, 24)).columns
    return None


def _print_table(records: list[dict[str, Any]], warnings: list[str]) -> None:
    """A rich table fitted to the terminal (plain columns past 200 rows: rich's layout cost grows with the rows)."""
    rows: list[dict[str, str]] = []
    for run in records:
        rows.extend(_row(run, a) for a in run["attempts"])
        if len(run["attempts"]) != 1:
            rows.append(_total_row(run))
    width = _terminal_width()
    cols = fit_columns(rows, width, gpu=any(r["gpus_per_node"] > 0 for r in records))
    hidden = [c for c in _COLUMNS if c not in cols and (c not in _GPU_ONLY or any(r["gpus_per_node"] > 0
                                                                                  for r in records))]
    names = {"HOURS": _hours_header(records)}
    header = [names.get(c, c) for c in cols]
    body = [[r.get(c, "") for c in cols] for r in rows]
    if not records:
        click.echo("no runs to summarise")
    elif len(rows) > 200:
        widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
        click.echo("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                             for r in [header, *body]))
    else:
        from rich.console import Console
        from rich.table import Table

        caption = "GPU-H*: GPU-hours; CPU-hours for CPU runs" if names["HOURS"] == "GPU-H*" else None
        table = Table(title="hpctrain summary", caption=caption)
        for col, name in zip(cols, header, strict=True):
            table.add_column(name, overflow="fold", justify="right" if col in _RIGHT else "left")
        for r in body:
            table.add_row(*r)
        Console(width=width or 1000).print(table)
    if records and hidden:
        _note(f"(not shown at this width: {', '.join(names.get(c, c) for c in hidden)}; "
              "`hpctrain summary --json` has every field)")
    for run in records:
        _print_eval(run)
        _print_data(run)
        _print_health(run)
        _print_failures(run)
        _print_placement(run)
        _print_stragglers(run)
    for w in dict.fromkeys(warnings + [w for run in records for w in run["warnings"]]):
        click.echo(f"warning: {w}", err=True)


def _note(text: str) -> None:
    """A line under the summary table, fitted to the terminal's width like the table (rich folds the table;
    these lines wrap, their continuations indented); whole when printing to a pipe or a file."""
    width = _terminal_width()
    if width is None or len(text) <= width:
        click.echo(text)
        return
    import textwrap

    indent = " " * min(len(text) - len(text.lstrip()) + 4, width // 2)
    click.echo("\n".join(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False)))


def _print_health(run: dict[str, Any]) -> None:
    """Each health check under the table: nodes that failed it, why, and the spare that took each one's place."""
    for a in run["attempts"]:
        h = a.get("health")
        if not h:
            continue
        head = f"{run['run_id']} a{a['attempt']} health check (step {h['step_id']}, {len(h['hosts'])} node(s)"
        head += f", {h['elapsed_s']:.0f} s)" if h.get("elapsed_s") is not None else ")"
        if not h["failed"]:
            _note(f"{head}: every node passed")
        for host, why in sorted(h["failed"].items()):
            swap = f"; replaced by {h['replaced'][host]}" if host in h["replaced"] else ""
            _note(f"{head}: {host} failed: {why}{swap}")
        for note in h["notes"]:
            _note(f"{head}: note: {note}")


def _print_placement(run: dict[str, Any]) -> None:
    """Under the table: the node a spare replaced at each in-job restart, the idle spares' share of the cost, and
    why the latest attempt waits (issue 29: not only in the JSON)."""
    for a in run["attempts"]:
        for old, new in (a.get("replaced") or {}).items():
            _note(f"{run['run_id']} a{a['attempt']} (step {a.get('step_id') or a['job_id']}): {old} replaced by the "
                  f"spare {new}")
    spare = sum(a.get("spare_hours") or 0.0 for a in run["attempts"])
    if spare > 0:
        unit = "GPU-hours" if run["gpus_per_node"] > 0 else "CPU-hours"
        total = run["totals"]["gpu_hours" if run["gpus_per_node"] > 0 else "cpu_hours"]
        _note(f"{run['run_id']} cost: {total:.3f} {unit}, of which {spare:.3f} on idle spare nodes")
    if run.get("waiting_because"):
        _note(f"{run['run_id']} waiting: {run['waiting_because']}")


def _print_stragglers(run: dict[str, Any]) -> None:
    from hpctrain.collect.stragglers import describe

    line = describe(run.get("stragglers"))
    if line:
        _note(f"{run['run_id']}: {line}")


def _job_words(a: dict[str, Any]) -> str:
    """ "job 123", or for one srun step of a job with in-job restarts "step 123.0 -> 123.1, node2 -> node4"."""
    r = a.get("in_job_restart")
    if not r:
        return f"job {a['job_id']}"
    swaps = ", ".join(f"{old} -> {new}" for old, new in (r.get("replaced") or {}).items())
    how = f", {swaps}" if swaps else ", in place"
    return f"step {a.get('step_id') or a['job_id']} -> {r.get('next_step_id')}{how}"


def _print_eval(run: dict[str, Any]) -> None:
    """The validation loss under the table ([train] eval_every): the last one and the best one."""
    e = run["totals"].get("eval")
    if e:
        _note(f"{run['run_id']} eval: loss {_fmt(e['last_loss'], '.4f')} ppl {_fmt(e['last_ppl'], '.2f')} at "
              f"step {e['last_step']}; best {_fmt(e['best_loss'], '.4f')} ppl {_fmt(e['best_ppl'], '.2f')} at "
              f"step {e['best_step']}")


def _print_data(run: dict[str, Any]) -> None:
    """The SFT records under the table: how many were read and trained on, the bad ones by reason."""
    d = run.get("data")
    if not d:
        return
    bad = d.get("bad") or {}
    why = ", ".join(f"{k} {v:,}" for k, v in bad.items())
    _note(f"{run['run_id']} data ({d.get('format')}): {d.get('records') or 0:,} records, {d.get('kept') or 0:,} "
          f"trained on ({d.get('truncated') or 0:,} truncated), {sum(bad.values()):,} bad"
          + (f": {why}" if why else ""))
    for reason, where in (d.get("first") or {}).items():
        _note(f"  first {reason}: {where}")


def _print_failures(run: dict[str, Any]) -> None:
    """The evidence under the table: which rank on which host, what it said, and where to look."""
    for a in run["attempts"]:
        f = a.get("failure")
        if not f:
            continue
        where = " ".join(x for x in (f"rank {f['rank']}" if f["rank"] is not None else "",
                                     f"on {f['host']}" if f["host"] else "") if x)
        _note(f"{run['run_id']} a{a['attempt']} ({_job_words(a)}): {f['failure_class']}"
              f"{' ' + where if where else ''}: {f['message']}")
        for ln in f["last_lines"][-4:] if f["failure_class"] == FailureClass.PYTHON_EXCEPTION else []:
            _note(f"    {ln}")
        if f["source"]:
            _note(f"    log: {Path(run['folder']) / f['source']}")
