"""One submission: prepare -> render once -> dispatch -> record (the object every submitter calls).

`hpctrain submit` (a run or a sweep), `hpctrain resubmit`, the supervisor's retries and the Python API
(`hpctrain.submit`) all go through `Submission`; none of them renders, creates run folders or records on its own.

    sub = Submission.prepare(runfile, flags, site=None, sweep=(), mode="train", dependency="", check=True,
                             out=None, secrets_seen=None)
    sub.points, sub.spec, sub.plan, sub.notes    the resolved request(s), and lines for the user (stderr)
    sub.script(run_dirs) -> str                  pure: the batch script for these run folders
    sub.dry_run(out=None) -> DryRun              the files checked (written into `out` when given), nothing submitted
    sub.submit(on_settled=None) -> list[Submitted]
        run folders created whole -> code snapshot and repro bundle -> the script rendered ONCE and written as
        sbatch.sh -> dispatch as a transaction (hpctrain.slurm.transaction: intent recorded, sbatch, settled);
        `on_settled(subs)` runs inside it, before a held signal takes effect (the CLI arms the supervisor there)

    sub = Submission.resubmission(run_dir, exclude=None, time_limit=None, retries=None)
    sub.submit_attempt(record=None, on_settled=None) -> Submitted
        attempt K+1 of an existing run folder: the same request with exclude/time/retries changed, planned
        again with the fine-tuning defaults plan.json recorded, rendered once, dispatched the same way.

`flags` are dotted spec keys (`{"train.lr": 1e-4}`, what the CLI's flags become: hpctrain.cli.main.flags_from_options);
`sweep` items are `KEY=V1,V2` (hpctrain.spec.model.parse_sweep); `dependency` is sbatch's --dependency value
(hpctrain.slurm.after). Refusals are HpcUsageError (click.UsageError) naming field, value and fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.runs import folder as runs
from hpctrain.slurm import dispatch
from hpctrain.slurm.dispatch import Submitted
from hpctrain.slurm.uncertain import JobMayExist

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.plan.model import Plan
    from hpctrain.spec.model import Spec

MODES = ("train", "preflight")
Point = tuple["Spec", "Plan"]


@dataclass(frozen=True)
class DryRun:
    """What a dry run rendered: the run folders it names (written when `out` was given) and the batch script."""

    run_dirs: list[Path]
    script: str
    points: list[Point]


@dataclass
class Submission:
    """One request, resolved and planned (one point, or every point of a sweep), ready to render and dispatch.

        Submission.prepare(runfile, flags=None, *, site=None, sweep=(), mode="train", dependency="", check=True,
                           out=None, secrets_seen=None) -> Submission
        Submission.resubmission(run_dir, *, exclude=None, time_limit=None, retries=None) -> Submission
        .spec, .plan, .points, .notes, .mode, .dependency (settable before submit), .run_dir, .attempt
        .script(run_dirs) -> str
        .dry_run(out=None) -> DryRun(run_dirs, script, points)
        .submit(on_settled=None) -> list[Submitted]
        .submit_attempt(record=None, on_settled=None) -> Submitted

    `points` holds (Spec, Plan) per run folder, `notes` the lines the caller shows the user (stderr)."""

    points: list[Point]
    mode: str = "train"
    dependency: str = ""
    notes: list[str] = field(default_factory=list)
    run_dir: Path | None = None  # a resubmission's run folder
    attempt: int = 0  # a resubmission's attempt number

    @property
    def spec(self) -> Spec:
        return self.points[0][0]

    @property
    def plan(self) -> Plan:
        return self.points[0][1]

    # -- prepare ------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, runfile: str | Path | None, flags: Mapping[str, Any] | None = None, *, site: str | None = None,
                sweep: Sequence[str] = (), mode: str = "train", dependency: str = "", check: bool = True,
                out: str | Path | None = None, secrets_seen: set[str] | None = None) -> Submission:
        """Resolve RUNFILE + flags (+ each sweep point) into specs and plans. `check=False` (`hpctrain plan`):
        data and tokenizer paths are not checked (they may live only on the cluster). `secrets_seen` gets the
        secret variable names of each request as soon as it is resolved (the CLI redacts their values)."""
        from hpctrain.errors import HpcUsageError
        from hpctrain.spec.model import parse_sweep

        if mode not in MODES:
            raise HpcUsageError(f"mode = {mode!r}: unknown mode. Fix: use {' or '.join(MODES)}")
        if check:
            check_run_parent(out)
        grid = parse_sweep(list(sweep)) if sweep else [{}]
        sub = cls(points=[], mode=mode, dependency=dependency)
        for point in grid:
            sub.points.append(sub._resolve(runfile, {**(flags or {}), **point}, site, check, secrets_seen))
        _check_sweep_binds(sub.points)
        return sub

    def _resolve(self, runfile: str | Path | None, flags: dict[str, Any], site: str | None, check: bool,
                 secrets_seen: set[str] | None) -> Point:
        from hpctrain.plan.planner import make_plan
        from hpctrain.spec.model import resolve_with_defaults
        from hpctrain.spec.rules import secret_names

        spec, applied = resolve_with_defaults(str(runfile) if runfile is not None else None, flags, site, check=check)
        if secrets_seen is not None:
            secrets_seen.update(secret_names(spec))
        plan = make_plan(spec, applied)
        return (self._data_source(spec, plan) if check else spec), plan

    def _data_source(self, spec: Spec, plan: Plan) -> Spec:
        """A prepared folder's vocabulary against the model's; raw text prepared in the data cache -> that folder;
        raw text on several nodes refused with the `data prepare` command (hpctrain.data.source)."""
        from hpctrain.data.format import is_prepared
        from hpctrain.data.source import submit_source

        d = spec.data
        source, note = submit_source(d.source, d.tokenizer, d.text_field, int(plan.model.get("vocab") or 0),
                                     plan.nodes, data=d, finetune=bool(spec.model.path))
        if note and note not in self.notes:
            self.notes.append(note)
        # A prepared folder is read as one whatever raw format the run file named for its inputs ("jsonl"):
        # the folder's manifest.json is not a document.
        fmt = "prepared" if source != "synthetic" and d.format not in ("prepared", "synthetic") \
            and is_prepared(source) else d.format
        if source == d.source and fmt == d.format:
            return spec
        return dataclasses.replace(spec, data=dataclasses.replace(d, source=source, format=fmt))

    @classmethod
    def resubmission(cls, run_dir: str | Path, *, exclude: Sequence[str] | None = None,
                     time_limit: str | None = None, retries: int | None = None, nodes: int | None = None,
                     tasks_per_node: int | None = None) -> Submission:
        """Attempt K+1 of the run in `run_dir`: its spec.toml with exclude/time/retries as given (spares cut to
        what the partition still has), planned again with the fine-tuning defaults its plan.json recorded.
        `nodes` / `tasks_per_node`: another world size; the ranks resume through a universal checkpoint."""
        from hpctrain.plan.planner import make_plan
        from hpctrain.spec.model import read_resolved

        d = Path(run_dir).absolute()
        spec = read_resolved(d)
        res = spec.resources
        if nodes is not None or tasks_per_node is not None:
            from hpctrain.spec.model import from_toml_text, to_toml

            res = dataclasses.replace(res, nodes=res.nodes if nodes is None else nodes,
                                      tasks_per_node=res.tasks_per_node if tasks_per_node is None else tasks_per_node)
            # through spec.toml's text: the spec's own rules judge the new size, as at submit
            spec = from_toml_text(to_toml(dataclasses.replace(spec, resources=res)))
            res = spec.resources
        excl = tuple(exclude) if exclude is not None else res.exclude
        spec = dataclasses.replace(
            spec, resources=dataclasses.replace(res, exclude=excl, time=time_limit or res.time,
                                                spare_nodes=_spares_that_fit(spec, excl)),
            launch=dataclasses.replace(spec.launch, retries=spec.launch.retries if retries is None else retries))
        plan = make_plan(spec, _recorded_defaults(d))
        return cls(points=[(spec, plan)], run_dir=d, attempt=next_attempt_number(d, _registry_attempts(d.name)))

    # -- render -------------------------------------------------------------------------------
    def script(self, run_dirs: Sequence[Path]) -> str:
        """The batch script as submitted: one job, or one array over run_dirs whose task i writes its logs and
        submitit's files into run_dirs[i] (through the sweep's `%a` links, as hpctrain.slurm.dispatch submits it)."""
        from hpctrain.render.sbatch import render_sbatch, submitit_command

        spec, plan = self.points[0]
        dirs = [Path(d) for d in run_dirs]
        if len(dirs) == 1:
            folder = runs.RunFolder(dirs[0]).submitit_dir
            command = submitit_command(shlex.quote(sys.executable), str(folder))
            return render_sbatch(spec, plan, dirs[0], command, submitit_folder=folder, mode=self.mode,
                                 dependency=self.dependency)
        folder = runs.RunFolder(dispatch.sweep_links_dir(dirs) / "%a").submitit_dir
        command = submitit_command(shlex.quote(sys.executable), str(folder))
        return render_sbatch(spec, plan, dirs[0], command, array=f"0-{len(dirs) - 1}", run_dirs=dirs, mode=self.mode,
                             submitit_folder=folder, dependency=self.dependency)

    def dry_run(self, out: str | Path | None = None) -> DryRun:
        """Render and check everything a submit would, submit nothing. With `out`: each run's files into OUT (one
        run) or OUT/point-<i> (a sweep), each point's sbatch.sh the script that runs that point alone."""
        from hpctrain.render.runfolder import run_files

        if out is not None:
            dirs = self._write_dry_run(Path(out))
        else:
            dirs = [(runs.runs_dir_default() / runs.new_run_id(s.name)).absolute() for s, _ in self.points]
        script = self.script(dirs)
        for s, p in self.points:
            run_files(s, p, script)  # the same check as a submit, though nothing is written
        return DryRun(run_dirs=dirs, script=script, points=list(self.points))

    def _write_dry_run(self, out: Path) -> list[Path]:
        from hpctrain.render.runfolder import run_files

        n = len(self.points)
        dirs = [out.absolute()] if n == 1 else [(out / f"point-{i}").absolute() for i in range(n)]
        single = [dataclasses.replace(self, points=[pt]) for pt in self.points]
        files = [run_files(s, p, one.script([d]))  # checked first
                 for d, one, (s, p) in zip(dirs, single, self.points, strict=True)]
        try:
            out.mkdir(parents=True, exist_ok=True, mode=0o700)
            for d, texts in zip(dirs, files, strict=True):
                runs.write_run_files(d, texts)
        except OSError as exc:
            raise _writing("--out", out, "pass --out with a new or writable folder", exc) from None
        return dirs

    # -- dispatch and record ------------------------------------------------------------------
    def submit(self, on_settled: Callable[[list[Submitted]], object] | None = None) -> list[Submitted]:
        """Create the run folder(s), render the script once, dispatch (a transaction: hpctrain.slurm.transaction).
        A refusal or failure before sbatch may have queued a job leaves no folder and no record."""
        from hpctrain.render.containers import check_submit
        from hpctrain.render.sbatch import template_dirs
        from hpctrain.spec.rules import check_rendered

        spec = self.spec
        check_submit(spec, executor=dispatch.resolve_executor(spec.launch.executor))
        template_dirs(spec)  # a template_dir that is no folder: refused before any run folder exists
        run_dirs = self._create_runs()
        recorded: list[Submitted] = []

        def settled(subs: list[Submitted]) -> None:
            recorded.extend(subs)
            if on_settled is not None:
                on_settled(subs)

        try:
            self.points = self._prepare_code(run_dirs)  # --snapshot, the repro bundle
            script = self.script(run_dirs)  # the one rendering: what sbatch gets is what sbatch.sh holds
            check_rendered({runs.SBATCH_SH: script}, self.spec)
            for d in run_dirs:
                runs.write_private(runs.RunFolder(d).sbatch_sh, script)
            spec, plan = self.points[0]
            return dispatch.submit(run_dirs, spec, plan, spec.launch.executor, mode=self.mode,
                                   dependency=self.dependency, script=script, on_settled=settled)
        except JobMayExist:  # a job may run in these folders: keep them (the error says what to do)
            raise
        except BaseException:  # refused, SLURM unreachable, interrupted before sbatch: nothing queued
            if recorded:  # a signal held until the job was recorded (KeyboardInterrupt): the job runs there
                raise
            self._remove(run_dirs)
            raise

    def submit_attempt(self, record: Mapping[str, Any] | None = None,
                       on_settled: Callable[[list[Submitted]], object] | None = None) -> Submitted:
        """A resubmission's new attempt (`Submission.resubmission`): the run folder's spec.toml, plan.json,
        ds_config.json and sbatch.sh become this attempt's ("exactly as dispatched"), then the transaction."""
        from hpctrain.render.runfolder import write_run_folder

        if self.run_dir is None:
            raise ValueError("submit_attempt() needs a Submission.resubmission(...)")
        spec, plan = self.points[0]
        script = self.script([self.run_dir])
        write_run_folder(self.run_dir, spec, plan, script)
        rec = {"excluded": list(spec.resources.exclude), "time": spec.resources.time, **(record or {})}
        old = os.environ.get("HPCTRAIN_ATTEMPT")
        os.environ["HPCTRAIN_ATTEMPT"] = str(self.attempt)  # sbatch --export=ALL: the ranks log as attempt-K
        try:
            return dispatch.submit_attempt(self.run_dir, spec, plan, self.attempt, mode=self.mode, record=rec,
                                           script=script, on_settled=on_settled)
        finally:
            if old is None:
                os.environ.pop("HPCTRAIN_ATTEMPT", None)
            else:
                os.environ["HPCTRAIN_ATTEMPT"] = old

    def _create_runs(self) -> list[Path]:
        """One private run folder per point (spec.toml, plan.json, ds_config.json), each created whole (temp dir +
        rename) or not at all. sbatch.sh follows once the folder's final name (and any snapshot) is known."""
        from hpctrain.render.runfolder import run_files

        base = runs.runs_dir_default()
        files = [run_files(s, p) for s, p in self.points]
        made: list[Path] = []
        try:
            for (s, _), texts in zip(self.points, files, strict=True):
                made.append(runs.create_run_folder_atomically(base, runs.new_run_id(s.name), texts).absolute())
        except OSError as exc:
            self._remove(made)
            raise _writing("HPCTRAIN_RUNS_DIR", base, "set HPCTRAIN_RUNS_DIR to a writable folder (default ./runs)",
                           exc) from None
        except BaseException:
            self._remove(made)
            raise
        return made

    @staticmethod
    def _remove(run_dirs: list[Path]) -> None:
        for d in run_dirs:
            runs.remove_run_folder(d)

    def _prepare_code(self, run_dirs: list[Path]) -> list[Point]:
        """Before dispatch: the snapshot (when asked; one for a sweep, which has one launch line) and every run's
        repro bundle. Returns the points with `code.dir` set when a snapshot was made (spec.toml rewritten)."""
        from hpctrain.render.containers import image_identity
        from hpctrain.runs import repro, snapshot
        from hpctrain.spec.model import to_toml

        points, spec = self.points, self.spec
        # The code is the user's script's (submit --script), else the submit directory's.
        script = Path(spec.launch.script) if spec.launch.script else None
        src = script.parent if script is not None else Path.cwd()
        snap_info = None
        if spec.code.snapshot:
            workdir = snapshot.snapshot_code(src, run_dirs[0], spec.secret_env)
            snap_info = snapshot.describe(src, run_dirs[0], workdir)

            def moved(s: Spec) -> Spec:
                launch = s.launch
                if script is not None:  # the job runs the copy of the script: edits after submit do not reach it
                    launch = dataclasses.replace(launch, script=str(workdir / script.name))
                return dataclasses.replace(s, code=dataclasses.replace(s.code, dir=str(workdir)), launch=launch)

            points = [(moved(s), p) for s, p in points]
            for d, (s, _) in zip(run_dirs, points, strict=True):
                runs.write_private(runs.RunFolder(d).spec_toml, to_toml(s))
        doc, diff = repro.manifest(src, image_identity(spec), snap_info, spec.secret_env)  # git once, also a sweep
        for d in run_dirs:
            try:
                repro.write_manifest(d, doc, diff)
            except OSError as exc:  # the bundle informs; it never stops a submission
                self.notes.append(f"warning: {d}: could not write the repro bundle: {exc}")
        return points


