"""Fault tolerance, the mechanism: supervisor job, resubmission, hang watchdog.

How a run recovers (no daemon on the login node):

* ``hpctrain submit`` (retries > 0, SLURM) also submits a 1-CPU *supervisor job*,
  ``sbatch --dependency=afterany:<JOB> --kill-on-invalid-dep=yes``, which runs ``hpctrain supervise RUN --job
  JOB`` on a compute node once the training job has ended for good. It collects (hpctrain.collect.summary),
  decides (hpctrain.fault.policy, pure), and either stops with the reason or submits attempt K+1 of the same
  run folder (new job id, recorded in the registry and attempts.jsonl, ``--exclude`` grown by the
  implicated hosts) plus a new supervisor for it. The ranks resume from the latest complete checkpoint
  by themselves.
* Time limit / preemption: SLURM's early USR2 makes every rank checkpoint and rank 0 requeue the job
  (``scontrol update Requeue=1`` then submitit's ``scontrol requeue``; the rerun turns requeue off again):
  same job id, the supervisor's ``afterany`` stays pending meanwhile (a requeue does not satisfy it).
* Node failure: training jobs are ``--no-requeue``, so a job that lost a node ends and the supervisor
  retries it as a new job with the dead host in ``--exclude``. The watchdog ends it within seconds when the
  surviving ranks' collectives failed on the dead peer's closed connections (a ``peer_lost`` verdict);
  a node that vanished without closing them (power, network) ends it through SLURM's NODE_FAIL
  (SlurmdTimeout) or the hang watchdog. Likewise hangs, crashes, NCCL/gloo errors, time limits after
  submitit's requeue budget: the supervisor excludes the implicated host.
* Hang watchdog: ``python -m hpctrain.fault.supervisor watch`` runs in the background of the batch script
  (outside the ranks, so a hung Python cannot stop it). Every rank runs a thread (hpctrain.node.monitor.heartbeat)
  writing ``metrics/ranks/rank-R.json`` (step reached, phase, time). When no rank's step advances for
  ``launch.hang_timeout_s``, the watchdog appends the silent ranks (behind the others, or not beating)
  to ``metrics/watchdog.jsonl`` and cancels the job; the supervisor reads that as a hang.

Stdlib only at module level (the CLI imports it); SLURM commands go through hpctrain.slurmcommands.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.fault import policy as policy_mod

# The batch script runs the watchdog as `python -m hpctrain.fault.supervisor watch` (one module to name).
from hpctrain.fault.watchdog import (
    Watchdog,
    log_attempt,
    silent_ranks,
    watchdog_records,
)
from hpctrain.fault.watchdog import main as watchdog_main
from hpctrain.runs import folder as runs_mod
from hpctrain.runs import journal
from hpctrain.runs.journal import SupervisorDecision, WatchdogVerdict
from hpctrain.states import IMPLICATES_HOST, JobState, class_of_state, is_final

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.spec.model import Spec

__all__ = [
    "Watchdog",
    "already_decided",
    "arm",
    "arm_submitted",
    "down_hosts",
    "fit_of",
    "history",
    "latest_checkpoint",
    "log_attempt",
    "next_attempt_number",
    "resubmit_run",
    "silent_ranks",
    "supervise",
    "supervisor_script",
    "take_over",
    "wait_final",
    "watchdog_records",
]

SUPERVISOR_TIME_MIN = 10
_LOCK = ".supervise.lock"


# ============================================================================ resubmission
def next_attempt_number(run_dir: Path, registry_attempts: list[int] | None = None) -> int:
    """The run's next attempt number (hpctrain.slurm.submission.next_attempt_number, loaded on first use: the
    watchdog runs this module on the batch host and needs none of the submission's imports)."""
    from hpctrain.slurm import submission

    return submission.next_attempt_number(run_dir, registry_attempts)


def latest_checkpoint(run_dir: Path) -> int | None:
    """The step the run's next attempt resumes from (the one rule, hpctrain.runs.checkpoints.choose_resume)."""
    from hpctrain.runs.checkpoints import choose_resume

    return choose_resume(runs_mod.RunFolder(run_dir).checkpoints_dir).step


