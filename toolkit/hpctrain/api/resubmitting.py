"""`Run.resubmit()` and `hpctrain resubmit RUN`: attempt K+1 of a run, by hand, through the same Submission.

The checks, the exclusions and the submission are hpctrain.fault.resubmit.resubmit_by_hand's (refused while an
attempt may still run, after the supervisor already resubmitted the same job, after a run that completed its
training); this module gives its answer a type.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Resubmitted:
    """The new attempt: its number and job, the hosts it excludes, the supervisor job armed for it (None: no
    retries, or a local run), the checkpoint step it resumes from (None: the start), and notes for the user."""

    run_id: str
    run_dir: Path
    attempt: int
    job_id: str
    excluded: list[str]
    supervisor: str | None
    resume_step: int | None
    notes: list[str] = field(default_factory=list)
    answer: dict[str, Any] = field(default_factory=dict, repr=False)  # resubmit_by_hand's answer, whole

    def to_dict(self) -> dict[str, Any]:
        """What `hpctrain resubmit --json` prints."""
        return dict(self.answer)


def resubmit(ref: str | os.PathLike[str], *, exclude_failed_nodes: bool = False, exclude: Sequence[str] = (),
             max_retries: int | None = None, time_limit: str | None = None, nodes: int | None = None,
             tasks_per_node: int | None = None) -> Resubmitted:
    """Submit a new attempt of the run `ref` names: same spec and run folder, a new SLURM job recorded as the next
    attempt. `exclude` adds hosts to the run's exclusions; `exclude_failed_nodes` adds the hosts the last
    failure implicates (capped so the job still fits); `max_retries` and `time_limit` replace the run's;
    `nodes` / `tasks_per_node` resume it at another world size (through a universal checkpoint)."""
    from hpctrain.fault.resubmit import resubmit_by_hand

    out = resubmit_by_hand(os.fspath(ref), exclude_failed_nodes=exclude_failed_nodes, exclude=exclude,
                           max_retries=max_retries, time_limit=time_limit, nodes=nodes,
                           tasks_per_node=tasks_per_node)
    return Resubmitted(run_id=str(out["run_id"]), run_dir=Path(str(out.get("run_dir") or "")),
                       attempt=int(out["attempt"]), job_id=str(out["job_id"]), excluded=list(out["excluded"]),
                       supervisor=out["supervisor"], resume_step=out["resume_step"], notes=list(out["notes"]),
                       answer=out)
