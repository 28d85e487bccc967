"""Stack dumps (runs/stacks, node/monitor/stacks, collect/stacks), the watchdog's dump before its cancel, stragglers
from the heartbeats' compute times, the progress `status --watch` shows, and its loop ending with the job.

The stack tests run real processes that register faulthandler exactly as a rank does (node.monitor.stacks.install)
and signal them as the local executor's ranks are signalled (by pid from their beats); the cluster test
(test_watch_slurm.py) does it through `scancel -s URG` on a 2-node job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpctrain.collect import progress, stacks, stragglers
from hpctrain.runs import beats
from hpctrain.runs import stacks as rs
from hpctrain.runs.folder import RunFolder
from hpctrain.runs.journal import WatchdogVerdict

ROOT = Path(__file__).resolve().parents[1]

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    from hpctrain.node.monitor import stacks
    from hpctrain.runs import beats
    run, rank, where = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    stacks.install(run / "stacks", rank, 0, "77")
    d = beats.ranks_dir(run / "metrics"); d.mkdir(parents=True, exist_ok=True)
    beats.write_record(d, beats.beat_name(rank), {"rank": rank, "host": "h%d" % (rank // 2), "pid": os.getpid(),
                                                  "step": 3, "phase": "compute", "time": time.time(), "job": "77"})
    def stuck_in_user_code():
        print("ready", flush=True)
        time.sleep(3600)
    def waiting_in_collective():
        print("ready", flush=True)
        threading.Event().wait()
    (stuck_in_user_code if where == "hang" else waiting_in_collective)()
""")