# -- checks ---------------------------------------------------------------------------------------
def check_run_parent(out: str | Path | None) -> None:
    """The folder that run folders go into reaches #SBATCH --output and submitit's folder: refuse what SLURM or
    submitit would read as something else (the same check at submit and --dry-run)."""
    from hpctrain.errors import check_path
    from hpctrain.render.sbatch import check_job_path

    # Room for what goes below it: a run id, a sweep's point-<i>, submitit's and the ranks' file names.
    field_name, parent = ("--out", Path(out)) if out else ("HPCTRAIN_RUNS_DIR", runs.runs_dir_default())
    check_path(field_name, str(parent.absolute()), "choose a folder with a shorter path", room=512)
    check_job_path(field_name, parent.absolute())


def _check_sweep_binds(points: list[Point]) -> None:
    """A sweep shares one batch script, so in a container every point must need the same binds."""
    from hpctrain.errors import bad_value
    from hpctrain.render.sbatch import container_binds

    spec = points[0][0]
    if spec.container.runtime == "none" or len(points) < 2:
        return
    first = container_binds(spec, [Path("/run")])
    for s, _ in points[1:]:
        if container_binds(s, [Path("/run")]) != first:
            raise bad_value("--sweep", "model/data paths", "sweep points need different container mounts, "
                            "but one job array has one launch line",
                            "sweep non-path keys only, or submit each path separately")


