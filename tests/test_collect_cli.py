"""`hpctrain logs` / `hpctrain summary` through click's CliRunner, on hand-built run folders and a
temporary registry; a fake `sacct` on PATH counts its calls (one per refresh, none for finished runs)."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from hpctrain.cli import collect as cli_collect
from hpctrain.collect import summary as collect
from hpctrain.runs.registry import Attempt, Registry
from summary_schema import summary_errors

T0 = time.mktime(time.strptime("2026-11-29 10:00:00", "%Y-%m-%d %H:%M:%S"))
SPEC = """name = "t"\n[resources]\nnodes = 2\ngpus_per_node = {gpus}\ntasks_per_node = 2\ncpus_per_task = 1\n"""


def ts(sec: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + sec))


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A private registry and runs dir, and a fake sacct that logs each call and prints $FAKE_SACCT_OUT."""
    state, runs, bindir = tmp_path / "state", tmp_path / "runs", tmp_path / "bin"
    for d in (state, runs, bindir):
        d.mkdir()
    calls = tmp_path / "sacct.calls"
    fake = bindir / "sacct"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nif [ -n "$FAKE_SACCT_FAIL" ]; then echo "sacct: error: '
                    'Problem talking to the database: Connection refused" >&2; exit 1; fi\n'
                    'cat "$FAKE_SACCT_OUT" 2>/dev/null\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(state))
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(runs))
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "1")
    monkeypatch.setenv("HPCTRAIN_SLURM_BACKOFF_S", "0")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return {"runs": runs, "reg": Registry(), "calls": calls, "tmp": tmp_path}


def make_run(env: dict[str, Any], run_id: str, attempts: list[dict[str, Any]], *, gpus: int = 0,
             logs: dict[str, str] | None = None, metrics: list[dict[str, Any]] | None = None,
             ckpts: tuple[int, ...] = (), register: bool = True) -> Path:
    folder = env["runs"] / run_id
    for sub in ("logs", "metrics", "checkpoints", "submitit"):
        (folder / sub).mkdir(parents=True)
    (folder / "spec.toml").write_text(SPEC.format(gpus=gpus))
    for name, text in (logs or {}).items():
        (folder / name).write_text(text)
    if metrics:
        (folder / "metrics" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    for s in ckpts:
        (folder / "checkpoints" / f"step-{s}").mkdir()
        (folder / "checkpoints" / f"step-{s}" / "hpctrain.json").write_text("{}")
    with (folder / "attempts.jsonl").open("w") as fh:
        for a in attempts:
            fh.write(json.dumps({"executor": "slurm", **a}) + "\n")
    if register:
        reg: Registry = env["reg"]
        first, *rest = [Attempt(run_id=run_id, **a) for a in attempts]
        reg.add_submitted({"run_id": run_id, "name": "t", "folder": str(folder), "executor": "slurm",
                           "created": T0, "spec": {"nodes": 2, "gpus_per_node": gpus, "ranks_per_node": 2}}, first)
        for a in rest:
            reg.add_attempt(a)
    return folder


def metrics(steps: range, start: float, ckpt_every: int = 10) -> list[dict[str, Any]]:
    return [{"step": s, "loss": 10 - s / 10, "tokens_per_s": 2000.0, "tflops": 1.5, "mfu": 0.3, "ckpt_s":
             0.5 if s % ckpt_every == 0 else 0.0, "time": T0 + start + s} for s in steps]


def rank_log(rank: int, lines: list[tuple[float, str]]) -> str:
    return "".join(f"{ts(t)} rank{rank} INFO {msg}\n" if not msg.startswith(("Traceback", " ", "ValueError"))
                   else msg + "\n" for t, msg in lines)


TRACE = ["Traceback (most recent call last):", '  File "/x/train.py", line 310, in _fail_hook',
         '    raise ValueError("boom at step 7")', "ValueError: boom at step 7"]


def cli() -> click.Group:
    group = click.Group()
    cli_collect.register(group)
    return group


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli(), list(args), catch_exceptions=False)