def _wait_asleep(pid: int, timeout: float = 30.0) -> None:
    """Until the process blocks (state S): it has entered the call it "hangs" in, past its "ready" line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S":
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not block within {timeout:.0f} s")


@pytest.fixture()
def ranks(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    run = tmp_path / "run with 'quotes'"
    (run / "metrics").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"world_size": 4}))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "toolkit")}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(run), str(r), "hang" if r == 1 else "wait"],
                              stdout=subprocess.PIPE, text=True, env={**env, "SLURMD_NODENAME": f"h{r // 2}"})
             for r in range(3)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            _wait_asleep(p.pid)
        yield run, procs
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def test_stacks_of_live_ranks_are_grouped_and_a_silent_rank_is_named(
        ranks: tuple[Path, list[subprocess.Popen[str]]]) -> None:
    run, procs = ranks
    rep = stacks.request(run, stacks.local_sender(run), stacks.expected_ranks(run), timeout_s=4)
    assert [d.rank for d in rep.dumps] == [0, 1, 2] and rep.missing == [3]  # rank 3 never started
    groups = rep.groups()
    assert [g.label() for g in groups] == ["rank 1 (h0)", "ranks 0,2 (h0,h1)"]
    hang = rs.main_thread(groups[0].dump)
    assert hang is not None and "in stuck_in_user_code" in hang.frames[-2 if len(hang.frames) > 1 else 0]
    assert any("in waiting_in_collective" in f for f in rs.main_thread(groups[1].dump).frames)  # type: ignore[union-attr]
    text = stacks.format_report(rep, "run r, job 77")
    assert "rank 1 (h0):" in text and "ranks 0,2 (h0,h1):" in text and "no dump from rank(s) 3" in text
    assert all(p.poll() is None for p in procs)  # SIGURG dumped the stacks and left every rank running
    # A second request reads only what the second signal appended: one dump per rank again.
    again = stacks.request(run, stacks.local_sender(run), [0, 1, 2], timeout_s=10)
    assert [len(d.threads) for d in again.dumps] == [len(d.threads) for d in rep.dumps]
    assert again.missing == [] and again.waited_s < 10


def test_the_watchdog_dumps_every_rank_before_it_cancels(ranks: tuple[Path, list[subprocess.Popen[str]]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain import slurmcommands as commands
    from hpctrain.fault.watchdog import Watchdog

    run, _ = ranks
    calls: list[str] = []

    def signal_steps(job: str, sig: str) -> None:  # what `scancel -s URG` does on the cluster
        calls.append(f"signal {job} {sig}")
        stacks.local_sender(run)()

    def scancel(ids: list[str]) -> None:
        dumped = json.loads((run / "stacks" / "watchdog-77.json").read_text())["dumped"]
        calls.append(f"cancel {ids} after dumps of {dumped}")

    monkeypatch.setattr(commands, "signal_steps", signal_steps)
    monkeypatch.setattr(commands, "scancel", scancel)
    dog = Watchdog(run, "77", timeout_s=1, world=3, stack_timeout_s=10)
    hang = WatchdogVerdict(event="hang", silent_ranks=(1,), message="no step", job_id="77", time=0.0)
    monkeypatch.setattr(dog, "check", lambda now=None: hang)
    monkeypatch.setattr(dog, "peer_check", lambda now=None: None)
    assert dog.run() is hang
    assert calls == ["signal 77 URG", "cancel ['77'] after dumps of [0, 1, 2]"]
    rec = json.loads((run / "stacks" / "watchdog-77.json").read_text())
    assert rec["missing"] == [] and rec["groups"][0]["label"] == "rank 1 (h0)"


def test_parse_dump_and_rank_ranges() -> None:
    text = ('Thread 0x00007f4f2bd776c0 (most recent call first):\n  File "/a.py", line 4 in <lambda>\n\n'
            'Current thread 0x00007f4f2c9bdb80 (most recent call first):\n  File "/a.py", line 5 in g\n'
            '  File "/a.py", line 6 in <module>\n')
    threads = rs.parse_dump(text)
    assert [t.current for t in threads] == [False, True]
    assert threads[1].frames == ('File "/a.py", line 5 in g', 'File "/a.py", line 6 in <module>')
    assert rs.rank_ranges([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"


def _beat(rank: int, host: str, compute: list[float], job: str = "9") -> dict[str, Any]:
    return {"rank": rank, "host": host, "compute_s": compute, "time": 100.0 + rank, "job": job, "restart": "0"}


def test_stragglers_need_a_persistent_gap() -> None:
    fast, slow = [0.10] * 20, [0.13] * 20  # 1.3x
    bs = [_beat(0, "n1", fast), _beat(1, "n1", fast), _beat(2, "n2", fast), _beat(3, "n2", slow)]
    v = stragglers.find(bs)
    assert v is not None and [s["rank"] for s in v["slow_ranks"]] == [3] and v["slow_hosts"] == []
    assert v["slow_ranks"][0]["ratio"] == 1.3 and v["median_s"] == 0.1 and v["window_steps"] == 20
    assert "rank 3 on n2 130 ms vs 100 ms (1.3x)" in (stragglers.describe(v) or "")
    bs[2] = _beat(2, "n2", slow)  # both ranks of n2 slow, half the job: the host is named
    v = stragglers.find(bs)
    assert v is not None and v["slow_hosts"] == ["n2"] and [s["rank"] for s in v["slow_ranks"]] == [2, 3]
    v = stragglers.find([_beat(0, "n1", fast), _beat(1, "n2", slow)])  # 2 ranks: against the other one
    assert v is not None and v["slow_ranks"][0]["ratio"] == 1.3 and v["slow_ranks"][0]["others_s"] == 0.1
    spike = [0.10] * 19 + [5.0]  # one long step (a GC pause, a checkpoint) names nobody
    assert stragglers.find([_beat(0, "n1", fast), _beat(1, "n2", spike)])["slow_ranks"] == []  # type: ignore[index]
    tiny = [0.001] * 20  # 2x, but 1 ms: jitter of tiny CPU steps
    assert stragglers.find([_beat(0, "n1", tiny), _beat(1, "n2", [0.002] * 20)])["slow_ranks"] == []  # type: ignore[index]
    assert stragglers.find([_beat(0, "n1", fast[:3]), _beat(1, "n2", slow[:3])]) is None  # too few steps
    old = {**_beat(5, "n9", [9.0] * 20, job="8"), "time": 50.0}  # an earlier job's rank file is left behind
    assert [b["rank"] for b in stragglers.newest_job_beats([*bs, old])] == [0, 1, 2, 3]


def test_rank_beat_measures_compute_until_the_collective(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.node.monitor import heartbeat

    clock = iter([10.0, 10.0, 10.5, 11.0, 11.25, 12.0])
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: next(clock))
    beat = heartbeat.RankBeat(tmp_path, rank=0)
    for step in (1, 2):  # as node/train._step: compute, then reduce before its all_reduce
        beat.set(step, "compute")
        beat.set(step, "reduce")
    beat.set(2, "checkpoint")
    assert list(beat.compute_s) == [0.5, 0.25]
    beat.dir.mkdir(parents=True)
    beat.write()
    rec = json.loads((beats.ranks_dir(tmp_path) / "rank-0.json").read_text())
    assert rec["compute_s"] == [0.5, 0.25] and "gpu_util" not in rec


def test_slow_fault_delays_every_step_from_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.node import faultinject

    slept: list[float] = []
    monkeypatch.setenv("HPCTRAIN_FAULT_INJECT", "slow:rank=1,step=2,s=0.25")
    monkeypatch.delenv("HPCTRAIN_RUN_DIR", raising=False)
    monkeypatch.setattr(faultinject.time, "sleep", slept.append)
    for step in range(1, 5):
        for rank in (0, 1):
            faultinject.inject("step", step, 0, rank)
    assert slept == [0.25, 0.25, 0.25]


def _metrics(run: Path, recs: list[dict[str, Any]]) -> None:
    RunFolder(run).metrics_dir.mkdir(parents=True, exist_ok=True)
    RunFolder(run).metrics_jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_progress_rate_and_eta_come_from_the_newest_attempt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.toml").write_text("[train]\nsteps = 100\n")
    first = [{"step": s, "time": 1000.0 + 10 * s, "loss": 5.0, "tokens_per_s": 10.0} for s in range(1, 31)]
    resumed = [{"step": s, "time": 5000.0 + 2 * s, "loss": 4.0 - s / 100, "tokens_per_s": 99.0} for s in range(25, 51)]
    _metrics(run, [*first, *resumed])
    ck = RunFolder(run).checkpoints_dir
    for step, complete in ((20, True), (40, True), (48, False)):
        (ck / f"step-{step}").mkdir(parents=True)
        if complete:
            (ck / f"step-{step}" / "hpctrain.json").write_text("{}")
    p = progress.read_progress(run)
    assert (p.step, p.total, p.checkpoint, p.tokens_per_s) == (50, 100, 40, 99.0)
    assert p.step_s == pytest.approx(2.0) and p.eta_s == pytest.approx(100.0)  # 50 steps left at 2 s each
    # Only the tail is read: a long file costs TAIL_BYTES, and a line cut by the seek is skipped.
    assert [r["step"] for r in progress.tail_records(RunFolder(run).metrics_jsonl, limit=200)][-1] == 50


def test_watch_prints_a_line_per_change_and_ends_with_the_job(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hpctrain.cli import watch
    from hpctrain.runs.registry import Attempt, Run

    rec = Run("r1", "r", "/nowhere", 0.0, "slurm", {}, "RUNNING", [Attempt("r1", 0, "55")])

    def snap(state: str, step: int | None, reason: str = "", deciding: str = "", now: float = 1000.0) -> watch.Snapshot:
        p = progress.Progress(step, 10, 3.2, 100.0, 1.0, None if step is None else 10.0 - step, None,
                              None if step is None else 1000.0)
        return watch.Snapshot(rec, p, state, reason, deciding, now=now)

    seq = iter([snap("PENDING", None, "Resources"), snap("PENDING", None, "Resources"), snap("RUNNING", 4),
                snap("RUNNING", 4, now=1029.0), snap("RUNNING", 4, now=1031.0), snap("RUNNING", 4, now=1059.0),
                snap("CANCELLED", 6, deciding="56"), snap("CANCELLED", 6, now=2000.0)])
    monkeypatch.setattr(watch, "snapshot", lambda reg, run_id: next(seq))
    monkeypatch.setattr(watch.time, "sleep", lambda s: None)
    end = watch._plain_loop(None, "r1", 1.0, as_json=False)  # type: ignore[arg-type]
    assert end.state == "CANCELLED" and end.ended
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5, lines  # the repeated looks printed nothing
    assert "state PENDING (Resources)" in lines[0] and "step -/10" in lines[0]
    assert "step 4/10 (40%) |" in lines[1] and "ETA 0:06 (1.00 s/step)" in lines[1] and "loss 3.2000" in lines[1]
    assert "step 4/10 (40%), no step for 30 s |" in lines[2]  # a stall shows in 30 s steps
    assert "supervisor job 56 is deciding" in lines[3] and "deciding" not in lines[4] and "no step" not in lines[4]


def test_the_rich_panel_shows_the_same_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from hpctrain.cli import watch
    from hpctrain.runs.registry import Attempt, Run

    rec = Run("r1", "r", "/nowhere", 0.0, "slurm", {}, "RUNNING", [Attempt("r1", 2, "55")])
    p = progress.Progress(25, 100, 2.5, 1234.0, 0.5, 37.5, 20, 1000.0)
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(watch._panel(watch.Snapshot(rec, p, "RUNNING", "", "",
                                                                                      now=1001.0)))
    text = out.getvalue()
    for want in ("hpctrain r1", "55 (attempt 2)", "25/100 (25%)", "2.5000", "1,234", "0:38 (0.50 s/step)", "step-20"):
        assert want in text, (want, text)


def test_the_eta_counts_the_current_attempts_steps_only_and_none_while_it_waits(tmp_path: Path) -> None:
    """A retry that resumes at the very step its predecessor stopped: no step goes down, so only the attempt's
    start (hpctrain.runs.history) keeps the queue's wait out of the rate (8.84 s/step against ~2 before)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.toml").write_text("[train]\nsteps = 100\n")
    first = [{"step": s, "time": 1000.0 + 2 * s} for s in range(1, 31)]
    retry = [{"step": s, "time": 5000.0 + 2 * (s - 30)} for s in range(31, 41)]
    _metrics(run, [*first, *retry])
    assert progress.read_progress(run).step_s > 8  # the wait between the attempts counted as training
    p = progress.read_progress(run, started=4990.0)
    assert p.step_s == pytest.approx(2.0) and p.eta_s == pytest.approx(120.0)
    _metrics(run, first)
    waiting = progress.read_progress(run, started=4990.0)  # the retry's ranks have no step yet
    assert (waiting.step, waiting.step_s, waiting.eta_s) == (30, None, None)
    assert progress.read_progress(run, waiting=True).eta_s is None  # queued


def test_the_watch_says_the_current_attempt_its_replaced_node_and_why_it_waits() -> None:
    from hpctrain.cli import watch
    from hpctrain.runs.history import AttemptView
    from hpctrain.runs.registry import Attempt, Run

    rec = Run("r1", "r", "/nowhere", 0.0, "slurm", {}, "RUNNING", [Attempt("r1", 0, "55")])
    p = progress.Progress(25, 100, 2.5, 1234.0, None, None, 20, 1000.0)
    cur = AttemptView(attempt=1, job_id="55", how="in_job", state="RUNNING", step_id="55.1",
                      replaced={"node2": "node4"})
    line = watch.Snapshot(rec, p, "RUNNING", "", "", now=1001.0, current=cur).line()
    assert "job step 55.1 (attempt 1)" in line and "nodes node2 replaced by the spare node4" in line, line
    assert "ETA -" in line
    queued = watch.Snapshot(rec, p, "PENDING", "Resources", "", now=1001.0,
                            waiting="not excluding node2: ...; SLURM will not place the job on a DOWN node").line()
    assert "state PENDING (Resources); waiting: not excluding node2" in queued, queued