def _writing(field_name: str, where: Path, fix: str, exc: OSError) -> Exception:
    """An OSError while creating run files -> a refusal naming the folder (never a traceback)."""
    from hpctrain.errors import bad_value

    return bad_value(field_name, str(where), f"cannot write there ({exc.strerror or exc})", fix)


# -- resubmission's facts -------------------------------------------------------------------------
def _recorded_defaults(run_dir: Path) -> list[Any]:
    """The fine-tuning defaults the run's plan.json recorded (`defaults`): a resubmission keeps them, and their
    reasons, instead of planning as if the user had set those values."""
    from hpctrain.spec.finetune import Default

    try:
        doc = json.loads(runs.RunFolder(run_dir).plan_json.read_text(encoding="utf-8"))
        return [Default(key=str(d["key"]), value=d["value"], reason=str(d["reason"])) for d in doc.get("defaults", [])]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []  # an unreadable plan.json: the plan is still made, without the defaults' reasons


# Attempt numbers read from a run folder are bounded (a hand-edited attempts.jsonl or a log named
# attempt-99999999999999999999 must not become the next attempt's number, which sqlite could not store).
MAX_ATTEMPT = 1_000_000


def next_attempt_number(run_dir: Path, registry_attempts: Sequence[int] | None = None) -> int:
    """One past every attempt number seen: registry, attempts.jsonl, and logs/attempt-K.* (SLURM's own
    requeues number their logs by restart count, so those numbers are taken too). Numbers beyond MAX_ATTEMPT
    are damage, not attempts: ignored."""
    seen = [int(n) for n in registry_attempts or () if 0 <= n <= MAX_ATTEMPT]
    seen += [r["attempt"] for r in runs.RunFolder(run_dir).read_attempts()
             if isinstance(r.get("attempt"), int) and not isinstance(r["attempt"], bool)
             and 0 <= r["attempt"] <= MAX_ATTEMPT]
    for p in runs.RunFolder(run_dir).logs_dir.glob("attempt-*.rank-*.log"):
        m = re.match(r"attempt-(\d{1,7})\.", p.name)
        if m and int(m.group(1)) <= MAX_ATTEMPT:
            seen.append(int(m.group(1)))
    return max(seen, default=-1) + 1


def _registry_attempts(run_id: str) -> list[int]:
    try:
        from hpctrain.runs.registry import Registry

        return [a.attempt for a in Registry().get_run(run_id).attempts]
    except Exception:  # noqa: BLE001 - a run this registry never saw: the folder is the record
        return []


def _spares_that_fit(spec: Spec, exclude: tuple[str, ...]) -> int:
    """The spare nodes a resubmission still asks for: as many as the partition has beside the training nodes and
    the excluded hosts (spares are a luxury; a job asking for more nodes than can ever be free would pend)."""
    res = spec.resources
    if not res.spare_nodes:
        return 0
    from hpctrain import slurmcommands as _slurm

    try:
        info = _slurm.partition_info(res.partition, tries=2)
    except Exception:  # noqa: BLE001 - unknown size: keep the request as it was
        return res.spare_nodes
    if info is None:
        return res.spare_nodes
    return max(0, min(res.spare_nodes, info.nodes - len(set(exclude)) - res.nodes))
