"""Real ranks (DeepSpeed on the CPU) that fail on purpose: the failure reaches events.jsonl, and the summary
names its class, rank and host from there after the rank logs are gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpctrain.collect import summary as collect
from hpctrain.runs import events
from runkit import make_run, torchrun

pytestmark = pytest.mark.deepspeed


def test_user_exception_on_one_rank_is_an_event_the_summary_reads(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", train={"steps": 6})
    proc = torchrun(run, 2, timeout=150, env={"HPCTRAIN_FAULT_INJECT": "raise:step=2,rank=1",
                                              "SLURMD_NODENAME": "nodeX"})
    assert proc.returncode != 0
    evs = events.read_events(run)
    assert [e.rank for e in evs if e.kind == events.START] == [0]
    fail = next(e for e in evs if e.kind == events.FAILURE and e.rank == 1)
    assert (fail.failure_class, fail.host, fail.attempt, fail.exit_code) == ("python_exception", "nodeX", 0, 1)
    assert fail.exception.startswith("ValueError: user code failed at step 2")
    assert any("raise ValueError" in ln for ln in fail.traceback)

    shutil.rmtree(run / "logs")  # the collector must not need them
    (run / "attempts.jsonl").write_text(json.dumps({"attempt": 0, "job_id": "", "state": "FAILED",
                                                    "exit_code": "1:0"}) + "\n")
    row = collect.build_run(collect.from_folder(run))["attempts"][0]
    assert row["failure_class"] == "python_exception", row["failure"]
    f = row["failure"]
    assert (f["rank"], f["host"], f["source"]) == (1, "nodeX", "events.jsonl")
    assert "user code failed at step 2" in f["exception"]


def test_bad_input_on_every_rank_is_one_input_error(tmp_path: Path) -> None:
    """A missing data file: every rank fails with one input error, told once on stderr (rank 0) and in each
    rank's log. (Also what test_node_train's bad data path test asserted, on the same job: merged.)"""
    run = make_run(tmp_path / "run", data={"source": str(tmp_path / "missing.jsonl")})
    proc = torchrun(run, 2, timeout=90)
    assert proc.returncode != 0
    assert proc.stderr.count("missing.jsonl': no such file or folder") == 1
    for r in (0, 1):
        assert "no such file" in (run / "logs" / f"attempt-0.rank-{r}.log").read_text()
    fails = [e for e in events.read_events(run) if e.kind == events.FAILURE]
    assert sorted(e.rank for e in fails) == [0, 1]
    assert {(e.failure_class, e.exit_code) for e in fails} == {("input_error", 2)}
    assert all("missing.jsonl" in e.message for e in fails)