def two_attempt_run(env: dict[str, Any]) -> Path:
    """Attempt 0 fails with a Python exception on rank 1 (node1, 2 ranks per node) at step 7 after a checkpoint at 5;
    attempt 1 resumes from 5 and completes at 20."""
    logs = {
        "logs/attempt-0.rank-0.log": rank_log(0, [(1, "hpctrain node: rank 0/4"), (6, "step 5"), (8, "stopping")]),
        "logs/attempt-0.rank-1.log": rank_log(1, [(1, "hpctrain node: rank 1/4"), (7.5, "training failed:")]
                                              + [(7.5, ln) for ln in TRACE]),
        "logs/attempt-1.rank-0.log": rank_log(0, [(100, "resumed from step-5"), (120, "done")]),
        "logs/attempt-1.rank-1.log": rank_log(1, [(101, "resumed from step-5")]),
    }
    mets = metrics(range(1, 8), 0, 5) + metrics(range(6, 21), 100, 5)
    return make_run(env, "twice-1", [
        {"attempt": 0, "job_id": "101", "state": "FAILED", "nodes": "node[1-2]", "started": T0, "ended": T0 + 9,
         "exit_code": "1:0"},
        {"attempt": 1, "job_id": "102", "state": "COMPLETED", "nodes": "node[3-4]", "started": T0 + 99,
         "ended": T0 + 121, "exit_code": "0:0"}], logs=logs, metrics=mets, ckpts=(5, 10, 15, 20))


