"""Fault tolerance, the mechanism: supervisor job, resubmission, hang watchdog, per-rank beats, fault injection.

How a run recovers (no daemon on the login node):

* ``hpctrain submit`` (retries > 0, SLURM) also submits a 1-CPU *supervisor job*,
  ``sbatch --dependency=afterany:<JOB> --kill-on-invalid-dep=yes``, which runs ``hpctrain supervise RUN --job
  JOB`` on a compute node once the training job has ended for good. It collects (hpctrain.collect),
  decides (hpctrain.resubmit, pure), and either stops with the reason or submits attempt K+1 of the same
  run folder (new job id, recorded in the registry and attempts.jsonl, ``--exclude`` grown by the
  implicated hosts) plus a new supervisor for it. The ranks resume from the latest complete checkpoint
  by themselves.
* Time limit / preemption: training jobs keep ``--requeue``. SLURM's early USR2 makes every rank
  checkpoint and rank 0 requeue the job (``scontrol requeue``, through submitit): same job id, the
  supervisor's ``afterany`` stays pending meanwhile (a requeue does not satisfy it).
* NODE_FAIL: SLURM itself requeues a ``--requeue`` job whose node died (``JobRequeue=1``) and never places
  the rerun on the DOWN node; that is kept on purpose (fastest recovery, no extra job). The supervisor
  handles every end SLURM does not requeue: a NODE_FAIL on clusters without JobRequeue, hangs, crashes,
  NCCL/gloo errors, time limits after submitit's requeue budget; there it excludes the implicated host.
* Hang watchdog: ``python -m hpctrain.supervise watch`` runs in the background of the batch script
  (outside the ranks, so a hung Python cannot stop it). Every rank runs a `RankBeat` thread writing
  ``metrics/ranks/rank-R.json`` (step reached, phase, time). When no rank's step advances for
  ``launch.hang_timeout_s``, the watchdog appends the silent ranks (behind the others, or not beating)
  to ``metrics/watchdog.jsonl`` and cancels the job; the supervisor reads that as a hang.

Stdlib only at module level (the CLI imports it); SLURM commands go through hpctrain._slurm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain import resubmit as policy_mod
from hpctrain import runs as runs_mod

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.spec import Spec

SUPERVISOR_TIME_MIN = 10
RANKS_DIR = "ranks"
WATCHDOG_FILE = "watchdog.jsonl"
PHASES = ("start", "compute", "reduce", "checkpoint", "done")  # order matters: later = further along
_LOCK = ".supervise.lock"


# ============================================================================ node side: beats, faults
class RankBeat:
    """A daemon thread writing this rank's progress to metrics/ranks/rank-R.json every `interval_s`.

    The training loop only sets attributes (`step`, `phase`); the thread does the I/O, so the cost
    does not depend on the step rate. A rank hung in Python code still beats, but its step stays
    behind its peers' (they wait in the next collective): that names it. A dead or GIL-stuck rank
    stops beating: its file goes stale.
    """

    def __init__(self, metrics_dir: Path, rank: int, interval_s: float = 5.0) -> None:
        self.dir = Path(metrics_dir) / RANKS_DIR
        self.rank, self.interval_s = rank, max(0.2, interval_s)
        self.step, self.phase = 0, "start"
        self.host = socket.gethostname()
        self.job = os.environ.get("SLURM_JOB_ID", "")
        self.restart = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"hpctrain-beat-{rank}", daemon=True)

    def start(self) -> RankBeat:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def set(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    def stop(self, phase: str = "done") -> None:
        self.phase = phase
        self._stop.set()
        self.write()

    def write(self) -> None:
        rec = {"rank": self.rank, "host": self.host, "step": self.step, "phase": self.phase, "time": time.time(),
               "job": self.job, "restart": self.restart, "pid": os.getpid()}
        tmp = self.dir / f".rank-{self.rank}.json.tmp"
        try:
            tmp.write_text(json.dumps(rec) + "\n")
            os.replace(tmp, self.dir / f"rank-{self.rank}.json")
        except OSError:
            pass  # a full or flaky filesystem must not cost a training step

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.write()
            self._stop.wait(self.interval_s)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: HPCTRAIN_FAULT_INJECT="hang:rank=1,step=5;ckpt-crash:step=10;raise:step=3"."""

    kind: str  # hang | crash | ckpt-crash | raise
    step: int
    rank: int | None = None  # None: every rank
    every_attempt: bool = False  # raise: a user bug fails every attempt; the others fire once


FAULT_KINDS = ("hang", "crash", "ckpt-crash", "raise")


def parse_faults(text: str) -> list[Fault]:
    """Parse HPCTRAIN_FAULT_INJECT; a malformed entry is an error naming it (a test typo must not pass)."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, args = item.partition(":")
        kw = dict(a.split("=", 1) for a in args.split(",") if "=" in a)
        if kind not in FAULT_KINDS or "step" not in kw:
            raise ValueError(f"HPCTRAIN_FAULT_INJECT entry {item!r}: expected KIND:step=N[,rank=R] with KIND one of "
                             f"{', '.join(FAULT_KINDS)}")
        out.append(Fault(kind, int(kw["step"]), int(kw["rank"]) if "rank" in kw else None, kind == "raise"))
    return out


def inject(where: str, step: int, step0: int, rank: int, log: Any = None) -> None:
    """Test hook the node calls at `where` ("step": step N computed, before its collective; "checkpoint":
    step N's checkpoint half written). Each fault fires once per run and rank (a marker in
    $HPCTRAIN_RUN_DIR/metrics/faults/; without a run dir: only in an attempt that started before N), so
    the retry passes; `raise` is a user bug and fires every time."""
    text = os.environ.get("HPCTRAIN_FAULT_INJECT", "")
    if not text:
        return
    run_dir = os.environ.get("HPCTRAIN_RUN_DIR", "")
    for f in parse_faults(text):
        if f.step != step or (f.rank is not None and f.rank != rank):
            continue
        if (where == "checkpoint") != (f.kind == "ckpt-crash"):
            continue
        if not f.every_attempt:
            if not run_dir:
                if step0 >= step:
                    continue
            else:
                marker = Path(run_dir) / "metrics" / "faults" / f"{f.kind}-step{step}-rank{rank}"
                if marker.exists():
                    continue
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(f"{time.time()}\n")
        if log is not None:
            log.info("fault injection: %s at step %d on rank %d", f.kind, step, rank)
            for h in getattr(log, "handlers", []):
                h.flush()
        if f.kind == "raise":
            raise ValueError(f"user code failed at step {step} (injected by HPCTRAIN_FAULT_INJECT)")
        if f.kind == "hang":
            while True:  # a rank that stops making progress without dying
                time.sleep(3600)
        os._exit(17)  # crash / ckpt-crash: die now, no cleanup


# ============================================================================ watchdog (batch script)
def read_beats(run_dir: Path, job: str | None = None, restart: str | None = None) -> list[dict[str, Any]]:
    """Per-rank beats (of `job` and its run `restart` only, when given: files left by an earlier attempt
    or an earlier run of a requeued job are ignored)."""
    out = []
    for p in sorted((Path(run_dir) / "metrics" / RANKS_DIR).glob("rank-*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and (job is None or str(rec.get("job")) == str(job)) and (
                restart is None or str(rec.get("restart", "0")) == str(restart)):
            out.append(rec)
    return out


def _order(beat: dict[str, Any]) -> tuple[int, int]:
    phase = str(beat.get("phase", "start"))
    return int(beat.get("step", 0)), PHASES.index(phase) if phase in PHASES else 0


def silent_ranks(beats: list[dict[str, Any]], world: int, now: float, stale_s: float) -> list[dict[str, Any]]:
    """Ranks to blame for a hang: missing (never beat), stale (stopped beating), or behind the others
    (still computing a step the rest are waiting to reduce). Empty when all are equal and alive:
    then every rank waits in one collective and none can be named."""
    by_rank = {int(b["rank"]): b for b in beats if "rank" in b}
    out = [{"rank": r, "host": None, "why": "no beat from this rank"} for r in range(world) if r not in by_rank]
    alive = {r: b for r, b in by_rank.items() if now - float(b.get("time", 0)) <= stale_s}
    for r, b in sorted(by_rank.items()):
        if r not in alive:
            out.append({"rank": r, "host": b.get("host"), "step": b.get("step"),
                        "why": f"stopped beating {now - float(b.get('time', 0)):.0f} s ago (process dead or stuck)"})
    if len(alive) > 1:
        top = max(_order(b) for b in alive.values())
        for r, b in sorted(alive.items()):
            if _order(b) < top:
                out.append({"rank": r, "host": b.get("host"), "step": b.get("step"),
                            "why": f"at step {b.get('step')} ({b.get('phase')}) while others reached step {top[0]} "
                                   f"({PHASES[top[1]]})"})
    return sorted(out, key=lambda x: x["rank"])


@dataclasses.dataclass
class Watchdog:
    """The batch script's background loop (see module docstring). `check()` is one poll (tested alone)."""

    run_dir: Path
    job: str
    timeout_s: float
    world: int = 1
    grace_s: float = 0.0  # before the first step and while a checkpoint is written
    attempt: int = 0
    restart: str | None = None  # SLURM_RESTART_COUNT of this run of the job (None: any)
    started: float = dataclasses.field(default_factory=time.time)
    last_progress: int | None = None
    last_change: float = dataclasses.field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.grace_s = self.grace_s or max(3 * self.timeout_s, 600.0)

    def check(self, now: float | None = None) -> dict[str, Any] | None:
        """None while fine; the hang record when the run has made no progress for too long."""
        now = time.time() if now is None else now
        beats = read_beats(self.run_dir, self.job, self.restart)
        progress = max((int(b.get("step", 0)) for b in beats), default=None)
        if progress != self.last_progress:
            self.last_progress, self.last_change = progress, now
        phases = {str(b.get("phase")) for b in beats}
        if beats and phases <= {"done"}:
            return None
        # Before the first step (imports, checkpoint load) and while a checkpoint is written, steps take long.
        slow = progress is None or bool(phases & {"start", "checkpoint"})
        limit = self.grace_s if slow else self.timeout_s
        stale = now - self.last_change
        if stale <= limit:
            return None
        silent = silent_ranks(beats, self.world, now, stale_s=max(3 * self.poll_s(), 15.0))
        hosts = sorted({str(s["host"]) for s in silent if s.get("host")})
        who = ", ".join(f"rank {s['rank']}" + (f" on {s['host']}" if s.get("host") else "") for s in silent)
        done = progress - 1 if progress is not None and phases & {"compute", "reduce"} else progress
        msg = (f"no step completed after step {done} for {stale:.0f} s (limit {limit:.0f} s); "
               + (f"silent: {who}" if silent else "every rank is waiting in the same collective"))
        return {"event": "hang", "job_id": self.job, "attempt": self.attempt, "last_step": done,
                "silent_ranks": [s["rank"] for s in silent], "silent_hosts": hosts, "details": silent,
                "stale_s": round(stale, 1), "timeout_s": self.timeout_s, "time": now, "message": msg}

    def poll_s(self) -> float:
        return min(10.0, max(1.0, self.timeout_s / 5))

    def run(self, cancel: bool = True) -> dict[str, Any] | None:
        """Poll until a hang (record it, cancel the job, return the record); the batch script kills this
        process when the job ends normally."""
        while True:
            time.sleep(self.poll_s())
            rec = self.check()
            if rec is None:
                continue
            path = Path(self.run_dir) / "metrics" / WATCHDOG_FILE
            runs_mod.append_attempt(path, rec)
            print(f"hpctrain watchdog: {rec['message']}; cancelling job {self.job}", file=sys.stderr, flush=True)
            if cancel:
                from hpctrain import _slurm

                _slurm.scancel([self.job])
            return rec


def watchdog_records(run_dir: Path, job: str) -> list[dict[str, Any]]:
    return [r for r in runs_mod.read_attempts(Path(run_dir) / "metrics" / WATCHDOG_FILE)
            if str(r.get("job_id")) == str(job)]


def log_attempt(env: dict[str, str] | None = None) -> int:
    """The K of logs/attempt-K.*: HPCTRAIN_ATTEMPT (the attempt's base, set at resubmission) plus SLURM's
    restart count (each requeue of that job)."""
    env = dict(os.environ) if env is None else env
    base = env.get("HPCTRAIN_ATTEMPT", "")
    restarts = env.get("SLURM_RESTART_COUNT", "")
    return (int(base) if base.isdigit() else 0) + (int(restarts) if restarts.isdigit() else 0)


# ============================================================================ resubmission
def next_attempt_number(run_dir: Path, registry_attempts: list[int] | None = None) -> int:
    """One past every attempt number seen: registry, attempts.jsonl, and logs/attempt-K.* (SLURM's own
    requeues number their logs by restart count, so those numbers are taken too)."""
    seen = list(registry_attempts or [])
    seen += [int(r["attempt"]) for r in runs_mod.read_attempts(Path(run_dir) / "attempts.jsonl")
             if isinstance(r.get("attempt"), int)]
    for p in (Path(run_dir) / "logs").glob("attempt-*.rank-*.log"):
        m = re.match(r"attempt-(\d+)\.", p.name)
        if m:
            seen.append(int(m.group(1)))
    return max(seen, default=-1) + 1


def latest_checkpoint(run_dir: Path) -> int | None:
    from hpctrain.collect_metrics import complete_checkpoints

    steps = complete_checkpoints(Path(run_dir) / "checkpoints")
    return steps[-1] if steps else None


def resubmit_run(run_dir: Path, *, exclude: tuple[str, ...] | None = None, time_limit: str | None = None,
                 retries: int | None = None, record: dict[str, Any] | None = None,
                 arm_supervisor: bool = True) -> dict[str, Any]:
    """Submit attempt K+1 of the run in `run_dir` (same spec and folder; exclude/time/retries as given)
    and, when the run has retries left, its supervisor. Returns what was submitted."""
    import dataclasses as dc

    from hpctrain import dispatch
    from hpctrain.plan import make_plan
    from hpctrain.spec import read_resolved, to_toml

    run_dir = Path(run_dir).absolute()
    spec = read_resolved(run_dir)
    res = spec.resources
    spec = dc.replace(spec, resources=dc.replace(res, exclude=tuple(exclude) if exclude is not None else res.exclude,
                                                 time=time_limit or res.time),
                      launch=dc.replace(spec.launch, retries=spec.launch.retries if retries is None else retries))
    plan = make_plan(spec)
    attempt = next_attempt_number(run_dir, _registry_attempts(run_dir.name))
    _write_atomic(run_dir / "spec.toml", to_toml(spec))  # "exactly as dispatched": the latest attempt's request
    rec = {"excluded": list(spec.resources.exclude), "time": spec.resources.time, **(record or {})}
    old = os.environ.get("HPCTRAIN_ATTEMPT")
    os.environ["HPCTRAIN_ATTEMPT"] = str(attempt)  # sbatch --export=ALL: the ranks log as attempt-K
    try:
        sub = dispatch.submit_attempt(run_dir, spec, plan, attempt, record=rec)
    finally:
        if old is None:
            os.environ.pop("HPCTRAIN_ATTEMPT", None)
        else:
            os.environ["HPCTRAIN_ATTEMPT"] = old
    out = {"run_id": run_dir.name, "run_dir": str(run_dir), "attempt": attempt, "job_id": sub.job_id,
           "excluded": list(spec.resources.exclude), "time": spec.resources.time, "supervisor": None}
    if arm_supervisor and spec.launch.retries > 0:
        out["supervisor"] = arm(run_dir, sub.job_id, spec)
    return out


def _registry_attempts(run_id: str) -> list[int]:
    try:
        from hpctrain.registry import Registry

        return [a.attempt for a in Registry().get_run(run_id).attempts]
    except Exception:  # noqa: BLE001 - a run this registry never saw: the folder is the record
        return []


def _registry_failure(run_id: str, attempt: int, failure_class: str) -> None:
    """The attempt's failure class into the registry (`hpctrain status` shows it); best effort."""
    try:
        from hpctrain.registry import Registry

        Registry().update_attempt(run_id, attempt, failure_class=failure_class)
    except Exception:  # noqa: BLE001,S110 - the run folder holds the record anyway
        pass


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def supervisor_script(run_dir: Path, job_id: str, spec: Spec, python: str | None = None) -> str:
    """The supervisor's batch script: 1 task, 1 CPU, a few minutes, after the training job ends."""
    r = spec.resources
    flags = [f"--job-name={_name(spec.name)}-supervise", f"--dependency=afterany:{job_id}",
             "--kill-on-invalid-dep=yes", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
             f"--time={SUPERVISOR_TIME_MIN}", f"--output={shlex.quote(str(run_dir / 'logs' / 'supervisor.log'))}",
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
    from hpctrain import _slurm

    run_dir = Path(run_dir).absolute()
    path = run_dir / "submitit" / f"supervise-{job_id}.sh"
    _write_atomic(path, supervisor_script(run_dir, job_id, spec))
    sup = _slurm.job_id_from_sbatch(_slurm.sbatch(str(path)))
    runs_mod.append_attempt(run_dir / "attempts.jsonl", {"supervisor_job": sup, "supervises": job_id,
                                                        "time": time.time()})
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
    from hpctrain import _slurm
    from hpctrain.registry import FINAL_STATES

    deadline = time.monotonic() + timeout_s
    rec = None
    while time.monotonic() < deadline:
        try:
            rec = _slurm.sacct_states([job_id]).get(job_id)
        except Exception:  # noqa: BLE001 - slurmdbd hiccup: try again until the deadline
            rec = None
        if rec is not None and rec.state in FINAL_STATES:
            return rec
        time.sleep(3)
    return rec


def already_decided(run_dir: Path, job_id: str) -> dict[str, Any] | None:
    for r in runs_mod.read_attempts(Path(run_dir) / "attempts.jsonl"):
        if str(r.get("job_id")) == str(job_id) and "decision" in r:
            return r
    return None


def history(run_dir: Path, job_id: str, sacct_rec: Any = None) -> tuple[list[policy_mod.AttemptRecord], dict[str, Any]]:
    """The policy's view of every SLURM job of the run (oldest first) since the last manual
    resubmission, plus the collector's record of the run."""
    from hpctrain import collect

    run_dir = Path(run_dir)
    try:
        summary = collect.build_run(_run_input(run_dir))
    except Exception as err:  # noqa: BLE001 - a broken collector must not stop the recovery
        summary = _plain_summary(run_dir, job_id, sacct_rec, err)
    rows: dict[str, dict[str, Any]] = {}
    for row in summary["attempts"]:
        rows[str(row["job_id"])] = row  # a requeued job: its last run decides
    notes = runs_mod.read_attempts(run_dir / "attempts.jsonl")
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
        implicated = [fail["host"]] if fail.get("host") and cls in ("node_fail", "preflight", "hang") else []
        state = row["state"]
        if jid == str(job_id) and sacct_rec is not None:
            state = sacct_rec.state
        hang = watchdog_records(run_dir, jid)
        if hang:
            cls, msg, exc = "hang", hang[-1]["message"], None
            implicated = list(hang[-1].get("silent_hosts", []))
        if jid == str(job_id) and sacct_rec is not None and state == "NODE_FAIL":
            implicated += down_hosts(sacct_rec.nodelist)
        ck = note.get("checkpoint_step", row.get("last_checkpoint_step"))
        if jid == str(job_id):
            ck = latest_checkpoint(run_dir)
        out.append(policy_mod.AttemptRecord(
            attempt=int(row["attempt"]), job_id=jid, state=state, failure_class=cls, exit_code=row.get("exit_code"),
            exception=exc, message=msg or "", evidence=_evidence(fail, run_dir), last_step=row.get("last_step"),
            checkpoint_step=ck, hosts=tuple(row.get("hosts") or ()), implicated=tuple(dict.fromkeys(implicated)),
            excluded=tuple(note.get("excluded") or ())))
    return out, summary


_STATE_CLASS = {"NODE_FAIL": "node_fail", "BOOT_FAIL": "node_fail", "TIMEOUT": "time_limit", "DEADLINE": "time_limit",
                "PREEMPTED": "preempted", "CANCELLED": "cancelled", "OUT_OF_MEMORY": "host_oom", "FAILED": "unknown"}


def _plain_summary(run_dir: Path, job_id: str, sacct_rec: Any, exc: BaseException) -> dict[str, Any]:
    """The collector failed: one row per job from attempts.jsonl and sacct's state alone."""
    rows: dict[str, dict[str, Any]] = {}
    for r in runs_mod.read_attempts(Path(run_dir) / "attempts.jsonl"):
        if r.get("job_id") is not None and isinstance(r.get("attempt"), int):
            rows.setdefault(str(r["job_id"]), {"job_id": str(r["job_id"]), "attempt": r["attempt"]}).update(
                {k: r[k] for k in ("state", "exit_code") if r.get(k)})
    if sacct_rec is not None and str(job_id) in rows:
        rows[str(job_id)].update(state=sacct_rec.state, exit_code=sacct_rec.exit_code)
    for row in rows.values():
        row["failure_class"] = _STATE_CLASS.get(str(row.get("state")))
        row["failure"] = {"message": f"SLURM state {row.get('state')} (collector unavailable: {exc})"}
    return {"attempts": sorted(rows.values(), key=lambda x: int(x["attempt"]))}


def _evidence(fail: dict[str, Any], run_dir: Path) -> str:
    where = []
    if fail.get("rank") is not None:
        where.append(f"rank {fail['rank']}" + (f" on {fail['host']}" if fail.get("host") else ""))
    if fail.get("source"):
        where.append(str(run_dir / fail["source"]))
    return ", ".join(where)


def _run_input(run_dir: Path) -> Any:
    from hpctrain import collect

    try:
        from hpctrain.registry import Registry

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
    from hpctrain import _slurm

    try:
        states = _slurm.node_states(nodelist)
    except Exception:  # noqa: BLE001 - without sinfo the collector's host is all we have
        return []
    bad = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "*")
    return [h for h, s in states.items() if any(b in s.upper() for b in bad)]


def supervise(run_dir: Path, job_id: str) -> dict[str, Any]:
    """What the supervisor job runs after `job_id` ended: decide, record, maybe resubmit."""
    import fcntl

    from hpctrain.spec import read_resolved

    run_dir = Path(run_dir).absolute()
    _scrub_slurm_env()
    if not (run_dir / "spec.toml").is_file():  # the run folder was deleted meanwhile: nothing to resume
        return {"action": "stop", "reason": f"run folder {run_dir} is gone"}
    with open(run_dir / _LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a requeued supervisor must not act twice
        done = already_decided(run_dir, job_id)
        if done:
            return dict(done["decision"])
        rec = wait_final(job_id)
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
        note: dict[str, Any] = {"attempt": last.attempt if last else None, "job_id": str(job_id),
                                "state": last.state if last else None,
                                "failure_class": decision.failure_class, "checkpoint_step": latest_checkpoint(run_dir),
                                "decision": decision.to_dict(), "time": time.time()}
        hang = watchdog_records(run_dir, job_id)
        if hang:
            note["hang"] = {k: hang[-1].get(k) for k in ("last_step", "silent_ranks", "silent_hosts", "stale_s",
                                                          "message")}
        if decision.action == "retry":
            try:
                sub = resubmit_run(run_dir, exclude=decision.exclude,
                                   record={"resubmitted_after": str(job_id), "reason": decision.reason})
                note["next"] = {"attempt": sub["attempt"], "job_id": sub["job_id"], "supervisor": sub["supervisor"]}
            except Exception as exc:  # noqa: BLE001 - say why in the record, then fail the supervisor job
                note["decision"] = {**decision.to_dict(), "action": "stop",
                                    "reason": f"{decision.reason}; resubmission failed: {exc}"}
        runs_mod.append_attempt(run_dir / "attempts.jsonl", note)
        if last is not None and decision.failure_class:
            _registry_failure(run_dir.name, last.attempt, decision.failure_class)
    _refresh_summary(run_dir)
    print(f"hpctrain supervise: {note['decision']['action']}: {note['decision']['reason']}", flush=True)
    return dict(note["decision"])


def fit_of(spec: Spec) -> policy_mod.Fit:
    from hpctrain import _slurm

    try:
        info = _slurm.partition_info(spec.resources.partition, tries=2)
    except Exception:  # noqa: BLE001 - unknown size: the policy's own cap applies
        info = None
    return policy_mod.Fit(nodes_needed=spec.resources.nodes, partition_nodes=info.nodes if info else None)


def _refresh_summary(run_dir: Path) -> None:
    try:
        from hpctrain import collect

        inp = _run_input(run_dir)
        collect.write_summary(collect.build_run(inp))
    except Exception:  # noqa: BLE001,S110 - the summary is a convenience here; `hpctrain summary` rebuilds it
        pass


# ============================================================================ `python -m hpctrain.supervise`
def _main(argv: list[str] | None = None) -> int:
    """`watch RUN_DIR --timeout S [--world N]`: the batch script's watchdog (no click: starts fast)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m hpctrain.supervise")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("run_dir")
    w.add_argument("--timeout", type=float, required=True)
    w.add_argument("--world", type=int, default=1)
    w.add_argument("--job", default=os.environ.get("SLURM_JOB_ID", ""))
    a = p.parse_args(argv)
    if not a.job:
        print("hpctrain watchdog: no SLURM_JOB_ID; nothing to watch", file=sys.stderr)
        return 2
    Watchdog(Path(a.run_dir), a.job, a.timeout, world=a.world, attempt=log_attempt(),
             restart=os.environ.get("SLURM_RESTART_COUNT") or "0").run()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