def resubmit_run(run_dir: Path, *, exclude: tuple[str, ...] | None = None, time_limit: str | None = None,
                 retries: int | None = None, record: dict[str, Any] | None = None,
                 arm_supervisor: bool = True, nodes: int | None = None,
                 tasks_per_node: int | None = None) -> dict[str, Any]:
    """Submit attempt K+1 of the run in `run_dir` (same spec and folder; exclude/time/retries as given; the
    fine-tuning defaults plan.json recorded kept) through the one Submission, and, when the run has retries
    left, its supervisor (armed inside the submission's transaction). Returns what was submitted."""
    from hpctrain.slurm.submission import Submission

    run_dir = Path(run_dir).absolute()
    sub = Submission.resubmission(run_dir, exclude=exclude, time_limit=time_limit, retries=retries, nodes=nodes,
                                  tasks_per_node=tasks_per_node)
    spec = sub.spec
    armed: list[str] = []

    def arm_it(subs: list[Any]) -> None:
        if arm_supervisor and spec.launch.retries > 0 and subs[0].executor == "slurm":  # local runs: by hand
            armed.append(arm(run_dir, subs[0].job_id, spec))

    done = sub.submit_attempt(record=record, on_settled=arm_it)
    return {"run_id": run_dir.name, "run_dir": str(run_dir), "attempt": sub.attempt, "job_id": done.job_id,
            "excluded": list(spec.resources.exclude), "time": spec.resources.time,
            "supervisor": armed[0] if armed else None}


def _registry_failure(run_id: str, attempt: int, failure_class: str) -> None:
    """The attempt's failure class into the registry (`hpctrain status` shows it); best effort."""
    try:
        from hpctrain.runs.registry import Registry

        Registry().update_attempt(run_id, attempt, failure_class=failure_class)
    except Exception:  # noqa: BLE001,S110 - the run folder holds the record anyway
        pass


def supervisor_script(run_dir: Path, job_id: str, spec: Spec, python: str | None = None) -> str:
    """The supervisor's batch script: 1 task, 1 CPU, a few minutes, after the training job ends."""
    from hpctrain.render.sbatch import slurm_filename  # SLURM expands '%' in --output: escaped

    r = spec.resources
    log = slurm_filename(runs_mod.RunFolder(run_dir).logs_dir / "supervisor.log")
    flags = [f"--job-name={_name(spec.name)}-supervise", f"--dependency=afterany:{job_id}",
             "--kill-on-invalid-dep=yes", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
             f"--time={SUPERVISOR_TIME_MIN}", f"--output={shlex.quote(log)}",
             "--open-mode=append", "--requeue", "--export=ALL"]
    flags += [f"--{k}={shlex.quote(v)}" for k, v in (("partition", r.partition), ("account", r.account),
                                                     ("qos", r.qos)) if v]
    py = python or shlex.quote(sys.executable)
    lines = ["#!/bin/bash", f"# hpctrain supervisor for run {_name(run_dir.name)}: decides what follows job {job_id}.",
             *[f"#SBATCH {f}" for f in flags], "set -eu",
             f"exec {py} -m hpctrain supervise {shlex.quote(str(run_dir))} --job {shlex.quote(job_id)}", ""]
    return "\n".join(lines)


def arm_submitted(subs: list[Any], spec: Spec, mode: str) -> list[str]:
    """After `hpctrain submit`: one supervisor per single SLURM training run when launch.retries > 0.
    Sweeps (job arrays) and the local executor get none (`hpctrain resubmit` each point by hand).
    Returns the supervisor job ids; a failure to arm is a warning on stderr, never a failed submit
    (the training job is queued already)."""
    if mode != "train" or spec.launch.retries <= 0 or len(subs) != 1 or subs[0].executor != "slurm":
        return []
    try:
        return [arm(Path(subs[0].run_dir), str(subs[0].job_id), spec)]
    except Exception as exc:  # noqa: BLE001 - the job is queued: say so and carry on
        print(f"warning: job {subs[0].job_id} is queued, but its supervisor (automatic retries) could not be "
              f"submitted: {exc}. Resubmit by hand after a failure: hpctrain resubmit {subs[0].run_id}",
              file=sys.stderr)
        return []


def _name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+\-]", "_", text)[:100] or "hpctrain"


