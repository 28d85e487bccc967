"""`hpctrain summary --plot FILE.png`: loss (and eval loss) and throughput over steps, attempt boundaries marked.

matplotlib is optional (the `plot` extra) and imported only here, inside `plot_runs`.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hpctrain.collect import metrics as cm
from hpctrain.runs.folder import RunFolder


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def series(run: dict[str, Any]) -> list[tuple[int, list[dict[str, Any]]]]:
    """(attempt, metrics records) for each attempt of a summary record, read from its folder."""
    folder = Path(run["folder"])
    records, _ = cm.read_metrics(RunFolder(folder).metrics_jsonl)
    atts = run.get("attempts", [])
    per = cm.split_by_attempt(records, [a.get("start") for a in atts]) if atts else [records]
    keys = [a["attempt"] for a in atts] or [0]
    return list(zip(keys, per, strict=True))


def boundaries(run: dict[str, Any]) -> list[tuple[float, str]]:
    """(x, label) of every attempt boundary of a summary record: where each attempt after the first took
    over, at the checkpoint it resumed from (its first step - 1), with how it ended before and what it lost."""
    out: list[tuple[float, str]] = []
    rows = run.get("attempts", [])
    for prev, row in itertools.pairwise(rows):
        first = row.get("first_step")
        if first is None:
            continue
        why = prev.get("failure_class") or str(prev.get("state", "")).lower()
        lost = prev.get("lost_steps")
        redo = f", {lost} step{'s' if lost != 1 else ''} redone" if lost else ""
        resumed = f"resumed at step {first - 1}" if first > 1 else "restarted from step 0"
        out.append((first - 0.5, f"a{row['attempt']}: {resumed} after {why}{redo}"))
    return out


def plot_runs(runs: list[dict[str, Any]], out: Path) -> int:
    """Draw every run into one PNG (two panels: loss, tokens/s). Returns the number of points drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a login node
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'hpctrain[plot]'") from exc
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5))
    drawn = 0
    for run in runs:
        for k, recs in series(run):
            pts = [(r["step"], r.get("loss"), r.get("tokens_per_s")) for r in recs]
            if not pts:
                continue
            label = f"{run['run_id']} a{k}" if len(runs) > 1 else f"attempt {k}"
            line = ax_loss.plot([p[0] for p in pts if p[1] is not None],
                                [p[1] for p in pts if p[1] is not None], label=label)[0]
            ax_tps.plot([p[0] for p in pts if p[2] is not None], [p[2] for p in pts if p[2] is not None],
                        color=line.get_color())
            evals = [(r["step"], r["eval_loss"]) for r in recs if r.get("eval_loss") is not None]
            if evals:  # the validation loss ([train] eval_every), as markers in the training loss's colour
                ax_loss.plot([e[0] for e in evals], [e[1] for e in evals], marker="o", linestyle=":",
                             color=line.get_color(), label=f"{label} eval")
            drawn += len(pts)
        for x, text in boundaries(run):  # where each later attempt took over (a resume starts mid-way)
            for ax in (ax_loss, ax_tps):
                ax.axvline(x, color="grey", linestyle="--", linewidth=0.9, alpha=0.8)
            ax_loss.annotate(text, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                             textcoords="offset points", rotation=90, va="top", fontsize="x-small", color="grey")
    ax_loss.set_ylabel("loss")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step (dashed: an attempt boundary, at the checkpoint the next attempt resumed from)")
    from matplotlib.ticker import MaxNLocator

    ax_tps.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn:
        ax_loss.legend(fontsize="small")
    else:
        ax_loss.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax_loss.transAxes)
    ax_loss.set_title(", ".join(r["run_id"] for r in runs)[:120])
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100, metadata={"Software": f"matplotlib {matplotlib.__version__}"})
    plt.close(fig)
    return drawn
