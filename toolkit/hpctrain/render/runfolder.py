"""A complete run folder from (spec, plan): the one writer `hpctrain submit` and the node tests use.

What it writes needs no job id: spec.toml, plan.json, ds_config.json and, when given, sbatch.sh. The
hostfile is written on the allocation; logs, metrics, events and checkpoints by the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.render import deepspeed
from hpctrain.runs import folder as runs
from hpctrain.spec.model import Spec, to_toml
from hpctrain.spec.rules import check_rendered

if TYPE_CHECKING:
    from hpctrain.plan.model import Plan


def run_files(spec: Spec, plan: Plan, script: str | None = None) -> dict[str, str]:
    """The files a run folder starts with, by name, checked before anything is written.

    `check_rendered` is the one check of a dry run and a submit: no secret's value in any file, no CR
    or other control character in the batch script.
    """
    files = {runs.SPEC_TOML: to_toml(spec), runs.PLAN_JSON: plan.to_json(),
             runs.DS_CONFIG_JSON: deepspeed.to_json(deepspeed.build_ds_config(spec, plan))}
    if script is not None:
        files[runs.SBATCH_SH] = script
    check_rendered(files, spec)
    return files


def write_run_folder(dest: Path, spec: Spec, plan: Plan, script: str | None = None, *,
                     create: bool = False) -> Path:
    """Write the run folder `dest` and return its path.

    create=True (submit): `dest` must not exist; it is created whole or not at all, under a fresh id
    suffix if another process took `dest.name` (use the returned path). create=False (a dry run's --out,
    the tests, a resubmission): the files are written into `dest`, keeping what the ranks wrote there.
    """
    files = run_files(spec, plan, script)
    if create:
        return runs.create_run_folder_atomically(dest.parent, dest.name, files)
    return runs.write_run_files(dest, files)