def arm(run_dir: Path, job_id: str, spec: Spec) -> str:
    """Submit the supervisor job for `job_id`; returns its job id."""
    from hpctrain import slurmcommands as _slurm

    run_dir = Path(run_dir).absolute()
    path = runs_mod.RunFolder(run_dir).submitit_dir / f"supervise-{job_id}.sh"
    runs_mod.write_private(path, supervisor_script(run_dir, job_id, spec))
    sup = _slurm.job_id_from_sbatch(_slurm.sbatch(str(path)))
    journal.write_armed(run_dir, sup, job_id, time.time())
    return sup


# ============================================================================ the supervisor
def _scrub_slurm_env() -> None:
    """The supervisor runs inside a job: its SLURM_*/SBATCH_* variables would leak into the next sbatch
    (--export=ALL) and shape the new job (cpus, memory, nodes). Keep only SLURM_CONF."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SUBMITIT_")) and k != "SLURM_CONF":
            del os.environ[k]


def wait_final(job_id: str, timeout_s: float = 120.0) -> Any:
    """sacct's record of the job once final (afterany fired, but slurmdbd may lag a moment)."""
    from hpctrain import slurmcommands as _slurm

    deadline = time.monotonic() + timeout_s
    rec = None
    while time.monotonic() < deadline:
        try:
            rec = _slurm.sacct_states([job_id]).get(job_id)
        except Exception:  # noqa: BLE001 - slurmdbd hiccup: try again until the deadline
            rec = None
        if rec is not None and is_final(rec.state):
            return rec
        time.sleep(3)
    return rec


def already_decided(run_dir: Path, job_id: str) -> SupervisorDecision | None:
    """The first decision recorded about job `job_id` (the supervisor's or a person's), or None."""
    found = journal.decisions(run_dir, job_id)
    return found[0] if found else None


def history(run_dir: Path, job_id: str, sacct_rec: Any = None) -> tuple[list[policy_mod.AttemptRecord], dict[str, Any]]:
    """The policy's view of every SLURM job of the run (oldest first) since the last manual
    resubmission, plus the collector's record of the run."""
    from hpctrain.collect import summary as collect

    run_dir = Path(run_dir)
    try:
        summary = collect.build_run(_run_input(run_dir))
    except Exception as err:  # noqa: BLE001 - a broken collector must not stop the recovery
        summary = _plain_summary(run_dir, job_id, sacct_rec, err)
    rows: dict[str, dict[str, Any]] = {}
    for row in summary["attempts"]:
        rows[str(row["job_id"])] = row  # a requeued job: its last run decides
    notes = runs_mod.RunFolder(run_dir).read_attempts()
    by_job: dict[str, dict[str, Any]] = {}
    for n in notes:
        if n.get("job_id") is not None:
            by_job.setdefault(str(n["job_id"]), {}).update(n)
    out: list[policy_mod.AttemptRecord] = []
    for jid, row in rows.items():
        note = by_job.get(jid, {})
        if note.get("manual"):
            out = []  # a person resubmitted: a fresh retry budget from here
        fail = row.get("failure") or {}
        cls, msg, exc = row.get("failure_class"), fail.get("message", ""), fail.get("exception")
        implicated = [fail["host"]] if fail.get("host") and cls in IMPLICATES_HOST else []
        state = row["state"]
        if jid == str(job_id) and sacct_rec is not None:
            state = sacct_rec.state
        hang = watchdog_records(run_dir, jid)
        evidence = _evidence(fail, run_dir)
        if hang:  # the watchdog's verdict: a hang, a peer lost (its node died) -> node_fail, or a straggler
            # A lost peer is a node failure, a persistent straggler a straggler: either host goes into --exclude
            # (hpctrain.states.FailureClass). The verdict is the one cause: the surviving ranks' own errors blame
            # whichever peer they talked to.
            cls = hang[-1].failure_class
            msg, exc = hang[-1].message, None
            implicated = list(hang[-1].silent_hosts)
            evidence = _verdict_evidence(hang[-1], run_dir)
        if jid == str(job_id) and sacct_rec is not None and state == JobState.NODE_FAIL:
            implicated += down_hosts(sacct_rec.nodelist)
        ck = note.get("checkpoint_step", row.get("last_checkpoint_step"))
        if jid == str(job_id):
            ck = latest_checkpoint(run_dir)
        out.append(policy_mod.AttemptRecord(
            attempt=int(row["attempt"]), job_id=jid, state=state, failure_class=cls, exit_code=row.get("exit_code"),
            exception=exc, message=msg or "", evidence=evidence, last_step=row.get("last_step"),
            checkpoint_step=ck, hosts=tuple(row.get("hosts") or ()), implicated=tuple(dict.fromkeys(implicated)),
            excluded=tuple(note.get("excluded") or ())))
    return out, summary


