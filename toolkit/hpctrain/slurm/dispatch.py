"""Dispatch: hand run folders to SLURM (through submitit) or to submitit's local executor.

This is the only module that imports submitit, and only inside functions, so `import hpctrain.cli.main`
stays light. What gets submitted to SLURM is *our* rendered script (`render.render_sbatch`); submitit
keeps doing what it is good at: the pickled call (`NodeJob(run_dir, mode)`), result files and
requeue bookkeeping, under `<run>/submitit/` with its `%j` file names.

A sweep (several run folders with one allocation shape) is ONE `sbatch --array`: submitit's
per-submit throttle (200 ms) and one sbatch per run would make a 100-run sweep take 20 s+.
Each array task finds its own run folder through `<runs_dir>/.sweeps/<id>/<index>` -> run folder
links, so submitit's `%a` path expansion puts each task's files in its own run folder.

A SLURM submission is a transaction (hpctrain.slurm.transaction): its intent is recorded in the run folder and
the registry before sbatch runs, and settled with the job id after, so no signal, timeout or crash between
the two loses a queued job. Secrets never reach a file: they travel in the environment (sbatch's default
--export=ALL; the local executor inherits it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click

from hpctrain.errors import HpcUsageError
from hpctrain.runs import folder as runs_mod
from hpctrain.slurm import localctl
from hpctrain.slurm.transaction import Interrupted, Transaction, point_summary
from hpctrain.slurm.uncertain import JobMayExist, drop_pickles
from hpctrain.spec.rules import mem_bytes, secret_names
from hpctrain.states import JobState

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.plan.model import Plan
    from hpctrain.spec.model import Spec

SWEEPS_DIR = ".sweeps"


@dataclass(frozen=True)
class Submitted:
    """One run as submitted: `job_id` is "123", or "123_4" for task 4 of an array."""

    run_id: str
    run_dir: Path
    job_id: str
    executor: Literal["slurm", "local"]
    array_index: int | None = None


def resolve_executor(name: str) -> Literal["slurm", "local"]:
    """`auto` = slurm when `sbatch` is on PATH, else the local executor."""
    if name == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    if name not in ("slurm", "local"):
        raise HpcUsageError(f"launch.executor = {name!r}: unknown executor. Fix: use slurm, local or auto")
    return name  # type: ignore[return-value]


def submit(run_dirs: Sequence[Path], spec: Spec, plan: Plan, executor: str = "auto",
           mode: str = "train", dependency: str = "", script: str | None = None,
           on_settled: Settled | None = None) -> list[Submitted]:
    """Submit one job (one run folder) or one job array (a sweep); record each run + attempt 0.
    `dependency`: sbatch's --dependency for this submission (`submit --after`; hpctrain.slurm.after).
    `script`: the batch script as rendered once (hpctrain.slurm.submission), else rendered here.
    `on_settled(subs)`: runs once the jobs are recorded, before a signal held meanwhile takes effect.

    Raises HpcUsageError when the cluster refuses the job (nothing recorded; the caller removes
    the run folders), SlurmUnavailable when slurmctld does not answer, SubmitUncertain when sbatch may
    have queued it (the run is kept, recorded as SUBMIT_UNKNOWN).
    """
    if not run_dirs:
        raise ValueError("submit() needs at least one run folder")
    if mode not in ("train", "preflight"):
        raise HpcUsageError(f"mode = {mode!r}: unknown mode. Fix: use train or preflight")
    which = resolve_executor(executor)
    dirs = [Path(d).absolute() for d in run_dirs]
    from hpctrain.runs.registry import Registry

    Registry().check()  # fail before sbatch, not after: never a queued job nobody recorded
    if which == "local":
        if dependency:
            raise HpcUsageError(f"--after = {dependency!r}: the local executor runs the job now and cannot wait "
                                "for another. Fix: use --executor slurm, or submit without --after")
        # A local job starts at once, so there is no intent to record first; the signals are held all the same
        # from its start until it is recorded (never a running job whose folder an interrupt removed).
        with Transaction(dirs, staging=_staging(dirs), name=spec.name, summary={}, mode=mode) as held:
            subs = _submit_local(dirs, spec, plan, mode)
            _record(subs, spec, plan, mode)
            held.settled = subs
            if on_settled is not None:
                on_settled(subs)
        return subs
    text, rendered_here = _checked_script(dirs, spec, plan, dependency, script)
    tx = Transaction(dirs, staging=_staging(dirs), name=spec.name, summary=spec_summary(spec, plan, mode), mode=mode)
    return _transact(tx, lambda: _submit_slurm(dirs, spec, mode, text, rendered_here, tx), on_settled)


Settled = Callable[[list[Submitted]], object]


def _transact(tx: Transaction, sbatch: Callable[[], list[Submitted]], on_settled: Settled | None) -> list[Submitted]:
    """intent -> sbatch -> settle, signals held throughout (hpctrain.slurm.transaction)."""
    from hpctrain import slurmcommands as _slurm

    with tx:
        tx.begin()
        tx.pause("intent")
        if tx.interrupted:
            tx.withdraw("a signal arrived before sbatch ran", remove=True)
            raise Interrupted()
        try:
            subs = sbatch()
        except _slurm.SubmitUnknown as exc:
            raise tx.unknown(exc) from exc
        except BaseException as exc:
            # Interrupted: the held signal may end the process as it leaves, before the caller could clean up.
            tx.withdraw(str(exc) or type(exc).__name__, remove=tx.interrupted)
            raise
        tx.pause("sbatch")
        tx.settle(subs)  # never raises for the registry; a run folder that cannot be written keeps the intent
        tx.pause("settled")
        if on_settled is not None:
            on_settled(subs)
    return subs


def _staging(dirs: list[Path]) -> Path:
    """Where the pickles wait for their job id: the run's submitit folder, or a sweep's links folder."""
    return runs_mod.RunFolder(dirs[0]).submitit_dir if len(dirs) == 1 else sweep_links_dir(dirs)


def submit_attempt(run_dir: Path, spec: Spec, plan: Plan, attempt: int, mode: str = "train",
                   record: dict[str, Any] | None = None, script: str | None = None,
                   on_settled: Settled | None = None) -> Submitted:
    """A new attempt of an existing run (`hpctrain resubmit`, the supervisor): same run folder, a new
    job on the executor the run was first submitted to (a local run stays local), recorded as attempt
    `attempt` in attempts.jsonl (with `record`'s extra keys) and in the registry. A run this registry
    does not know (another state dir) is still submitted and recorded in its folder. On SLURM it is a
    transaction like `submit` (its tag names the attempt: hpctrain.slurm.uncertain.submission_tag)."""
    from hpctrain.runs.registry import Attempt, Registry

    d = Path(run_dir).absolute()
    folder = runs_mod.RunFolder(d)
    first = folder.read_attempts()[:1]
    executor = str(first[0].get("executor", "slurm")) if first else resolve_executor(spec.launch.executor)
    if executor != "local":
        text, rendered_here = _checked_script([d], spec, plan, "", script)
        tx = Transaction([d], staging=_staging([d]), name=spec.name, summary=spec_summary(spec, plan, mode),
                         mode=mode, attempt=attempt, record=record)
        return _transact(tx, lambda: _submit_slurm([d], spec, mode, text, rendered_here, tx), on_settled)[0]
    with Transaction([d], staging=_staging([d]), name=spec.name, summary={}, mode=mode) as held:  # signals
        sub = _submit_local([d], spec, plan, mode)[0]
        now = time.time()
        runs_mod.append_attempt(folder.attempts_jsonl,
                                {**(record or {}), "attempt": attempt, "job_id": sub.job_id,
                                 "state": JobState.PENDING, "submitted": now, "executor": executor, "mode": mode})
        with contextlib.suppress(Exception):  # the job IS running; attempts.jsonl holds the record
            Registry().add_attempt(Attempt(run_id=d.name, attempt=attempt, job_id=sub.job_id,
                                           state=JobState.PENDING, submitted=now))
        held.settled = [sub]
        if on_settled is not None:
            on_settled([sub])
    return sub


# -- recording ----------------------------------------------------------------------------------


def spec_summary(spec: Spec, plan: Plan, mode: str) -> dict[str, Any]:
    """What `list`/`status` show about a run: shape and knobs, never env values."""
    res, par = spec.resources, spec.parallel
    secret = set(secret_names(spec))
    return {
        "name": spec.name, "mode": mode, "site": spec.site,
        "nodes": plan.nodes, "ranks_per_node": plan.ranks_per_node, "world_size": plan.world_size,
        "gpus_per_node": res.gpus_per_node, "partition": res.partition, "time": res.time,
        "zero": getattr(plan, "zero_stage", par.zero), "offload": par.offload, "pp": par.pp, "tp": par.tp,
        "model": spec.model.path or spec.model.config, "data": spec.data.source,
        "steps": spec.train.steps, "lr": spec.train.lr, "launcher": spec.launch.launcher,
        "micro_batch": getattr(plan, "micro_batch", None), "global_batch": getattr(plan, "global_batch", None),
        # Names only: values of [env] are in sbatch.sh already; secret names are not even listed.
        "env_keys": sorted(k for k in spec.env if k not in secret),
    }


def _record(subs: list[Submitted], spec: Spec, plan: Plan, mode: str) -> None:
    """A local run, once its controller has started (a SLURM run is recorded by its Transaction)."""
    from hpctrain.runs.registry import Attempt, Registry

    reg, now = Registry(), time.time()
    summary = spec_summary(spec, plan, mode)
    items = []
    for i, s in enumerate(subs):
        point = point_summary(s.run_dir, summary) if i else summary
        rec = {"attempt": 0, "job_id": s.job_id, "state": JobState.PENDING, "submitted": now,
               "executor": s.executor, "mode": mode}
        runs_mod.append_attempt(runs_mod.RunFolder(s.run_dir).attempts_jsonl, rec)
        items.append(({"run_id": s.run_id, "name": spec.name, "folder": str(s.run_dir), "executor": s.executor,
                       "created": now, "spec": {**point, "array_index": s.array_index}},
                      Attempt(run_id=s.run_id, attempt=0, job_id=s.job_id, state=JobState.PENDING, submitted=now)))
    try:
        reg.add_submitted_many(items)  # one transaction for a whole sweep
    except Exception as exc:
        # The job IS running: say so with its id instead of pretending nothing happened.
        ids = sorted({s.job_id for s in subs})
        raise JobMayExist(f"local job {', '.join(ids)} (process id) was started but could not be recorded in the "
                          f"registry ({exc}); its run folder records it: `hpctrain registry rebuild` adds it to the "
                          f"registry, or stop it with `kill {' '.join(ids)}`") from exc


# -- SLURM ----------------------------------------------------------------------------------------
def time_minutes(text: str) -> int:
    """SLURM --time ("MM", "MM:SS", "HH:MM:SS", "D-HH[:MM[:SS]]") -> whole minutes (>= 1)."""
    from hpctrain.spec.rules import time_limit_s

    return max(1, (time_limit_s(text) + 59) // 60)


def _checked_script(dirs: list[Path], spec: Spec, plan: Plan, dependency: str,
                    script: str | None) -> tuple[str, bool]:
    """Everything that can refuse a SLURM submission before it begins (srun on PATH, the partition's size, no
    secret in the script, `sbatch --test-only` for the escape hatches): (the script, whether it was rendered
    here because the caller gave none). Outside the transaction: a signal meanwhile acts as usual."""
    from hpctrain import slurmcommands as _slurm

    if not shutil.which("srun"):  # submitit's SlurmExecutor refuses to start without it (a bare RuntimeError)
        raise _slurm.SlurmUnavailable(
            "`srun` is not on PATH although `sbatch` is: SLURM's client tools are incomplete here. Fix: submit "
            "from a login node with SLURM's client tools installed, or use --executor local")
    _check_fits(spec, plan)
    if script is None:
        script = _render_script(spec, plan, dirs, _submitit_folder(dirs), dependency)
        rendered_here = True
    else:
        _check_no_secrets(script, spec)
        rendered_here = False
    _test_hatches(script, spec, dependency)
    return script, rendered_here


def _submitit_folder(dirs: list[Path]) -> Path:
    """submitit's folder for the job: the run's, or for a sweep the links' `%a` (each task its own run folder)."""
    if len(dirs) == 1:
        return runs_mod.RunFolder(dirs[0]).submitit_dir
    return runs_mod.RunFolder(sweep_links_dir(dirs) / "%a").submitit_dir


def _submit_slurm(dirs: list[Path], spec: Spec, mode: str, script: str, rendered_here: bool,
                  tx: Transaction) -> list[Submitted]:
    from hpctrain import slurmcommands as _slurm

    links = _make_sweep_links(dirs) if len(dirs) > 1 else None
    try:
        job_ids = _submit_pickled(dirs, spec, mode, _submitit_folder(dirs), script, rendered_here, tx)
    except _slurm.SbatchRejected as exc:
        if links is not None:
            shutil.rmtree(links, ignore_errors=True)
        raise _explain_rejection(exc, spec) from None
    except _slurm.SubmitUnknown:
        raise  # the job may run: it resolves its files through the sweep links, so they stay
    except BaseException:
        if links is not None:
            shutil.rmtree(links, ignore_errors=True)
        raise
    return [Submitted(run_id=d.name, run_dir=d, job_id=j, executor="slurm",
                      array_index=None if len(dirs) == 1 else i)
            for i, (d, j) in enumerate(zip(dirs, job_ids, strict=True))]


def sweep_links_dir(dirs: Sequence[Path]) -> Path:
    """`<runs_dir>/.sweeps/<first run id>`: its `<i>` links to run folder i, so that the array's `%a` in
    `--output` and in submitit's folder sends task i's files into its own point's folder."""
    return Path(dirs[0]).parent / SWEEPS_DIR / Path(dirs[0]).name


def _make_sweep_links(dirs: list[Path]) -> Path:
    """`<runs_dir>/.sweeps/<first run id>/<i>` -> run folder i (what `%a` resolves through)."""
    base = sweep_links_dir(dirs)
    base.mkdir(parents=True, mode=0o700, exist_ok=True)
    for i, d in enumerate(dirs):
        os.symlink(d, base / str(i), target_is_directory=True)
    return base


def _check_fits(spec: Spec, plan: Plan) -> None:
    """Refuse shapes the partition can never run. sbatch *accepts* a job asking for more nodes
    than the partition has (it then pends forever, reason PartitionConfig), so ask sinfo first."""
    from hpctrain import slurmcommands as _slurm

    try:
        # One try: if slurmctld is down, sbatch would fail the same way, so say so now (~9 s)
        # instead of retrying sinfo and then sbatch.
        info = _slurm.partition_info(spec.resources.partition, tries=1)
    except _slurm.SlurmCommandError:
        return  # an odd sinfo is not the user's fault: let sbatch decide
    if info is None:
        return  # unknown partition: sbatch rejects it and _explain_rejection lists the real ones
    r = spec.resources
    where = f"partition {info.name}"
    if plan.nodes > info.nodes:
        raise HpcUsageError(f"resources.nodes = {plan.nodes}: {where} has {info.nodes} node(s), so the job "
                            f"could never start. Fix: pass --nodes {info.nodes} or fewer, or a larger --partition")
    spares = getattr(plan, "spare_nodes", 0)
    if plan.nodes + spares > info.nodes:
        raise HpcUsageError(f"resources.spare_nodes = {spares}: {plan.nodes} training node(s) + "
                            f"{spares} spare(s) > the {info.nodes} node(s) of {where}, so the job could "
                            f"never start. Fix: pass --spare-nodes {info.nodes - plan.nodes} or fewer")
    cpus = plan.ranks_per_node * r.cpus_per_task
    if info.cpus and cpus > info.cpus:
        raise HpcUsageError(
            f"resources.cpus_per_task = {r.cpus_per_task}: {plan.ranks_per_node} rank(s) per node x "
            f"{r.cpus_per_task} CPU(s) = {cpus} CPUs per node, but nodes of {where} have {info.cpus}. "
            f"Fix: lower --cpus-per-task or the ranks per node, or use a larger --partition")
    size = mem_bytes(r.mem)  # the spec's one reading of --mem
    mem = size // 2**20 if size is not None else None
    if mem is not None and info.mem_mb and mem > info.mem_mb:
        raise HpcUsageError(f"resources.mem = {r.mem!r}: nodes of {where} have {info.mem_mb} MB. "
                            f"Fix: pass --mem {info.mem_mb}M or less")


def _explain_rejection(exc: Any, spec: Spec) -> HpcUsageError:
    """Name the field, its value and a fix; list the real partitions when that is what's wrong."""
    field = exc.field
    value: Any = spec.resources
    _, _, key = field.partition(".")
    if key:
        value = getattr(spec.resources, key, "")
    fix = f"change {field} (pass the matching --{key.replace('_', '-')} flag or edit the run file)" if key \
        else "lower the resources request (nodes, cpus, mem, gpus) to what the partition offers"
    if not key:  # a generic refusal: show what was asked for
        r = spec.resources
        value = (f"nodes={r.nodes} tasks_per_node={r.tasks_per_node} cpus_per_task={r.cpus_per_task} "
                 f"mem={r.mem or '-'} gpus_per_node={r.gpus_per_node}")
    if field == "resources.partition":
        with contextlib.suppress(Exception):  # the partition list is a hint; a failure here must not hide the rejection
            from hpctrain import slurmcommands as _slurm

            fix = f"use one of the partitions `sinfo` lists: {', '.join(_slurm.partitions())} (--partition)"
    shown = f"{value!r}" if key else f"({value})"
    return HpcUsageError(f"{field} = {shown}: sbatch rejected the job: {exc.reason}. Fix: {fix}")


def _check_no_secrets(text: str, spec: Spec) -> None:
    """The script submitted goes through the same check as the files of a dry run (spec.rules)."""
    from hpctrain.spec.rules import check_rendered

    check_rendered({runs_mod.SBATCH_SH: text}, spec)


# What submitit gives a SLURM job here is its pickled call and the runner of that call on every task
# (`python -u -m submitit.core._submit FOLDER`, which loads FOLDER/%j_submitted.pkl, handles the pre-timeout
# signal and requeue, and writes the result pickle). The batch script is hpctrain's own, and a sweep is one
# array of it; submitit's SlurmExecutor writes its own script, and its array path builds a plain
# SlurmExecutor, so hpctrain does not subclass it. It uses the public pieces instead: the call is a
# `submitit.helpers.DelayedSubmission`, `submitit.SlurmJob(folder, job_id).paths` names the files submitit
# reads and writes, and sbatch runs through slurmcommands.py.
MAX_TIMEOUT_REQUEUES = 3  # requeues submitit grants a checkpointable call after a time-out (SlurmExecutor's default)


def _submit_pickled(dirs: list[Path], spec: Spec, mode: str, folder: Path, script: str, rendered_here: bool,
                    tx: Transaction) -> list[str]:
    """Pickle NodeJob(dir, mode) for every run folder, submit ONE script (an array when there are several),
    then move each pickle to the name its task loads. Returns the job ids ("123", or "123_0", "123_1", ...).

    `folder` is submitit's folder for the job (`%a` in it is the array index); the pickles wait under the names
    `tx.pickles` (in a folder without `%`, recorded in the intent) until the job id is known. A task that
    starts before its pickle is moved waits for it (submitit's runner polls for 60 s). `script`: checked
    (_checked_script); written to sbatch.sh here when `rendered_here` (else the caller wrote it).
    """
    import submitit
    from submitit.helpers import DelayedSubmission

    from hpctrain.node.launch.entry import NodeJob

    pickles: list[Path] = []
    try:
        for d, pickle_path in zip(dirs, tx.pickles, strict=True):
            call = DelayedSubmission(NodeJob(str(d), mode))
            call.set_timeout(time_minutes(spec.resources.time), MAX_TIMEOUT_REQUEUES)
            pickle_path.parent.mkdir(parents=True, exist_ok=True)
            pickles.append(pickle_path)
            call.dump(pickle_path)
        if tx.interrupted:  # held since the intent: nothing is queued yet, so the submission is withdrawn
            raise Interrupted()
        job_id = _sbatch(tx.pickles[0].parent, script, tx)
    except BaseException as exc:
        drop_pickles(pickles, exc)
        raise
    ids = [job_id] if len(dirs) == 1 else [f"{job_id}_{i}" for i in range(len(dirs))]
    try:
        for jid, pickle_path in zip(ids, pickles, strict=True):
            paths = submitit.SlurmJob(folder=folder, job_id=jid).paths
            paths.folder.mkdir(parents=True, exist_ok=True)
            pickle_path.rename(paths.submitted_pickle)
            # submitit's own copy of the script (%j_submission.sh, or %A_submission.sh for an array) per run.
            if not paths.submission_file.exists():
                runs_mod.write_private(paths.submission_file, script)
        if rendered_here:
            for d in dirs:
                runs_mod.write_private(runs_mod.RunFolder(d).sbatch_sh, script)
    except OSError as exc:  # the job IS queued: it is recorded all the same (the caller settles it), never lost
        click.echo(f"warning: job {job_id} is queued, but its files could not all be put in place ({exc}); "
                   "it may fail to start: see `hpctrain status` and its log", err=True)
    return ids


def _test_hatches(script: str, spec: Spec, dependency: str) -> None:
    """`sbatch --test-only` when the script holds what only sbatch can judge ([slurm] extra, mail, --after)."""
    from hpctrain.slurm import sbatch_check

    if sbatch_check.needed(spec.slurm.extra, spec.slurm.mail_type, dependency):
        sbatch_check.test_script(script, spec.slurm.extra, dependency)


def _render_script(spec: Spec, plan: Plan, dirs: list[Path], folder: Path, dependency: str = "") -> str:
    """hpctrain's batch script, every task running submitit's runner on `folder`; refused if it holds a secret."""
    from hpctrain.render import sbatch as render

    command = render.submitit_command(shlex.quote(sys.executable), str(folder))
    if len(dirs) > 1:  # a sweep: task i runs in dirs[i]; submitit's files go through the %a links
        text = render.render_sbatch(spec, plan, dirs[0], command, array=f"0-{len(dirs) - 1}", run_dirs=dirs,
                                    submitit_folder=folder, dependency=dependency)
    else:
        text = render.render_sbatch(spec, plan, dirs[0], command, submitit_folder=folder, dependency=dependency)
    _check_no_secrets(text, spec)
    return str(text)


def _sbatch(staging: Path, script: str, tx: Transaction) -> str:
    """Submit `script` through the one SLURM wrapper (the transaction's tag -> --comment); returns the job id sbatch
    printed. A signal held meanwhile stops the wait (sbatch finishes on its own: the tag finds its job)."""
    from hpctrain import slurmcommands as _slurm

    path = staging / f".submission_file_{uuid.uuid4().hex}.sh"
    runs_mod.write_private(path, script)
    try:
        out = _slurm.sbatch(str(path), comment=tx.tag, abandon=lambda: tx.interrupted)
    except _slurm.SubmitUnknown:
        raise  # an sbatch left to finish may still read the script: it stays (private, in the staging folder)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    path.unlink(missing_ok=True)
    return _slurm.job_id_from_sbatch(out)


# -- local ----------------------------------------------------------------------------------------
def _submit_local(dirs: list[Path], spec: Spec, plan: Plan, mode: str) -> list[Submitted]:
    if plan.nodes != 1:
        raise HpcUsageError(
            f"resources.nodes = {plan.nodes}: the local executor runs on this machine only. "
            "Fix: use --nodes 1, or --executor slurm on a cluster")
    # Both need the in-job driver of a SLURM job (hpctrain.fault.injob): the local executor has neither.
    if spec.resources.spare_nodes:
        raise HpcUsageError(f"resources.spare_nodes = {spec.resources.spare_nodes}: the local executor runs on this "
                            "machine only and has no spare node to hand over. Fix: drop --spare-nodes, or use "
                            "--executor slurm on a cluster")
    if spec.fault.health_check:
        raise HpcUsageError("fault.health_check = true: the local executor runs no health step (a SLURM job's "
                            "in-job driver does). Fix: pass --no-health-check, or use --executor slurm")
    from hpctrain.node.launch.entry import NodeJob

    subs = []
    for d in dirs:
        # submitit's executor under hpctrain's controller, which records how the tasks ended (their exit code).
        ex = localctl.make_executor(runs_mod.RunFolder(d).submitit_dir)
        ex.update_parameters(tasks_per_node=plan.ranks_per_node, nodes=1,
                             timeout_min=time_minutes(spec.resources.time),
                             gpus_per_node=spec.resources.gpus_per_node,
                             signal_delay_s=spec.resources.signal_seconds)
        with _stdio_to(runs_mod.RunFolder(d).submitit_dir / "controller.log"):
            job = ex.submit(NodeJob(str(d), mode))
        subs.append(Submitted(run_id=d.name, run_dir=d, job_id=str(job.job_id), executor="local"))
    return subs


@contextmanager
def _stdio_to(path: Path) -> Iterator[None]:
    """Point fds 1/2 at `path` while submitit starts its local controller.

    The controller inherits our stdout/stderr; left alone, `hpctrain submit --executor local | jq`
    (or any caller reading our output through a pipe) would block until the training ends.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def local_state(run_dir: Path, job_id: str) -> tuple[str, str | None]:
    """State of a local-executor job: RUNNING while its controller lives, then COMPLETED/FAILED from the exit
    code its controller recorded and submitit's result pickles (cached there by submitit, so this is cheap)."""
    submitit_dir = runs_mod.RunFolder(run_dir).submitit_dir
    pid = int(job_id) if job_id.isdigit() else -1
    if pid > 0 and _alive(pid) and _is_local_controller(pid, run_dir):
        return JobState.RUNNING, None
    # A task that failed after another wrote its success pickle (or died hard, writing none) leaves pickles that
    # all say success: its exit code says otherwise, as sacct's would for a SLURM job.
    code = localctl.read_exit_code(submitit_dir, job_id)
    if code is not None and code != "0:0":
        return JobState.FAILED, f"exit {code}"
    results = sorted(submitit_dir.glob(f"{job_id}_*_result.pkl"))
    if not results:
        return JobState.FAILED, "no result file (killed?)"
    import pickle

    for path in results:
        try:
            with path.open("rb") as fh:
                status, _ = pickle.load(fh)
        except Exception:  # noqa: BLE001 - any unreadable pickle means the task did not finish cleanly
            return JobState.FAILED, f"unreadable {path.name}"
        if status != "success":
            return JobState.FAILED, f"see {path.name}"
    return JobState.COMPLETED, None


def _is_local_controller(pid: int, run_dir: Path) -> bool:
    """The PID is the local controller for this run (`python -m hpctrain.slurm.localctl RUN/submitit`),
    not an unrelated process that reused the number after the controller ended: `cancel` signals it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    # hpctrain's controller (hpctrain.slurm.localctl), or submitit's own for a run submitted before it existed.
    ours = any(m in argv for m in (localctl.MODULE, "submitit.local._local"))
    return ours and any(Path(run_dir).name in arg for arg in argv)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            # Field 3 is the state; a zombie (Z) has exited but not been reaped yet.
            return re.sub(r"^.*\) ", "", fh.read()).split(" ", 1)[0] not in ("Z", "X")
    except OSError:
        return False


def to_jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: to_jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj
