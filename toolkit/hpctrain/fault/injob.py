"""In-job restarts: the batch script's driver of the training `srun` steps (spare nodes, restarts in place).

With `resources.spare_nodes = K` the job allocates nodes + K hosts, is submitted `--no-kill` (a lost node
does not end the allocation) and trains on `nodes` of them. This driver, run by the batch script in place of
the bare `srun` line, launches the training as one srun step over the chosen hosts (hostfile of those only,
MASTER_ADDR on the first), and watches it with the hang/peer-lost checks of hpctrain.fault.watchdog. When the
step ends badly it asks the collector's classifier (hpctrain.collect.classify) why, and the retry rules
(hpctrain.states.is_retryable, the class list the supervisor's policy uses) whether a restart can help; if so
it ends the step, takes the survivors plus a spare in place of the implicated hosts (same world size: the
ranks resume from the latest complete checkpoint without conversion) and launches a new step in the same job.
Without spares, a retryable failure that implicates no host (a crashed rank, a transient gloo/NCCL error)
restarts in place. When the budget (`fault.in_job_restarts`) or the spares run out, it ends as the job did
before: a peer-lost or hang verdict goes to metrics/watchdog.jsonl and the job is cancelled (the supervisor
resubmits with the bad hosts excluded); a crash ends the job with the step's exit code.

Each step is an attempt of its own: its ranks log as logs/attempt-K (HPCTRAIN_ATTEMPT), and every restart is
a `restart` event in events.jsonl naming the step that ended, the new step, the class, and which host each
spare replaced (the collector turns those into attempt rows). Stdlib + hpctrain's login-side modules only
(no torch): the batch script runs it with the submitting python.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpctrain.fault import warm as warm_mod
from hpctrain.fault.watchdog import PEER_POLL_S, Watchdog, log_attempt
from hpctrain.nodelist import expand
from hpctrain.runs import beats as beats_mod
from hpctrain.runs import events as events_mod
from hpctrain.runs import folder as runs_mod
from hpctrain.runs import journal
from hpctrain.runs.journal import WatchdogVerdict
from hpctrain.states import (
    HEALTH_DIR_ENV,
    HEALTH_INJECT_ENV,
    HEALTH_ROUND_ENV,
    IMPLICATES_HOST,
    INJOB_RESTART_ENV,
    NODE_MODE_ENV,
    ExitCode,
    FailureClass,
    JobState,
    is_retryable,
)

RESTART = events_mod.RESTART  # the events.jsonl kind of one in-job restart
HEALTH = events_mod.HEALTH  # the events.jsonl kind of one health check (hpctrain.fault.health's verdict)
# After the step's scancel, how long srun may take to go before it is killed. srun waits for every node's answer,
# the dead one's too, and a step stopped by scancel needs nothing more from it: the ranks on the live nodes are
# SLURM's to end, and the next step's ranks wait for them to be gone on their own node (hpctrain.node.launch.main).
STOP_GRACE_S = 0.2
PORT_STRIDE = 2  # each restart's rendezvous ports: MASTER_PORT + 2k (+1 the pre-flight's), none a dying rank holds
WATCH_POLL_S = min(0.5, PEER_POLL_S)  # the driver's loop: a step's exit or its ranks' failure files, twice a second
SLURMD_PROBE_S = 1.0  # a blamed host's slurmd that accepts no connection in this long is taken for gone


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """Why an srun step of the job ended (the health check's verdict on nodes is fault.health.HealthVerdict): a
    failure class, the hosts it implicates, the evidence, and when it was seen."""

    failure_class: str | None
    hosts: tuple[str, ...] = ()
    message: str = ""
    watchdog: WatchdogVerdict | None = None  # the watchdog's verdict (peer_lost / hang / ...), when it decided
    detected: float = 0.0
    stopped: float = 0.0  # when the step was over (ended by itself, or stopped by the driver)
    first_error: float | None = None  # the step's first rank failure (its beat's time), when one failed


@dataclasses.dataclass(frozen=True)
class Restart:
    """The next step: its hosts (same count), which host each spare replaces, the bad hosts so far."""

    hosts: tuple[str, ...]
    replaced: dict[str, str]
    bad: frozenset[str]


def plan_restart(verdict: StepEnd, in_use: Sequence[str], job_hosts: Sequence[str], bad: frozenset[str],
                 used: int, budget: int) -> Restart | str:
    """The next step's hosts, or why there is none (the caller falls back to ending the job). Pure.

    Implicated hosts of this step are replaced, in order, by the job's unused hosts that never failed;
    the others keep their place (rank order, so rank 0 stays where it was unless its host failed)."""
    cls = verdict.failure_class
    if cls is None:
        return "the step ended without a failure"
    if not is_retryable(cls):
        return f"failure class {cls} is not retryable (the supervisor's policy stops on it too)"
    if used >= budget:
        return f"in-job restart budget spent ({used} of {budget})"
    now_bad = bad | {h for h in verdict.hosts if h in in_use}
    spares = [h for h in job_hosts if h not in in_use and h not in now_bad]
    hosts, replaced = [], {}
    for h in in_use:
        if h in now_bad:
            if not spares:
                return f"no spare node left to replace {h}"
            replaced[h] = spares.pop(0)
            hosts.append(replaced[h])
        else:
            hosts.append(h)
    return Restart(tuple(hosts), replaced, frozenset(now_bad))


def classify_exit(run_dir: Path, job: str, attempt: int, rc: int, down: Sequence[str]) -> StepEnd:
    """A step that ended by itself with exit status `rc`: the collector's classifier reads this attempt's
    events (the ranks' failure events name class, rank and host); hosts SLURM reports down are implicated."""
    from hpctrain.collect import classify as cc

    evs = events_mod.of_attempt(events_mod.read_events(run_dir), attempt, job)
    state = JobState.NODE_FAIL if down else JobState.FAILED
    found = cc.classify(state, [], exit_code=f"{rc}:0", events=evs, hosts=list(down))
    cls = found.failure_class or FailureClass.UNKNOWN
    hosts = [*down]
    if found.host and cls in IMPLICATES_HOST:
        hosts.append(found.host)
    msg = found.message or f"step exited {rc}"
    return StepEnd(cls, tuple(dict.fromkeys(hosts)), msg, None, time.time())


def verdict_of_watchdog(rec: WatchdogVerdict) -> StepEnd:
    """The watchdog's record as a verdict: a lost peer is a node failure, a hang a hang (as the supervisor reads
    them); a persistent straggler is replaced like a failing node, under its own class (straggler)."""
    return StepEnd(rec.failure_class, rec.silent_hosts, rec.message, rec, rec.time or time.time())


# ---------------------------------------------------------------------------------------------- plumbing
@dataclasses.dataclass
class Driver:
    """One job's steps. `launch` is the srun command line of the batch script (srun + its flags + command);
    the driver adds the step's node list and task count."""

    run_dir: Path
    job: str
    job_hosts: list[str]
    nodes: int
    tasks_per_node: int
    budget: int
    launch: list[str]
    hang_timeout_s: float = 0.0
    world: int = 1
    env: dict[str, str] = dataclasses.field(default_factory=lambda: dict(os.environ))
    # Straggler exclusion (fault.straggler_patience_s, 0 = off): a host whose ranks the straggler verdict names
    # for this long is replaced like a failing node, only while a spare and budget are left.
    straggler_patience_s: float = 0.0
    straggler_ratio: float = 1.2
    find_stragglers: Callable[[list[dict[str, Any]], float], list[str]] | None = None
    slurmd_port: int | None = None  # SlurmdPort (scontrol show config), read once when a peer is first lost
    # The health check before the first step (fault.health_check): thresholds of hpctrain.fault.health.judge.
    health: bool = False
    health_timeout_s: float = 300.0
    health_matmul_ratio: float = 0.8
    health_net_ratio: float = 0.5
    health_min_busbw_gbps: float = 0.0
    # Warm ranks (hpctrain.fault.warm): a zygote per node forks every step's ranks, so a restart skips the imports.
    warm: bool = False
    _zygotes: list[Any] = dataclasses.field(default_factory=list, init=False, repr=False)  # their sruns, if started

    def run(self) -> int:
        """Launch the first step, then judge each step's end: return its exit status, restart, or give up."""
        hosts, bad = list(self.job_hosts[:self.nodes]), frozenset[str]()
        restarts = self.env.get("SLURM_RESTART_COUNT", "0") or "0"
        attempt = log_attempt(self.env)
        if self.health:
            checked = self._health_check(attempt, restarts)
            if isinstance(checked, int):
                return checked
            hosts, bad = checked
        if self.warm and warm_mod.enabled(self.env):  # after the health check: its figures are not the imports'
            self._start_zygotes([h for h in self.job_hosts if h not in bad])
        try:
            return self._steps(hosts, bad, attempt, restarts)
        finally:
            warm_mod.stop(self._zygotes, self.run_dir, self.job)

    def _steps(self, hosts: list[str], bad: frozenset[str], attempt: int, restarts: str) -> int:
        """The training steps of the job, from the first: the exit status the job ends with."""
        used = 0
        proc, step = self._launch(hosts, attempt, restarts, 0)
        while True:
            spare_left = used < self.budget and any(h not in hosts and h not in bad for h in self.job_hosts)
            rc, rec = self._watch(proc, restarts, attempt, hosts if spare_left else [])
            if rec is None and rc in (ExitCode.OK, ExitCode.STOPPED):
                return rc  # finished, or stopped on the time-limit signal (rank 0 requeued the job)
            if rec is not None:
                self._stop_step(proc, step)
                verdict = verdict_of_watchdog(rec)
            else:
                verdict = classify_exit(self.run_dir, self.job, attempt, rc, self._down(hosts))
            fails = beats_mod.read_failures(self.run_dir, self.job, restarts, attempt)
            first_error = min((float(f.get("time", 0)) for f in fails), default=None)
            verdict = dataclasses.replace(verdict, stopped=time.time(), first_error=first_error)
            nxt = plan_restart(verdict, hosts, self.job_hosts, bad, used, self.budget)
            if isinstance(nxt, str):
                return self._give_up(verdict, nxt, rc, bad)
            used += 1
            nxt_attempt = self._next_attempt(attempt)
            proc, new_step = self._launch(list(nxt.hosts), nxt_attempt, restarts, used)
            self._record(attempt, step, hosts, nxt_attempt, new_step, verdict, nxt, used)
            swap = ", ".join(f"{a} by {b}" for a, b in nxt.replaced.items())
            print(f"hpctrain: in-job restart {used} of {self.budget}: {verdict.failure_class}: {verdict.message}; "
                  f"step {step} -> {new_step} on {','.join(nxt.hosts)} ({f'replaced {swap}' if swap else 'in place'})",
                  file=sys.stderr, flush=True)
            hosts, bad, attempt, step = list(nxt.hosts), nxt.bad, nxt_attempt, new_step

    # -- one step ------------------------------------------------------------------------------------
    def srun_argv(self, hosts: Sequence[str], tasks_per_node: int | None = None) -> list[str]:
        """The batch script's srun line narrowed to `hosts`: one task per rank there, nothing on the rest.
        --overlap: a step whose node died may linger in SLURM's books (COMPLETING on the dead node) until
        that node is declared down; the new step must not wait for its CPUs on the surviving nodes."""
        head, rest = self.launch[0], self.launch[1:]
        per = self.tasks_per_node if tasks_per_node is None else tasks_per_node
        return [head, f"--nodes={len(hosts)}", f"--nodelist={','.join(hosts)}",
                f"--ntasks={len(hosts) * per}", f"--ntasks-per-node={per}", "--overlap", *rest]

    # -- the health check ----------------------------------------------------------------------------
    def _health_check(self, attempt: int, restarts: str) -> tuple[list[str], frozenset[str]] | int:
        """Every node of the job runs hpctrain.node.launch.health in one srun step (one task per node, the training's
        launch line: its container too); a borderline node is measured again in a second step of its own; the
        nodes that pass train, a failed one's place taken by a spare. Returns the training hosts and the failed
        ones, or the exit status when too few passed (the job ends, and the supervisor resubmits with the failed
        nodes excluded)."""
        from hpctrain.fault import health as health_mod

        out_dir = runs_mod.RunFolder(self.run_dir).health_dir(self.job, attempt)
        shutil.rmtree(out_dir, ignore_errors=True)  # a requeued run of the job checks its nodes again
        out_dir.mkdir(parents=True, exist_ok=True)
        t0, load = time.time(), _DriverLoad()
        # ports of their own: no restart step's, no dying rank's
        env = self._step_env(self.job_hosts[0], attempt, restarts, ports=self.budget + 1)
        env.update({NODE_MODE_ENV: "health", HEALTH_DIR_ENV: str(out_dir)})
        step = self._health_step(list(self.job_hosts), env)
        reports = health_mod.read_reports(out_dir, list(self.job_hosts))
        # The driver and its srun run on the batch host, the job's first: their share of its CPUs counts as noise
        # there (the CPU rates are per CPU-second already, so it is small; tests/test_health.py has its figures).
        driver = load.share()
        judge = functools.partial(health_mod.judge, matmul_ratio=self.health_matmul_ratio, retest=True,
                                  net_ratio=self.health_net_ratio, min_busbw_gbps=self.health_min_busbw_gbps,
                                  batch_host=self.job_hosts[0], batch_load=driver["share"])
        verdict = health_mod.with_injected_borderline(judge(reports), os.environ.get(HEALTH_INJECT_ENV, ""))
        if verdict.retest:  # borderline: measured again, judged on both rounds' windows; only slow again fails
            again_dir = out_dir / "again"
            again_dir.mkdir(exist_ok=True)
            hosts = [h for h in self.job_hosts if h in verdict.retest]
            print("hpctrain: health check: borderline, measuring again: "
                  + "; ".join(f"{h}: {verdict.retest[h]}" for h in hosts), file=sys.stderr, flush=True)
            self._health_step(hosts, dict(env, **{HEALTH_DIR_ENV: str(again_dir), HEALTH_ROUND_ENV: "2"}))
            merged = health_mod.merge_remeasured(reports, health_mod.read_reports(again_dir, hosts), verdict.retest)
            verdict = judge(merged)
            # A node that passed the first round and reads borderline only against the median the re-measured
            # nodes moved passes: it was never below the line on its own round's figures.
            verdict = dataclasses.replace(verdict, retest={}, notes=verdict.notes + tuple(
                f"{h}: borderline only against the median the re-measured nodes moved ({w}); passed on its own round"
                for h, w in verdict.retest.items()))
        healthy = verdict.healthy(list(self.job_hosts))
        chosen = healthy[:self.nodes]
        planned = list(self.job_hosts[:self.nodes])
        incoming = [h for h in chosen if h not in planned]
        replaced = {h: incoming.pop(0) for h in planned if h not in chosen and incoming}
        self._record_health(attempt, step, verdict, chosen, replaced, time.time() - t0, driver)
        for line in _health_lines(verdict, replaced):
            print(f"hpctrain: health check: {line}", file=sys.stderr, flush=True)
        if len(chosen) < self.nodes:
            failed = sorted(verdict.failed)
            msg = (f"health check: {len(healthy)} of {len(self.job_hosts)} node(s) passed, {self.nodes} needed; "
                   + "; ".join(f"{h}: {verdict.failed[h]}" for h in failed))
            rec = WatchdogVerdict(event=journal.UNHEALTHY, job_id=self.job, attempt=attempt,
                                  silent_hosts=tuple(failed), time=time.time(), message=msg)
            give = StepEnd(FailureClass.NODE_FAIL, tuple(failed), msg, rec, time.time())
            return self._give_up(give, "too few nodes passed the health check", int(ExitCode.ERROR),
                                 frozenset(failed))
        return chosen, frozenset(verdict.failed)

    def _health_step(self, hosts: list[str], env: dict[str, str]) -> str:
        """One health srun step over `hosts`, one task each, waited for (fault.health_timeout_s at most): its id."""
        from hpctrain import slurmcommands as _slurm

        before = set(_safe_steps(self.job))
        # One node's task that dies must not take the others' reports with it (--kill-on-bad-exit would).
        argv = [a for a in self.srun_argv(hosts, tasks_per_node=1) if not a.startswith("--kill-on-bad-exit")]
        proc = _slurm.start_step([argv[0], "--kill-on-bad-exit=0", *argv[1:]], env=env)
        step = self._step_id(proc, before)
        try:
            proc.wait(timeout=self.health_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"hpctrain: health check step {step} still running after {self.health_timeout_s:g} s "
                  "(fault.health_timeout_s); stopping it", file=sys.stderr, flush=True)
            self._stop_step(proc, step)
        return step

    def _record_health(self, attempt: int, step: str, verdict: Any, chosen: list[str], replaced: dict[str, str],
                       elapsed: float, driver: dict[str, Any] | None = None) -> None:
        remeasured = sorted(h for h, f in verdict.figures.items() if "remeasured" in f)
        events_mod.append_event(self.run_dir, journal.HealthCheck(
            time=time.time(), job_id=self.job, attempt=attempt, step_id=step, hosts=tuple(self.job_hosts),
            failed=dict(verdict.failed), notes=tuple(verdict.notes), train_hosts=tuple(chosen), replaced=replaced,
            figures=verdict.figures, remeasured=tuple(remeasured), elapsed_s=round(elapsed, 2),
            driver={"host": self.job_hosts[0], **driver} if driver else None).to_event())

    def _launch(self, hosts: list[str], attempt: int, restarts: str, used: int) -> tuple[Any, str]:
        from hpctrain import slurmcommands as _slurm
        from hpctrain.render.sbatch import render_hostfile

        folder = runs_mod.RunFolder(self.run_dir)
        _archive_rank_files(folder, self.job, attempt)
        slots = self.world // max(1, self.nodes)
        tmp = folder.hostfile.with_name(folder.hostfile.name + ".tmp")
        runs_mod.write_private(tmp, render_hostfile(hosts, slots))
        os.replace(tmp, folder.hostfile)
        env = self._step_env(hosts[0], attempt, restarts, ports=used)
        env[INJOB_RESTART_ENV] = str(used)
        before = set(_safe_steps(self.job))
        argv = self.srun_argv(hosts)
        proc = _slurm.start_step(warm_mod.client_argv(argv) if self._zygotes else argv, env=env)
        return proc, self._step_id(proc, before)

    def _start_zygotes(self, hosts: list[str]) -> None:
        """The zygotes' steps, one on each of `hosts` (every usable node, spares too), listed by squeue before the
        first training step starts (so that step's id is told apart from theirs; bounded wait)."""
        before = set(_safe_steps(self.job))
        self._zygotes = warm_mod.start(self.launch, hosts, self.run_dir, dict(self.env))
        deadline = time.monotonic() + 15.0
        new: list[str] = []
        while self._zygotes and time.monotonic() < deadline:
            new = [s for s in _safe_steps(self.job) if s not in before]
            if len(new) >= len(self._zygotes):
                break
            time.sleep(0.2)
        if self._zygotes:
            print(f"hpctrain: warm ranks: zygotes in steps {','.join(new)} on {','.join(hosts)}", file=sys.stderr,
                  flush=True)

    def _step_env(self, master: str, attempt: int, restarts: str, ports: int) -> dict[str, str]:
        """One step's environment: rank 0's host, the rendezvous ports MASTER_PORT + PORT_STRIDE x `ports`,
        and HPCTRAIN_ATTEMPT such that the ranks number their logs and events K = HPCTRAIN_ATTEMPT +
        SLURM_RESTART_COUNT: the step's own attempt."""
        env = dict(self.env, MASTER_ADDR=master)
        if ports and str(env.get("MASTER_PORT", "")).isdigit():
            env["MASTER_PORT"] = str(int(env["MASTER_PORT"]) + PORT_STRIDE * ports)
        env["HPCTRAIN_ATTEMPT"] = str(attempt - (int(restarts) if restarts.isdigit() else 0))
        return env

    def _step_id(self, proc: Any, before: set[str], timeout_s: float = 15.0) -> str:
        """The new step's id ("123.1") from squeue (bounded wait); "JOB.?" when SLURM did not list it in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            new = [s for s in _safe_steps(self.job) if s not in before]
            if new:
                return new[-1]
            time.sleep(0.2)
        return f"{self.job}.?"

    def _watch(self, proc: Any, restarts: str, attempt: int,
               replaceable: Sequence[str] = ()) -> tuple[int, WatchdogVerdict | None]:
        """Wait for the step to end (its exit status) or for the watchdog's verdict on it (-1, the record); with
        `replaceable` hosts (a spare is left), a straggler verdict on them that lasts counts too."""
        dog = Watchdog(self.run_dir, self.job, self.hang_timeout_s or 1e9, world=self.world, restart=restarts,
                       attempt=attempt, only_attempt=attempt)
        next_hang = time.monotonic() + dog.poll_s()
        slow = _Persistence(self.straggler_patience_s)
        probed: dict[str, bool] = {}
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return int(proc.wait(timeout=WATCH_POLL_S)), None
            rec = dog.peer_check() or self._early_peer_lost(dog, probed)
            if rec is None and self.hang_timeout_s and time.monotonic() >= next_hang:
                next_hang = time.monotonic() + dog.poll_s()
                rec = dog.check()
            if rec is None and replaceable and self.straggler_patience_s and slow.due():
                rec = slow.update(self._slow_hosts(restarts, attempt, replaceable))
            if rec is not None:
                if rec.event == journal.HANG:  # which line each rank hung in, before the step is stopped
                    dog.dump_stacks(rec)
                return -1, rec

    def _slow_hosts(self, restarts: str, attempt: int, replaceable: Sequence[str]) -> list[str]:
        """Hosts of this step the straggler verdict names (hpctrain.collect.stragglers: per-rank compute times
        in the beats against the other ranks' median)."""
        find = self.find_stragglers or _straggler_finder()
        beats = beats_mod.read_beats(self.run_dir, self.job, restarts, attempt)
        return [h for h in find(beats, self.straggler_ratio) if h in replaceable]

    def _early_peer_lost(self, dog: Watchdog, probed: dict[str, bool]) -> WatchdogVerdict | None:
        """The peer-lost verdict before its confirmation period, when every host it blames has no slurmd
        answering (a dead node: SLURM itself notices only after SlurmdTimeout). The period is there for a rank
        that died on a live node: then srun ends the step within a second, and its exit is classified instead.
        Each host is probed once per step (`probed`: host -> alive)."""
        rec = dog.peer_check(confirm_s=0.0)
        hosts = list(rec.silent_hosts) if rec else []
        if rec is None or not hosts:
            return None
        for h in hosts:
            if h not in probed:
                probed[h] = _slurmd_answers(h, self._slurmd_port())
        if any(probed[h] for h in hosts):
            return None
        return rec.replace(message=f"{rec.message} (slurmd on {', '.join(hosts)} not answering)")

    def _slurmd_port(self) -> int:
        if self.slurmd_port is None:
            self.slurmd_port = _slurmd_port_of_config()
        return self.slurmd_port

    def _stop_step(self, proc: Any, step: str) -> None:
        """End a step the watchdog condemned. The survivors' ranks have usually exited on the peer error already;
        srun waits for the dead node's answer, so it is stopped after STOP_GRACE_S. A plain scancel of the step is
        handled by slurmctld in the background: `scancel --signal=KILL` of a step waits for every node's reply,
        the dead one's too (measured: 24 s), and SIGTERM to srun forwards to the ranks it can still reach."""
        from hpctrain import slurmcommands as _slurm

        if not step.endswith(".?"):
            with contextlib.suppress(Exception):  # srun is stopped below either way
                _slurm.scancel([step])
        try:
            proc.wait(timeout=STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            print(f"hpctrain: srun of step {step} did not exit; starting the next step anyway", file=sys.stderr,
                  flush=True)

    def _down(self, hosts: Sequence[str]) -> list[str]:
        from hpctrain.fault.supervisor import down_hosts

        return [h for h in down_hosts(",".join(hosts)) if h in hosts]

    def _next_attempt(self, attempt: int) -> int:
        from hpctrain.fault.supervisor import next_attempt_number

        return max(attempt + 1, next_attempt_number(self.run_dir))

    # -- records -------------------------------------------------------------------------------------
    def _record(self, attempt: int, step: str, step_hosts: list[str], nxt_attempt: int, new_step: str,
                verdict: StepEnd, nxt: Restart, used: int) -> None:
        """The restart as an event (the collector's attempt rows) and the new attempt in attempts.jsonl."""
        now = time.time()
        host = next(iter(nxt.replaced), "")
        events_mod.append_event(self.run_dir, journal.InJobRestart(
            time=now, host=host, job_id=self.job, attempt=attempt, failure_class=verdict.failure_class,
            message=verdict.message, step_id=step, step_hosts=tuple(step_hosts), next_step_id=new_step,
            next_attempt=nxt_attempt, replaced=nxt.replaced, hosts=tuple(nxt.hosts), restart=used, budget=self.budget,
            detected=verdict.detected, stopped=verdict.stopped, first_error=verdict.first_error,
            job_hosts=tuple(self.job_hosts), launched=now).to_event())
        # No state, times or nodes here: the collector merges a job's lines into each of its rows (state from
        # SLURM), and takes each step's own times and hosts from the restart event.
        runs_mod.RunFolder(self.run_dir).append_attempt(
            {"attempt": nxt_attempt, "job_id": self.job, "step_id": new_step, "in_job_restart_of": used,
             "executor": "slurm", "after": {"attempt": attempt, "step_id": step}})

    def _give_up(self, verdict: StepEnd, why: str, rc: int, bad: frozenset[str]) -> int:
        """No restart inside the job: end it as before spares existed. A watchdog verdict is recorded where the
        supervisor reads it, with every host that failed in this job (SLURM may not know them all down yet),
        the supervisor decides now (peer lost) and the job is cancelled; a crash ends with its exit status."""
        print(f"hpctrain: no in-job restart: {why}; {verdict.failure_class}: {verdict.message}", file=sys.stderr,
              flush=True)
        if verdict.watchdog is None:
            return rc if rc > 0 else int(ExitCode.ERROR)
        from hpctrain import slurmcommands as _slurm
        from hpctrain.fault.supervisor import take_over

        rec = verdict.watchdog.replace(silent_hosts=sorted(set(verdict.watchdog.silent_hosts) | set(bad)), in_job=why)
        journal.write_verdict(self.run_dir, rec)
        if rec.blames_nodes:
            try:
                take_over(self.run_dir, self.job)
            except Exception as exc:  # noqa: BLE001 - the supervisor job decides later instead
                print(f"hpctrain: could not decide now ({exc}); the supervisor job will", file=sys.stderr, flush=True)
        _slurm.scancel([self.job])
        return int(ExitCode.ERROR)


def timeline(run_dir: Path) -> list[dict[str, Any]]:
    """Each in-job restart's timeline in seconds from its detection: the step's first rank failure (negative:
    before the detection), step stopped, next step launched (srun started and listed), the first rank's `start`
    event (processes up), the resume (rank 0's training start, after model build and checkpoint load), the first
    training step of the new attempt (metrics.jsonl), and rank 0's start-up part by part (`startup`)."""
    evs = events_mod.read_events(run_dir)
    steps = [r for r in runs_mod.iter_jsonl(runs_mod.RunFolder(run_dir).metrics_jsonl) if "step" in r]
    out = []
    for e in journal.restarts(evs):
        k, t0 = e.next_attempt, float(e.detected or e.time)
        mine = [x for x in evs if x.attempt == k]
        up = min((x.time for x in mine if x.kind == events_mod.START), default=None)
        # rank 0's `train` events carry no attempt (the node writes them so): the first one after the restart
        starts = sorted((x for x in evs if x.kind == events_mod.TRAIN and x.extra.get("event") == "start"
                         and x.time > t0), key=lambda x: x.time)
        resumed = starts[0].time if starts else None
        first = min((float(r["time"]) for r in steps if float(r.get("time", 0)) > t0), default=None)
        rel = {name: (None if t is None else round(float(t) - t0, 2)) for name, t in (
            ("first_error", e.first_error), ("stopped", e.stopped), ("launched", e.launched), ("ranks_up", up),
            ("resumed", resumed), ("first_step", first))}
        # rank 0's start-up, part by part (hpctrain.node.phases): entry, preflight, prepare, process group, engine, load
        startup = starts[0].extra.get("startup") if starts else None
        out.append({"attempt": e.attempt, "next_attempt": k, "class": e.failure_class,
                    "replaced": e.replaced, "detected": t0, **rel,
                    **({"startup": startup} if isinstance(startup, dict) else {})})
    return out


class _Persistence:
    """A straggler verdict must hold `patience_s` for the same hosts before it counts: a node slow for one
    checkpoint or one garbage collection is not replaced. Polled every few seconds (it reads every beat)."""

    def __init__(self, patience_s: float) -> None:
        self.patience_s, self.every_s = patience_s, min(5.0, max(0.2, patience_s / 4))
        self.hosts: tuple[str, ...] = ()
        self.since = 0.0
        self.next = time.monotonic() + self.every_s

    def due(self) -> bool:
        if time.monotonic() < self.next:
            return False
        self.next = time.monotonic() + self.every_s
        return True

    def update(self, hosts: Sequence[str], now: float | None = None) -> WatchdogVerdict | None:
        now = time.time() if now is None else now
        key = tuple(sorted(hosts))
        if key != self.hosts:
            self.hosts, self.since = key, now
        if not key or now - self.since < self.patience_s:
            return None
        who = ", ".join(key)
        return WatchdogVerdict(event=journal.STRAGGLER, silent_hosts=key, time=now,
                               message=f"straggler: {who} slower than the other ranks' median for "
                                       f"{now - self.since:.0f} s (fault.straggler_patience_s = "
                                       f"{self.patience_s:g}); replaced by a spare")


def _straggler_finder() -> Callable[[list[dict[str, Any]], float], list[str]]:
    """hpctrain.collect.stragglers' verdict as a host list."""
    from hpctrain.collect import stragglers

    def find(beats: list[dict[str, Any]], ratio: float) -> list[str]:
        verdict = stragglers.find(stragglers.newest_job_beats(beats), ratio=ratio)
        return list(verdict["slow_hosts"]) if verdict else []

    return find


class _DriverLoad:
    """The CPU this driver and its finished children (srun, squeue) used since it was made, as a share of the
    CPUs this process may run on (the batch host's, in the batch script)."""

    def __init__(self) -> None:
        self.t0, self.cpu0 = time.monotonic(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def share(self) -> dict[str, float]:
        wall, cpu = max(1e-6, time.monotonic() - self.t0), self._cpu() - self.cpu0
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return {"cpu_s": round(cpu, 3), "wall_s": round(wall, 2), "cpus": cpus, "share": round(cpu / wall / cpus, 4)}


def _health_lines(verdict: Any, replaced: dict[str, str]) -> list[str]:
    if not verdict.failed and not verdict.notes:
        return ["every node passed"]
    out = [f"{h} failed: {why}" + (f"; replaced by {replaced[h]}" if h in replaced else "")
           for h, why in sorted(verdict.failed.items())]
    return out + list(verdict.notes)


def _slurmd_answers(host: str, port: int, timeout_s: float = SLURMD_PROBE_S) -> bool:
    """Whether `host`'s slurmd accepts a TCP connection. A name that does not resolve counts as answering: no
    evidence, so the verdict keeps its confirmation period."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except socket.gaierror:
        return True
    except OSError:
        return False


def _slurmd_port_of_config() -> int:
    from hpctrain import slurmcommands as _slurm

    try:
        return _slurm.slurmd_port()
    except Exception:  # noqa: BLE001 - SLURM's default
        return 6818


def _safe_steps(job: str) -> list[str]:
    from hpctrain import slurmcommands as _slurm

    try:
        return _slurm.step_ids(job)
    except Exception:  # noqa: BLE001 - squeue hiccup: the step id is a label, never a reason to stop
        return []


def _archive_rank_files(folder: runs_mod.RunFolder, job: str, attempt: int) -> None:
    """Move the ended step's beats and failure markers aside (metrics/ranks/attempt-K/): the watchdog of the next
    step reads the same job and restart count, and must see only its own ranks."""
    ranks = beats_mod.ranks_dir(folder.metrics_dir)
    if not ranks.is_dir():
        return
    olds = [p for p in ranks.glob(beats_mod.beat_name("*"))] + list(ranks.glob(beats_mod.failed_name(job, "*", "*")))
    if not olds:
        return
    dest = ranks / f"before-attempt-{attempt}"
    dest.mkdir(exist_ok=True)
    for p in olds:
        shutil.move(str(p), dest / p.name)


def main(argv: list[str] | None = None) -> int:
    """`python -m hpctrain.fault.injob RUN_DIR --nodes N --tasks-per-node T --restarts R [...] -- srun ...`."""
    p = argparse.ArgumentParser(prog="python -m hpctrain.fault.injob")
    p.add_argument("run_dir")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--tasks-per-node", type=int, required=True)
    p.add_argument("--restarts", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--hang-timeout", type=float, default=0.0)
    p.add_argument("--straggler-patience", type=float, default=0.0)
    p.add_argument("--straggler-ratio", type=float, default=1.2)
    p.add_argument("--health", action="store_true")
    p.add_argument("--health-timeout", type=float, default=300.0)
    p.add_argument("--health-matmul-ratio", type=float, default=0.8)
    p.add_argument("--health-net-ratio", type=float, default=0.5)
    p.add_argument("--health-min-busbw", type=float, default=0.0)
    p.add_argument("--warm", action="store_true", help="fork the ranks from a zygote per node (hpctrain.fault.warm)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a, launch = p.parse_args(argv[:cut]), argv[cut + 1:]
    job, nodelist = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_JOB_NODELIST", "")
    if not job or not nodelist or not launch:
        print("hpctrain in-job driver: needs SLURM_JOB_ID, SLURM_JOB_NODELIST and an srun line", file=sys.stderr)
        return 2
    return Driver(Path(a.run_dir), job, expand(nodelist), a.nodes, a.tasks_per_node, a.restarts, launch,
                  a.hang_timeout, a.world, straggler_patience_s=a.straggler_patience,
                  straggler_ratio=a.straggler_ratio, health=a.health, health_timeout_s=a.health_timeout,
                  health_matmul_ratio=a.health_matmul_ratio, health_net_ratio=a.health_net_ratio,
                  health_min_busbw_gbps=a.health_min_busbw, warm=a.warm).run()


if __name__ == "__main__":
    sys.exit(main())