def test_summary_json_two_attempts(env: dict[str, Any]) -> None:
    folder = two_attempt_run(env)
    res = invoke("summary", "twice-1", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert summary_errors(doc) == []
    run = doc["runs"][0]
    a0, a1 = run["attempts"]
    assert (a0["state"], a0["failure_class"], a0["failure"]["rank"], a0["failure"]["host"]) == \
        ("FAILED", "python_exception", 1, "node1")
    assert a0["failure"]["exception"] == "ValueError: boom at step 7"
    assert (a0["last_step"], a0["last_checkpoint_step"], a0["lost_steps"], a0["elapsed_s"]) == (7, 5, 2, 9)
    assert (a1["state"], a1["failure_class"], a1["first_step"], a1["last_step"], a1["lost_steps"]) == \
        ("COMPLETED", None, 6, 20, 0)
    assert a1["cpu_hours"] == pytest.approx(2 * 2 * 22 / 3600, abs=1e-5) and a1["gpu_hours"] == 0
    assert run["totals"]["attempts"] == 2 and run["totals"]["lost_steps"] == 2
    assert json.loads((folder / "summary.json").read_text())["run_id"] == "twice-1"
    assert not env["calls"].exists()  # every attempt final: sacct never asked
    assert Registry().get_run("twice-1").attempts[0].failure_class == "python_exception"


def test_schema_rejects_bad_documents() -> None:
    assert summary_errors({"schema_version": 1}) != []
    bad = {"schema_version": 1, "generated": 1.0, "runs": [{"run_id": 3}], "errors": [], "warnings": [], "x": 1}
    errs = summary_errors(bad)
    assert "$: Additional properties are not allowed ('x' was unexpected)" in errs
    assert "$.runs[0]: 'attempts' is a required property" in errs
    assert "$.runs[0].run_id: 3 is not of type 'string'" in errs


def test_cached_summary_is_reused(env: dict[str, Any]) -> None:
    folder = two_attempt_run(env)
    invoke("summary", "twice-1", "--json")
    (folder / "logs" / "attempt-0.rank-1.log").write_text("changed, but the run is final\n")
    doc = json.loads(invoke("summary", "twice-1", "--json").stdout)
    assert doc["runs"][0]["attempts"][0]["failure_class"] == "python_exception"


def test_summary_table_names_the_culprit(env: dict[str, Any]) -> None:
    two_attempt_run(env)
    res = invoke("summary", "twice-1")
    assert res.exit_code == 0
    assert "python_exception rank 1 on node1: ValueError: boom at step 7" in res.output
    assert "attempt-0.rank-1.log" in res.output and "COMPLETED" in res.output


def test_one_sacct_call_for_all_running_jobs(env: dict[str, Any]) -> None:
    for i in range(3):
        make_run(env, f"live-{i}", [{"attempt": 0, "job_id": str(200 + i), "state": "RUNNING", "nodes": "node1"}])
    make_run(env, "old", [{"attempt": 0, "job_id": "150", "state": "COMPLETED", "nodes": "node1",
                           "started": T0, "ended": T0 + 5}])
    out = env["tmp"] / "sacct.out"
    out.write_text("".join(f"{200 + i}|{'TIMEOUT' if i == 0 else 'RUNNING'}|0:0|node1|2026-11-29T10:00:00|"
                           f"{'2026-11-29T10:30:00' if i == 0 else 'Unknown'}\n" for i in range(3)))
    os.environ["FAKE_SACCT_OUT"] = str(out)
    try:
        doc = json.loads(invoke("summary", "--all", "--json").stdout)
    finally:
        del os.environ["FAKE_SACCT_OUT"]
    calls = env["calls"].read_text().splitlines()
    assert len(calls) == 1 and "200,201,202" in calls[0] and "150" not in calls[0]
    states = {r["run_id"]: (r["state"], r["failure_class"]) for r in doc["runs"]}
    assert states["live-0"] == ("TIMEOUT", "time_limit") and states["live-1"][0] == "RUNNING"
    invoke("summary", "live-0", "--json")  # now final in the registry: no new sacct call
    assert len(env["calls"].read_text().splitlines()) == 1


def test_sacct_down_gives_best_summary(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(env, "live", [{"attempt": 0, "job_id": "300", "state": "RUNNING", "nodes": "node1", "started": T0}],
             metrics=metrics(range(1, 4), 0))
    monkeypatch.setenv("FAKE_SACCT_FAIL", "1")
    res = invoke("summary", "live", "--json")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert any("stale" in w for w in doc["warnings"]) and doc["runs"][0]["attempts"][0]["last_step"] == 3
    assert summary_errors(doc) == []


def test_unknown_run_and_vanished_folder(env: dict[str, Any]) -> None:
    folder = two_attempt_run(env)
    import shutil

    shutil.rmtree(folder)
    res = CliRunner().invoke(cli(), ["summary", "twice-1", "nosuchrun", "--json"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    doc = json.loads(res.stdout)
    run = doc["runs"][0]
    assert run["folder_exists"] is False and any("missing" in w for w in run["warnings"])
    assert [a["state"] for a in run["attempts"]] == ["FAILED", "COMPLETED"]
    assert "nosuchrun" in doc["errors"][0] and "hpctrain list" in doc["errors"][0]
    assert "empty run id" in CliRunner().invoke(cli(), ["summary", ""]).output
    res = CliRunner().invoke(cli(), ["summary", "nosuchrun"])
    assert res.exit_code == 2 and "no such run" in res.output
    res = CliRunner().invoke(cli(), ["logs", "nosuchrun"])
    assert res.exit_code == 2 and "no such run" in res.output and "Traceback" not in res.output


def test_folder_path_not_in_registry(env: dict[str, Any]) -> None:
    folder = make_run(env, "loose", [{"attempt": 0, "job_id": "9", "state": "NODE_FAIL", "nodes": "node[1-2]",
                                      "started": T0, "ended": T0 + 60}], register=False,
                      logs={"logs/attempt-0.rank-0.log": rank_log(0, [(1, "a"), (50, "b")]),
                            "logs/attempt-0.rank-2.log": rank_log(2, [(1, "a"), (10, "b")])})
    doc = json.loads(invoke("summary", str(folder), "--json").stdout)
    a0 = doc["runs"][0]["attempts"][0]
    assert (a0["state"], a0["failure_class"], a0["failure"]["host"]) == ("NODE_FAIL", "node_fail", "node2")


def test_hang_detected_from_stale_metrics(env: dict[str, Any]) -> None:
    make_run(env, "hung", [{"attempt": 0, "job_id": "5", "state": "CANCELLED", "nodes": "node1", "started": T0,
                            "ended": T0 + 4000}], metrics=metrics(range(1, 10), 0))
    doc = json.loads(invoke("summary", "hung", "--json").stdout)
    a0 = doc["runs"][0]["attempts"][0]
    assert a0["failure_class"] == "hang" and "no step for" in a0["failure"]["message"]


def test_logs_merged_and_tagged(env: dict[str, Any]) -> None:
    two_attempt_run(env)
    out = invoke("logs", "twice-1").output.splitlines()
    assert out[0].startswith("a0 r0 node1 | ") and "rank 0/4" in out[0]
    assert out[1].startswith("a0 r1 node1 | ")  # ranks 0,1 on node1 (2 per node)
    i = next(i for i, ln in enumerate(out) if "training failed" in ln)
    assert out[i + 1].endswith("Traceback (most recent call last):")  # untimestamped lines stay with their line
    assert out[-1].startswith("a1 r0 node3 | ") and out[-1].endswith("done")
    assert [ln for ln in out if "stopping" in ln] == [out[i + 5]]  # 8 s comes after 7.5 s
    only = invoke("logs", "twice-1", "--attempt", "1", "--rank", "1").output.splitlines()
    assert len(only) == 1 and only[0].startswith("a1 r1 node3")
    grep = invoke("logs", "twice-1", "--grep", r"ValueError|resumed").output.splitlines()
    assert len(grep) == 4  # the raise line, the exception, two resumes
    assert invoke("logs", "twice-1", "--host", "node3").output.count("\n") == 3
    res = CliRunner().invoke(cli(), ["logs", "twice-1", "--grep", "(unclosed"])
    assert res.exit_code == 2 and "--grep" in res.output


def test_logs_fall_back_to_submitit(env: dict[str, Any]) -> None:
    err = ("submitit INFO (2026-11-29 10:00:01,000) - Starting with JobEnvironment(job_id=77, hostname=node4, "
           "local_rank=0(1), node=0(1), global_rank=0(1))\nFATAL:   could not open image /x.sif\n")
    make_run(env, "noimg", [{"attempt": 0, "job_id": "77", "state": "FAILED", "nodes": "node4", "exit_code": "255:0",
                             "started": T0, "ended": T0 + 2}], logs={"submitit/77_0_log.out": err})
    out = invoke("logs", "noimg").output
    assert "a0 r0 node4 | FATAL:   could not open image" in out
    doc = json.loads(invoke("summary", "noimg", "--json").stdout)
    assert doc["runs"][0]["attempts"][0]["failure"]["host"] == "node4"
    assert doc["runs"][0]["failure_class"] == "container_error"


def test_logs_follow_stops_at_job_end(env: dict[str, Any]) -> None:
    from hpctrain.collect import logs as cl

    folder = two_attempt_run(env)
    seen: list[str] = []
    files = cl.rank_log_files(folder / "logs")
    cl.follow(lambda: files, lambda f: "h", cl.LogFilter(attempt=1), lambda: True,
              lambda ln: seen.append(ln.text), poll_s=0.01, max_s=5)
    assert len(seen) == 3


def test_plot_is_png(env: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    two_attempt_run(env)
    out = env["tmp"] / "p.png"
    res = invoke("summary", "twice-1", "--plot", str(out))
    assert res.exit_code == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"matplotlib" in data[:4096]


def test_plot_without_matplotlib(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_mpl(name: str, *a: Any, **k: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    two_attempt_run(env)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    res = CliRunner().invoke(cli(), ["summary", "twice-1", "--plot", str(env["tmp"] / "p.png")])
    assert res.exit_code == 1 and "pip install 'hpctrain[plot]'" in res.output


def test_build_run_directly_without_registry(env: dict[str, Any]) -> None:
    folder = two_attempt_run(env)
    rec = collect.build_run(collect.from_folder(folder))
    assert summary_errors({"schema_version": 1, "generated": 0.0, "runs": [rec], "errors": [],
                                    "warnings": []}) == []


def test_cli_import_stays_light() -> None:
    import subprocess
    import sys

    code = ("import sys, hpctrain.cli.collect, hpctrain.collect.summary; "
            "print([m for m in ('rich','matplotlib','torch','submitit') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_requeued_job_gets_one_row_per_run(env: dict[str, Any]) -> None:
    """SLURM requeued job 77 after node4 died: logs/attempt-1.* appear under the same job id. The
    first run is REQUEUED (node_fail, node4), judged by its own rank logs only; the shared submitit
    log is cut at the second run's start."""
    peer = ("RuntimeError: [pair.cc:553] Connection closed by peer [node4]:30955. This is typically caused by a "
            "remote worker crashing.")
    logs = {
        "logs/attempt-0.rank-0.log": rank_log(0, [(1, "hpctrain node: rank 0/2"), (5, "step 1"),
                                                  (40, "training failed:")]) + "Traceback (most recent call last):\n"
                                                  "  File \"/x.py\", line 1, in f\n" + peer + "\n",
        "logs/attempt-0.rank-2.log": rank_log(2, [(1, "hpctrain node: rank 2/2"), (5, "step 1")]),
        "logs/attempt-1.rank-0.log": rank_log(0, [(100, "resumed"), (110, "done")]),
        "logs/attempt-1.rank-2.log": rank_log(2, [(100, "resumed"), (110, "done")]),
        "submitit/77_0_log.err": f"[W{time.strftime('%m%d %H:%M:%S', time.localtime(T0 + 2))}.1 socket.cpp:207] x\n"
                                 + peer + "\n"
                                 f"[W{time.strftime('%m%d %H:%M:%S', time.localtime(T0 + 101))}.1 socket.cpp:207] y\n",
    }
    make_run(env, "requeued", [{"attempt": 0, "job_id": "77", "state": "COMPLETED", "nodes": "node[3-4]",
                                "started": T0 + 99, "ended": T0 + 111, "exit_code": "0:0"}], logs=logs)
    doc = json.loads(invoke("summary", "requeued", "--json").stdout)
    assert summary_errors(doc) == []
    a0, a1 = doc["runs"][0]["attempts"]
    assert (a0["attempt"], a0["job_id"], a0["state"], a0["failure_class"]) == (0, "77", "REQUEUED", "node_fail")
    assert a0["failure"]["host"] == "node4" and a0["start"] == T0 + 1 and a0["end"] == T0 + 40
    assert (a1["attempt"], a1["job_id"], a1["state"], a1["failure_class"]) == (1, "77", "COMPLETED", None)
    assert not any(lg.startswith("submitit/") for lg in a0["logs"])
    # the registry's attempt 0 is the job's LAST run (COMPLETED): the REQUEUED row must not overwrite it
    assert Registry().get_run("requeued").attempts[0].failure_class is None


def test_each_run_of_a_requeued_job_has_its_own_hosts_and_times(env: dict[str, Any]) -> None:
    """SLURM ran job 78 on node1+node4, requeued it, and ran it again on node[2-3] (sacct -D: two records, as the
    job-state refresh wrote them to attempts.jsonl): the first run keeps its own hosts, start, end and state in
    summary and status, not the last run's."""
    from hpctrain.cli import runs as cli_runs

    logs = {f"logs/attempt-{k}.rank-0.log": rank_log(0, [(t, "hpctrain node: rank 0/2"), (t + 5, "step 1")])
            for k, t in ((0, 3), (1, 60))}
    last = {"attempt": 0, "job_id": "78", "state": "COMPLETED", "nodes": "node[2-3]", "started": T0 + 58,
            "ended": T0 + 70, "exit_code": "0:0"}
    folder = make_run(env, "own-hosts", [last], logs=logs)
    runs = [{"state": "REQUEUED", "exit_code": "0:0", "nodelist": "node[1,4]", "start": T0 + 2, "end": T0 + 41},
            {"state": "COMPLETED", "exit_code": "0:0", "nodelist": "node[2-3]", "start": T0 + 58, "end": T0 + 70}]
    with (folder / "attempts.jsonl").open("a") as fh:
        fh.write(json.dumps({"attempt": 0, "job_id": "78", "sacct_runs": runs}) + "\n")
    rows = json.loads(invoke("summary", "own-hosts", "--json").stdout)["runs"][0]["attempts"]
    got = [(r["attempt"], r["how"], r["state"], r["hosts"], r["start"], r["end"], r["allocated_nodes"]) for r in rows]
    assert got == [(0, "submitted", "REQUEUED", ["node1", "node4"], T0 + 2, T0 + 41, 2),
                   (1, "requeued", "COMPLETED", ["node2", "node3"], T0 + 58, T0 + 70, 2)]
    group = click.Group()
    cli_runs.register(group)
    st = json.loads(CliRunner().invoke(group, ["status", "own-hosts", "--json"]).stdout)
    assert [(h["attempt"], h["state"], h["hosts"], h["started"]) for h in st["history"]] == [
        (0, "REQUEUED", ["node1", "node4"], T0 + 2), (1, "COMPLETED", ["node2", "node3"], T0 + 58)]


def test_update_folder_summary_from_the_node(env: dict[str, Any]) -> None:
    folder = make_run(env, "onnode", [{"attempt": 0, "job_id": "5", "state": "PENDING", "nodes": "node1"}],
                      register=False, metrics=metrics(range(1, 4), 0))
    collect.update_folder_summary(folder, running=True)
    rec = json.loads((folder / "summary.json").read_text())
    assert rec["state"] == "RUNNING" and rec["attempts"][0]["last_step"] == 3 and not rec["complete"]
    collect.update_folder_summary(env["tmp"] / "gone")  # never raises


def test_requeues_of_an_earlier_job_and_a_resubmission(env: dict[str, Any]) -> None:
    """Job 50 ran as attempts 0,1 (submitit requeued it on the time limit), then the supervisor
    resubmitted as attempt 2 (job 51, HPCTRAIN_ATTEMPT=2) which is still running."""
    stop = "signal 12: checkpointed at step {}, stopping for requeue"
    logs = {f"logs/attempt-{k}.rank-0.log": rank_log(0, [(t, "hpctrain node: rank 0/2"), (t + 5, stop.format(s))])
            for k, t, s in ((0, 1, 5), (1, 20, 9), (2, 40, 12))}
    folder = make_run(env, "resub", [
        {"attempt": 0, "job_id": "50", "state": "FAILED", "nodes": "node1", "started": T0 + 20, "ended": T0 + 26,
         "exit_code": "3:0"},
        {"attempt": 2, "job_id": "51", "state": "PENDING", "nodes": ""}], logs=logs,
        metrics=metrics(range(1, 6), 0) + metrics(range(6, 10), 20) + metrics(range(10, 13), 40))
    doc = json.loads(invoke("summary", "resub", "--json").stdout)
    assert summary_errors(doc) == []
    rows = doc["runs"][0]["attempts"]
    assert [(r["attempt"], r["job_id"], r["state"]) for r in rows] == \
        [(0, "50", "REQUEUED"), (1, "50", "FAILED"), (2, "51", "PENDING")]
    assert [r["failure_class"] for r in rows[:2]] == ["time_limit", "time_limit"]
    assert [r["last_step"] for r in rows] == [5, 9, 12] and rows[2]["start"] == T0 + 40
    assert folder.is_dir()


def in_job_restart_run(env: dict[str, Any]) -> Path:
    """Job 60 on node1,node2 with node3 as its spare (2 nodes x 2 ranks): node2 died at step 25 (the watchdog's
    peer-lost verdict names attempt 0), the in-job driver started step 60.1 on node1,node3 from step-20, which is
    still running. SLURM resized the job meanwhile: sacct's start is the resize time (T0 + 35), and its node list
    lacks node2."""
    from hpctrain.runs import events as ev

    peer = "RuntimeError: [pair.cc:553] Connection closed by peer [node2]:30955"
    logs = {f"logs/attempt-{k}.rank-{r}.log": rank_log(r, [(t, f"hpctrain node: rank {r}/4")])
            for k, t in ((0, 1), (1, 40)) for r in (0, 2)}
    # rank 0 (node1) blames its healthy ring neighbour on node1 itself: a consequence of node2's loss
    logs["logs/attempt-0.rank-0.log"] += rank_log(0, [(29, "ERROR training failed:")]) + \
        "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.1]:30955\n"
    stamp = time.strftime('%m%d %H:%M:%S', time.localtime(T0 + 29))
    logs["submitit/60_0_log.err"] = f"[W{stamp}.1 x.cpp:1] y\n{peer}\n"
    folder = make_run(env, "spare", [{"attempt": 0, "job_id": "60", "state": "RUNNING", "nodes": "node[1,3]",
                                      "started": T0 + 35}], logs=logs,
                      metrics=metrics(range(1, 26), 1) + metrics(range(21, 31), 20))
    (folder / "spec.toml").write_text(SPEC.format(gpus=0) + "spare_nodes = 1\n")
    with (folder / "attempts.jsonl").open("a") as fh:
        fh.write(json.dumps({"attempt": 1, "job_id": "60", "step_id": "60.1", "in_job_restart_of": 1}) + "\n")
    (folder / "metrics" / "watchdog.jsonl").write_text(json.dumps(
        {"event": "peer_lost", "job_id": "60", "attempt": 0, "silent_ranks": [2, 3], "silent_hosts": ["node2"],
         "message": "rank 0 lost its peers on node2"}) + "\n")
    for k, t, hosts in ((0, 1, ("node1", "node2")), (1, 40, ("node1", "node3"))):
        for r in (0, 1, 2, 3):
            ev.append_event(folder, ev.Event(kind=ev.START, time=T0 + t, rank=r, host=hosts[r // 2], job_id="60",
                                             attempt=k))
    ev.append_event(folder, ev.Event(kind=ev.RESTART, time=T0 + 32, host="node2", job_id="60", attempt=0,
                                     failure_class="node_fail", message="node2 went away", extra={
                                         "step_id": "60.0", "step_hosts": ["node1", "node2"], "next_step_id": "60.1",
                                         "next_attempt": 1, "replaced": {"node2": "node3"}, "hosts": ["node1", "node3"],
                                         "restart": 1, "budget": 1, "detected": T0 + 30, "stopped": T0 + 31,
                                         "launched": T0 + 32}))
    return folder


def test_an_in_job_restart_is_one_more_attempt_in_summary_and_logs(env: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """summary and logs read the attempts of hpctrain.runs.history: the running replacement carries no failure,
    the dead node's verdict stays on attempt 0, the spare is paid for, the redone steps are lost work, each rank's
    logs have the host it ran on (`--host` finds them), and the start is the job's, not the resize time."""
    in_job_restart_run(env)
    with monkeypatch.context() as m:
        m.setattr(collect.time, "time", lambda: T0 + 60)  # a few seconds after the replacement's last step
        doc = json.loads(invoke("summary", "spare", "--json").stdout)
    assert summary_errors(doc) == []
    a0, a1 = doc["runs"][0]["attempts"]
    assert (a0["state"], a0["failure_class"], a0["failure"]["host"], a0["how"]) == ("REQUEUED", "node_fail", "node2",
                                                                                    "submitted")
    assert (a1["state"], a1["failure_class"], a1["how"], a1["replaced"]) == ("RUNNING", None, "in_job",
                                                                             {"node2": "node3"})
    assert (a0["lost_steps"], a0["lost_from"]) == (5, "redone") and a0["start"] == T0 + 1
    assert a1["allocated_nodes"] == 3 and a1["nodes"] == 2
    assert a1["spare_hours"] == pytest.approx(a1["cpu_hours"] / 3, abs=1e-5)
    assert a0["cpu_hours"] == pytest.approx(3 * 2 * (30 - 1) / 3600, abs=1e-5)

    table = invoke("summary", "spare").stdout
    assert "spare a1 (step 60.1): node2 replaced by the spare node3" in table
    assert re.search(r"spare cost: [\d.]+ CPU-hours, of which [\d.]+ on idle spare nodes", table), table

    on3 = invoke("logs", "spare", "--host", "node3").stdout.splitlines()
    assert on3 and all(ln.startswith(("a1 r2 node3", "a1 r3 node3")) for ln in on3), on3
    a0_log = invoke("logs", "spare", "--attempt", "0").stdout.splitlines()
    assert any(ln.startswith("a0 r2 node2") for ln in a0_log)
    # the journal says which node was lost, before the survivor's peer error, which it marks as a consequence
    said = next(i for i, ln in enumerate(a0_log) if ln.startswith("a0 -- journal | node2 lost at "))
    assert "(in-job restart 1: node3 took node2's place)" in a0_log[said]
    blamed = next(i for i, ln in enumerate(a0_log) if "Connection closed by peer [10.0.0.1]" in ln)
    assert said < blamed and a0_log[blamed].endswith("<- a consequence of node2's loss"), a0_log
    assert sum("<- a consequence" in ln for ln in a0_log) == 1 and sum("journal" in ln for ln in a0_log) == 1
    import hpctrain

    assert hpctrain.Run("spare").logs(attempt=0) == a0_log  # the API's logs() is what `hpctrain logs` prints


def test_why_a_retry_waits_is_in_the_table_not_only_the_json(env: dict[str, Any]) -> None:
    note = ("not excluding node2: the partition has 2 node(s) and the run needs 2; SLURM will not place the job on a "
            "DOWN node, so it waits for the node to return or for capacity")
    folder = make_run(env, "waits", [
        {"attempt": 0, "job_id": "70", "state": "NODE_FAIL", "nodes": "node[1-2]", "started": T0, "ended": T0 + 9},
        {"attempt": 1, "job_id": "71", "state": "PENDING", "nodes": ""}])
    with (folder / "attempts.jsonl").open("a") as fh:
        fh.write(json.dumps({"attempt": 0, "job_id": "70", "decision": {"action": "retry", "notes": [note],
                                                                        "not_excluded": ["node2"]},
                             "next": {"attempt": 1, "job_id": "71"}}) + "\n")
    doc = json.loads(invoke("summary", "waits", "--json").stdout)
    assert summary_errors(doc) == [] and doc["runs"][0]["waiting_because"] == note
    assert f"waits waiting: {note}" in invoke("summary", "waits").stdout


def test_status_and_list_count_an_in_job_restart_as_summary_does(env: dict[str, Any]) -> None:
    """status and list read hpctrain.runs.history as summary does: two attempts (the job and its step 60.1), each
    with its own hosts, the spare that replaced node2, and attempt 0's start is the job's (not SLURM's resize)."""
    from hpctrain.cli import runs as cli_runs

    in_job_restart_run(env)
    group = click.Group()
    cli_runs.register(group)
    out = CliRunner().invoke(group, ["status", "spare"], catch_exceptions=False).stdout
    rows = [ln.split() for ln in out.splitlines() if ln[:1].isdigit()]
    assert [r[:4] for r in rows] == [["0", "60", "submitted", "REQUEUED"], ["1", "60.1", "in-job", "RUNNING"]], out
    assert rows[0][4] == "node1,node2" and rows[1][4] == "node1,node3" and rows[0][-1] == "node_fail", out
    assert "attempt 1: node2 replaced by the spare node3 (step 60.1)" in out
    status = json.loads(CliRunner().invoke(group, ["status", "spare", "--json"]).stdout)
    assert [h["started"] for h in status["history"]] == [T0 + 1, T0 + 32]
    assert status["history"][1]["rank_hosts"] == {"0": "node1", "1": "node1", "2": "node3", "3": "node3"}
    listed = CliRunner().invoke(group, ["list"], catch_exceptions=False).stdout.splitlines()
    assert listed[1].split()[3] == "2", listed
    assert json.loads(CliRunner().invoke(group, ["list", "--json"]).stdout)[0]["attempt_count"] == 2


def test_a_requeue_is_one_more_attempt_in_status_and_list_too(env: dict[str, Any]) -> None:
    """SLURM requeued job 80 (logs/attempt-1.*): status and list count two attempts, as summary does."""
    from hpctrain.cli import runs as cli_runs

    logs = {f"logs/attempt-{k}.rank-0.log": rank_log(0, [(t, "hpctrain node: rank 0/2")]) for k, t in ((0, 1), (1, 50))}
    make_run(env, "requeue2", [{"attempt": 0, "job_id": "80", "state": "COMPLETED", "nodes": "node1",
                                "started": T0 + 49, "ended": T0 + 60, "exit_code": "0:0"}], logs=logs)
    rows = json.loads(invoke("summary", "requeue2", "--json").stdout)["runs"][0]["attempts"]
    assert [(r["attempt"], r["how"], r["state"]) for r in rows] == [(0, "submitted", "REQUEUED"),
                                                                    (1, "requeued", "COMPLETED")]
    group = click.Group()
    cli_runs.register(group)
    st = json.loads(CliRunner().invoke(group, ["status", "requeue2", "--json"]).stdout)
    assert [(h["attempt"], h["how"], h["state"]) for h in st["history"]] == [(0, "submitted", "REQUEUED"),
                                                                            (1, "requeued", "COMPLETED")]
    assert json.loads(CliRunner().invoke(group, ["list", "--json"]).stdout)[0]["attempt_count"] == 2


def test_a_script_that_never_resumes_lost_every_step_it_redid(env: dict[str, Any]) -> None:
    """A user's script checkpointed on the preemption signal but its rerun started again from step 1: the 57
    steps it redid are lost (was 0, from the checkpoint's existence), and the stop no longer says "resumable"."""
    stop = {"kind": "stop", "time": T0 + 60, "rank": 0, "host": "node1", "job_id": "90", "attempt": 0,
            "class": "preempted", "signal": 15, "checkpointed": True,
            "message": "signal 15: checkpointed at step 57, stopping for requeue"}
    folder = make_run(env, "noresume", [
        {"attempt": 0, "job_id": "90", "state": "PREEMPTED", "nodes": "node1", "started": T0, "ended": T0 + 61},
        {"attempt": 1, "job_id": "91", "state": "COMPLETED", "nodes": "node2", "started": T0 + 100,
         "ended": T0 + 170, "exit_code": "0:0"}],
        metrics=metrics(range(1, 58), 0, 1000) + metrics(range(1, 61), 100, 1000), ckpts=(57,))
    (folder / "events.jsonl").write_text(json.dumps(stop) + "\n")
    a0, a1 = json.loads(invoke("summary", "noresume", "--json").stdout)["runs"][0]["attempts"]
    assert (a0["lost_steps"], a0["lost_from"], a1["lost_steps"]) == (57, "redone", 0), a0
    assert "resumable" not in a0["failure"]["message"] and "started again from step 1" in a0["failure"]["message"]
