"""The hang watchdog: the batch script's background loop over what the ranks write.

* The ranks (hpctrain.node.monitor.heartbeat.RankBeat) beat into metrics/ranks/rank-R.json (format:
  hpctrain.runs.beats).
* `Watchdog`: `python -m hpctrain.fault.supervisor watch ...`: no step for launch.hang_timeout_s -> the silent
  ranks go to metrics/watchdog.jsonl and the job is cancelled; the supervisor (hpctrain.fault.supervisor)
  then retries the run without the silent host.
* Peer lost: a rank whose collective fails because a peer's connection closed (gloo "Connection reset by
  peer", NCCL remote error) writes metrics/ranks/failed-JOB-RESTART-R.json. When the job is still running
  a few seconds later, srun is waiting for a node that no longer answers (a live node's task exit ends the
  step at once, --kill-on-bad-exit): the watchdog records a `peer_lost` verdict naming that host and cancels
  the job, so the supervisor retries without it now instead of after SLURM's NODE_FAIL (SlurmdTimeout).

Stdlib only: the batch script runs it with the submitting python, and the CLI imports it. Design:
docs/fault-tolerance.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain.collect.classify import PEER_ADDR, PEER_LOST, peer_host
from hpctrain.runs import folder as runs_mod
from hpctrain.runs import journal
from hpctrain.runs.beats import PHASES, read_beats, read_failures
from hpctrain.runs.journal import WatchdogVerdict
from hpctrain.states import JobState

PEER_POLL_S = 1.0  # the peer-lost check is one directory listing: cheap enough every second
WATCHDOG_FILE = runs_mod.WATCHDOG_JSONL
# A rank's failure that reports a lost peer (hpctrain.collect.classify.PEER_LOST, the classifier's reading too):
# the peer's process or node died. Not a timeout: that is a hang, named by the hang check.
# The peer it names: the collector's reading (hpctrain.collect.classify.PEER_ADDR, peer_host).


def _done_step(rec: dict[str, Any]) -> int:
    """The last step a rank completed: its beat names the step it was working on."""
    step = int(rec.get("step", 0))
    return step - 1 if rec.get("was", rec.get("phase")) in ("compute", "reduce") else step


def lost_peers(failures: list[dict[str, Any]], beats: list[dict[str, Any]], world: int, now: float,
               confirm_s: float) -> WatchdogVerdict | None:
    """The peer-lost verdict, or None. Needs a rank whose collective failed on a closed peer connection at
    least `confirm_s` ago (the job still running then: srun waits for a node that no longer answers) and a
    host to blame: the peer the errors name, else the hosts whose ranks neither failed nor beat since."""
    comm = [f for f in failures if PEER_LOST.search(str(f.get("error", "")))]
    if not comm:
        return None
    first = min(float(f.get("time", now)) for f in comm)
    if now - first < confirm_s:
        return None
    failed_hosts = {str(f.get("host")) for f in failures}
    job_hosts = {str(b.get("host")) for b in beats} | failed_hosts
    # Only a host of this job may be named (it goes into sbatch --exclude): an address the hosts database
    # cannot resolve names nobody.
    named = {h for f in comm for m in PEER_ADDR.finditer(str(f["error"]))
             if (h := peer_host(m.group(1))) in job_hosts - failed_hosts}
    by_rank = {int(b["rank"]): b for b in beats if "rank" in b}
    failed_ranks = {int(f["rank"]) for f in failures}
    quiet = [r for r in range(world) if r not in failed_ranks and by_rank.get(r, {}).get("phase") != "done"]
    if named:
        hosts = named
    else:  # the error names nobody: blame the hosts that went quiet, unless that would be most of them
        hosts = {str(by_rank[r].get("host")) for r in quiet
                 if r in by_rank and float(by_rank[r].get("time", 0)) < first}
        if not hosts or len(hosts) * 2 > len(job_hosts):
            return None
    silent = [r for r in quiet if str(by_rank.get(r, {}).get("host")) in hosts]
    culprit = min(comm, key=lambda f: (float(f.get("time", now)), int(f["rank"])))
    err = str(culprit.get("error", ""))
    err = err if len(err) <= 200 else err[:197] + "..."
    who = ", ".join(sorted(hosts))
    # Asked at once (confirm_s 0: the in-job driver, which then checks the hosts' slurmd itself), "waiting for
    # them 0 s later" would say nothing: the wait is only part of the evidence once it has lasted.
    waited = (f" and the job was still waiting for them {now - first:.0f} s later" if now - first >= 1 else "")
    msg = (f"rank {culprit['rank']} on {culprit.get('host')} lost its peer on {who} ({err}); {who}'s ranks "
           f"stopped without an error{waited}: node or network lost")
    return WatchdogVerdict(event=journal.PEER_LOST, last_step=min(_done_step(f) for f in comm),
                           silent_ranks=tuple(silent), silent_hosts=tuple(sorted(hosts)),
                           details=tuple({k: f.get(k) for k in ("rank", "host", "step", "error")} for f in comm),
                           time=now, message=msg, extra={"detected_s": round(now - first, 1)})


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
    # Only this attempt's beats and failures (the in-job driver: each srun step is an attempt of its own, and a
    # dying rank of the step before may still write); None: any.
    only_attempt: int | None = None
    started: float = dataclasses.field(default_factory=time.time)
    last_progress: int | None = None
    last_change: float = dataclasses.field(default_factory=time.time)
    # A live node's task exit ends the step within a second (srun --kill-on-bad-exit); still running this
    # long after a rank lost its peer means srun waits for a node that does not answer. 0: no peer check.
    peer_confirm_s: float = 3.0
    # Called with (run_dir, job) on a lost peer, before the cancel; returns the decision it made, if any.
    # The supervisor passes its take_over (this module stays below the supervisor, which imports it).
    on_peer_lost: Callable[[Path, str], dict[str, Any] | None] | None = None
    stack_timeout_s: float = 10.0  # how long the ranks get to dump their stacks before the cancel
    # A user's own script beats only when it reports through hpctrain.runtime: one that never beats is not hung,
    # it just does not tell (the hang check waits for a first beat of this run).
    after_first_beat: bool = False

    def __post_init__(self) -> None:
        self.grace_s = self.grace_s or max(3 * self.timeout_s, 600.0)

    def check(self, now: float | None = None) -> WatchdogVerdict | None:
        """None while fine; the hang record when the run has made no progress for too long."""
        now = time.time() if now is None else now
        beats = read_beats(self.run_dir, self.job, self.restart, self.only_attempt)
        progress = max((int(b.get("step", 0)) for b in beats), default=None)
        if progress != self.last_progress:
            self.last_progress, self.last_change = progress, now
        phases = {str(b.get("phase")) for b in beats}
        if (beats and phases <= {"done"}) or (self.after_first_beat and not beats):
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
        return WatchdogVerdict(event=journal.HANG, job_id=self.job, attempt=self.attempt, last_step=done,
                               silent_ranks=tuple(s["rank"] for s in silent), silent_hosts=tuple(hosts),
                               details=tuple(silent), time=now, message=msg,
                               extra={"stale_s": round(stale, 1), "timeout_s": self.timeout_s})

    def poll_s(self) -> float:
        return min(10.0, max(1.0, self.timeout_s / 5))

    def _running(self) -> bool:
        """Still RUNNING for SLURM: a person's scancel or the time limit shows at once (CANCELLED/TIMEOUT,
        COMPLETING), while a job that lost a node stays RUNNING until NODE_FAIL."""
        try:
            from hpctrain import slurmcommands as _slurm

            return _slurm.queue_state(self.job) == JobState.RUNNING
        except Exception:  # noqa: BLE001 - slurmctld not answering: act on the ranks' evidence
            return True

    def _decide_now(self) -> None:
        """Retry without the dead host before the cancel (`on_peer_lost`: hpctrain.fault.supervisor.take_over
        says why); on any failure the supervisor job still decides, later."""
        if self.on_peer_lost is None:
            return
        try:
            decision = self.on_peer_lost(Path(self.run_dir), self.job)
            if decision:
                print(f"hpctrain watchdog: {decision['action']}: {decision['reason']}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - the supervisor job is the fallback
            print(f"hpctrain watchdog: could not decide now ({exc}); the supervisor job will", file=sys.stderr,
                  flush=True)

    def peer_check(self, now: float | None = None, confirm_s: float | None = None) -> WatchdogVerdict | None:
        """None, or the peer-lost record (see `lost_peers`); one directory listing while nothing failed.
        `confirm_s` overrides peer_confirm_s (the in-job driver: 0 once the blamed hosts' slurmd is gone)."""
        now = time.time() if now is None else now
        failures = read_failures(self.run_dir, self.job, self.restart, self.only_attempt)
        if not failures:
            return None
        beats = read_beats(self.run_dir, self.job, self.restart, self.only_attempt)
        rec = lost_peers(failures, beats, self.world, now, self.peer_confirm_s if confirm_s is None else confirm_s)
        return None if rec is None else rec.replace(job_id=self.job, attempt=self.attempt)

    def dump_stacks(self, rec: WatchdogVerdict) -> dict[str, Any]:
        """Every live rank's Python stack into stacks/ before the cancel (hpctrain.collect.stacks): which line each rank
        hung in; what came back goes to stacks/watchdog-JOB.json. A lost peer's ranks cannot answer: only the others are
        waited for, briefly (the retry should not wait on forensics). Never raises: the cancel must happen."""
        try:
            from hpctrain.collect import stacks

            lost = set(rec.silent_ranks) if rec.event == journal.PEER_LOST else set()
            want = [r for r in range(self.world) if r not in lost]
            rep = stacks.request(Path(self.run_dir), stacks.slurm_sender(self.job), want,
                                 timeout_s=self.stack_timeout_s if not lost else min(3.0, self.stack_timeout_s))
            out = {"event": rec.event, "job_id": self.job, "time": time.time(), **rep.to_dict()}
            stacks.write_json(rep.stacks_dir / f"watchdog-{self.job}.json", out)
            print(f"hpctrain watchdog: stacks of rank(s) {out['dumped']} in {rep.stacks_dir}"
                  + (f"; no dump from {rep.missing}" if rep.missing else ""), file=sys.stderr, flush=True)
            return out
        except Exception as exc:  # noqa: BLE001 - forensics are a bonus; the cancel is the job
            print(f"hpctrain watchdog: no stack dumps ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    def run(self, cancel: bool = True) -> WatchdogVerdict | None:
        """Poll until a lost peer (every second) or a hang (every poll_s): record it, cancel the job, return
        the record. The batch script kills this process when the job ends by itself."""
        next_hang = time.monotonic() + self.poll_s()
        while True:
            time.sleep(min(PEER_POLL_S, self.poll_s()))
            rec = self.peer_check() if self.peer_confirm_s > 0 else None
            if rec is None and time.monotonic() >= next_hang:
                next_hang = time.monotonic() + self.poll_s()
                rec = self.check()
            if rec is None:
                continue
            if cancel and rec.event == journal.PEER_LOST and not self._running():
                return None  # cancelled, timed out or preempted meanwhile: the dying ranks' errors say nothing
            journal.write_verdict(self.run_dir, rec)
            print(f"hpctrain watchdog: {rec.message}; cancelling job {self.job}", file=sys.stderr, flush=True)
            if cancel and rec.event == journal.PEER_LOST:
                self._decide_now()
            if cancel:
                from hpctrain import slurmcommands as _slurm

                self.dump_stacks(rec)
                _slurm.scancel([self.job])
            return rec


def watchdog_records(run_dir: Path, job: str) -> list[WatchdogVerdict]:
    """Job `job`'s verdicts in metrics/watchdog.jsonl (hpctrain.runs.journal), oldest first."""
    return journal.read_verdicts(run_dir, job)


def log_attempt(env: dict[str, str] | None = None) -> int:
    """The K of logs/attempt-K.*: HPCTRAIN_ATTEMPT (the attempt's base, set at resubmission) plus SLURM's
    restart count (each requeue of that job)."""
    env = dict(os.environ) if env is None else env
    base = env.get("HPCTRAIN_ATTEMPT", "")
    restarts = env.get("SLURM_RESTART_COUNT", "")
    return (int(base) if base.isdigit() else 0) + (int(restarts) if restarts.isdigit() else 0)


def main(argv: list[str] | None = None,
         on_peer_lost: Callable[[Path, str], dict[str, Any] | None] | None = None) -> int:
    """`watch RUN_DIR --timeout S [--world N]`: the batch script's watchdog (no click: starts fast)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m hpctrain.fault.supervisor")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("run_dir")
    w.add_argument("--timeout", type=float, required=True)
    w.add_argument("--world", type=int, default=1)
    w.add_argument("--job", default=os.environ.get("SLURM_JOB_ID", ""))
    w.add_argument("--after-first-beat", action="store_true", help="no hang verdict before a rank's first beat")
    a = p.parse_args(argv)
    if not a.job:
        print("hpctrain watchdog: no SLURM_JOB_ID; nothing to watch", file=sys.stderr)
        return 2
    Watchdog(Path(a.run_dir), a.job, a.timeout, world=a.world, attempt=log_attempt(),
             restart=os.environ.get("SLURM_RESTART_COUNT") or "0", on_peer_lost=on_peer_lost,
             after_first_beat=a.after_first_beat).run()
    return 0