def _plain_summary(run_dir: Path, job_id: str, sacct_rec: Any, exc: BaseException) -> dict[str, Any]:
    """The collector failed: one row per job from attempts.jsonl and sacct's state alone."""
    rows: dict[str, dict[str, Any]] = {}
    for r in runs_mod.RunFolder(run_dir).read_attempts():
        if r.get("job_id") and isinstance(r.get("attempt"), int):  # not a submission's intent (no job id yet)
            rows.setdefault(str(r["job_id"]), {"job_id": str(r["job_id"]), "attempt": r["attempt"]}).update(
                {k: r[k] for k in ("state", "exit_code") if r.get(k)})
    if sacct_rec is not None and str(job_id) in rows:
        rows[str(job_id)].update(state=sacct_rec.state, exit_code=sacct_rec.exit_code)
    for row in rows.values():
        row["failure_class"] = class_of_state(str(row.get("state")))
        row["failure"] = {"message": f"SLURM state {row.get('state')} (collector unavailable: {exc})"}
    return {"attempts": sorted(rows.values(), key=lambda x: int(x["attempt"]))}


def _evidence(fail: dict[str, Any], run_dir: Path) -> str:
    where = []
    if fail.get("rank") is not None:
        where.append(f"rank {fail['rank']}" + (f" on {fail['host']}" if fail.get("host") else ""))
    if fail.get("source"):
        where.append(str(run_dir / fail["source"]))
    return ", ".join(where)


def _verdict_evidence(verdict: WatchdogVerdict, run_dir: Path) -> str:
    """Where the watchdog's verdict points: the silent ranks and their hosts, and its own file."""
    ranks, hosts = verdict.silent_ranks, verdict.silent_hosts
    where = []
    if ranks:
        where.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"
                     + (f" on {', '.join(str(h) for h in hosts)}" if hosts else ""))
    elif hosts:
        where.append(f"host {', '.join(str(h) for h in hosts)}")
    where.append(str(runs_mod.RunFolder(run_dir).watchdog_jsonl))
    return ", ".join(where)


def _run_input(run_dir: Path) -> Any:
    from hpctrain.collect import summary as collect

    try:
        from hpctrain.runs.registry import Registry

        reg = Registry()
        found, _, _ = collect.resolve_refs(reg, [run_dir.name], all_runs=False)
        if found and Path(found[0].folder).resolve() == run_dir.resolve():
            return found[0]
    except Exception:  # noqa: BLE001,S110 - no usable registry here: the folder alone
        pass
    return collect.from_folder(run_dir)


def down_hosts(nodelist: str) -> list[str]:
    """Hosts of `nodelist` that SLURM now reports down, drained or not responding."""
    if not nodelist:
        return []
    from hpctrain import slurmcommands as _slurm

    try:
        states = _slurm.node_states(nodelist)
    except Exception:  # noqa: BLE001 - without sinfo the collector's host is all we have
        return []
    bad = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "*")
    return [h for h, s in states.items() if any(b in s.upper() for b in bad)]


