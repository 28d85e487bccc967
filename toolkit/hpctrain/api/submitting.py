"""`hpctrain.submit(...) -> Run`: what `hpctrain submit` does, from Python, through the same Submission.

The request becomes a Submission (hpctrain.slurm.submission: prepare -> render once -> dispatch -> record) exactly
as the CLI's flags do; the supervisor job that retries failed attempts is armed inside the submission's
transaction, as the CLI arms it. A dry run writes (into `out`) or only checks the files the CLI's
`--dry-run [--out]` would: the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.api.request import RunSource, request
from hpctrain.api.runs import Run

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.spec.model import Spec


def submit(source: RunSource | Spec = None, /, *, dry_run: bool = False, out: str | os.PathLike[str] | None = None,
           preflight: bool = False, **overrides: Any) -> Run:
    """Validate, plan, render and submit one run: `hpctrain submit SOURCE --flags`, returning its Run handle.

    `source` is a run file's path, a mapping shaped like one, a Spec, or None. Keywords are the flags' names
    (`nodes=2`, `gpus_per_node=0`, `zero=3`, `executor="slurm"`, `model="llama-tiny"`, `container="apptainer:x.sif"`,
    `sbatch_args=["--exclusive"]`, `set={"train.lr": 1e-4}`); a dotted name is a spec key. An unknown keyword or a
    bad value is refused (HpcUsageError, a click.UsageError) with the message the flag gets.

    `dry_run=True` submits nothing: the files are checked, and written into `out` when given (the returned Run's
    folder); the batch script is `Run.sbatch`. `preflight=True` runs only the rendezvous + all-reduce check."""
    from hpctrain.errors import bad_value
    from hpctrain.fault.supervisor import arm_submitted
    from hpctrain.plan.planner import fine_tuning_lines
    from hpctrain.slurm.submission import Submission

    if out is not None and not dry_run:
        raise bad_value("out", os.fspath(out), "only a dry run writes into a chosen folder",
                        "pass dry_run=True, or set HPCTRAIN_RUNS_DIR to choose where run folders are created")
    folder = Path(out) if out is not None else None
    runfile, keys, site = request(source, overrides, where="hpctrain.submit")
    sub = Submission.prepare(runfile, keys, site=site, mode="preflight" if preflight else "train", out=folder)
    # What `hpctrain submit` prints on stderr before the rest: each fine-tuning default with its reason, and the
    # fine-tuning warnings (a pretrained model fed byte ids, ...).
    told = fine_tuning_lines(sub.spec, sub.plan)
    if dry_run:
        done = sub.dry_run(folder)
        return Run.rendered(done.run_dirs[0], done.script, notes=[*told, *sub.notes])
    spec, mode = sub.spec, sub.mode
    # Armed inside the submission's transaction, as the CLI does: an interrupt after sbatch keeps the retries.
    subs = sub.submit(on_settled=lambda subs: arm_submitted(subs, spec, mode))
    run = Run(subs[0].run_id)
    run.notes = [*told, *sub.notes]
    return run