def supervise(run_dir: Path, job_id: str, ending: str | None = None) -> dict[str, Any]:
    """What the supervisor job runs after `job_id` ended: decide, record, maybe resubmit.

    `ending`: the state the job is about to end in, when the watchdog decides before it cancels the job
    (a peer lost: see `take_over`). Then nothing waits for sacct's final record."""
    import fcntl

    from hpctrain import slurmcommands as _slurm
    from hpctrain.spec.model import read_resolved

    run_dir = Path(run_dir).absolute()
    _scrub_slurm_env()
    if not runs_mod.RunFolder(run_dir).spec_toml.is_file():  # the run folder was deleted meanwhile: nothing to resume
        return {"action": "stop", "reason": f"run folder {run_dir} is gone"}
    with open(run_dir / _LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a requeued supervisor must not act twice
        done = already_decided(run_dir, job_id)
        if done:  # decided before (the watchdog's take-over, or an earlier run of this supervisor): say so
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(done.time)) if done.time else "earlier"
            nxt = done.next or {}
            then = f" -> attempt {nxt['attempt']} (job {nxt['job_id']})" if nxt.get("job_id") else ""
            print(f"hpctrain supervise: job {job_id} was already decided at {when}: {done.action}: "
                  f"{done.reason}{then}", flush=True)
            return dict(done.decision)
        rec = _slurm.SacctRecord(str(job_id), ending) if ending else wait_final(job_id)
        spec = read_resolved(run_dir)
        hist, _summary = history(run_dir, job_id, rec)
        if hist:  # the latest job ran with spec.toml's exclude (rewritten at each resubmission)
            ran_with = (*spec.resources.exclude, *hist[-1].excluded)
            hist[-1] = dataclasses.replace(hist[-1], excluded=tuple(dict.fromkeys(ran_with)))
        if not hist or hist[-1].job_id != str(job_id):
            decision = policy_mod.Decision("stop", f"job {job_id} is not the run's latest attempt; nothing to do")
        else:
            decision = policy_mod.decide(hist, policy_mod.Policy(max_retries=spec.launch.retries), fit_of(spec))
        last = hist[-1] if hist else None
        hang = watchdog_records(run_dir, job_id)  # its last verdict goes with the decision (the collector reads it)
        note = SupervisorDecision(attempt=last.attempt if last else None, job_id=str(job_id),
                                  state=last.state if last else None, failure_class=decision.failure_class,
                                  checkpoint_step=latest_checkpoint(run_dir), decision=decision.to_dict(),
                                  time=time.time(), verdict=hang[-1] if hang else None)
        if decision.action == "retry":
            try:
                sub = resubmit_run(run_dir, exclude=decision.exclude,
                                   record={"resubmitted_after": str(job_id), "reason": decision.reason})
                note = dataclasses.replace(note, next={"attempt": sub["attempt"], "job_id": sub["job_id"],
                                                       "supervisor": sub["supervisor"]})
            except Exception as exc:  # noqa: BLE001 - say why in the record, then fail the supervisor job
                note = dataclasses.replace(note, decision={**decision.to_dict(), "action": "stop",
                                                           "reason": f"{decision.reason}; resubmission failed: {exc}"})
        journal.write_decision(run_dir, note)
        if last is not None and decision.failure_class:
            _registry_failure(run_dir.name, last.attempt, decision.failure_class)
    _refresh_summary(run_dir)
    print(f"hpctrain supervise: {note.action}: {note.reason}", flush=True)
    return dict(note.decision)


def take_over(run_dir: Path, job_id: str) -> dict[str, Any] | None:
    """The watchdog found a lost peer and is about to cancel `job_id`: make the supervisor's decision (and
    resubmission) now. Its supervisor job would wait for the dead node to be declared DOWN first: SLURM
    satisfies `afterany` only once the cancelled job has stopped COMPLETING on every node, SlurmdTimeout
    later. That supervisor still runs afterwards and finds the decision made (one per job, under the lock).
    None when the run has no supervisor for this job (retries 0, a sweep, a local run): only the cancel."""
    if not journal.supervisors_of(run_dir, job_id):
        return None
    return supervise(run_dir, job_id, ending=JobState.CANCELLED)


def fit_of(spec: Spec) -> policy_mod.Fit:
    from hpctrain import slurmcommands as _slurm

    try:
        info = _slurm.partition_info(spec.resources.partition, tries=2)
    except Exception:  # noqa: BLE001 - unknown size: the policy's own cap applies
        info = None
    return policy_mod.Fit(nodes_needed=spec.resources.nodes, partition_nodes=info.nodes if info else None)


def _refresh_summary(run_dir: Path) -> None:
    try:
        from hpctrain.collect import summary as collect

        inp = _run_input(run_dir)
        collect.write_summary(collect.build_run(inp))
    except Exception:  # noqa: BLE001,S110 - the summary is a convenience here; `hpctrain summary` rebuilds it
        pass


# ============================================================================ `python -m hpctrain.fault.supervisor`
if __name__ == "__main__":
    sys.exit(watchdog_main(on_peer_lost=take_over))
