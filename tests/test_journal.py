"""hpctrain.runs.journal: the watchdog's verdicts as one typed record, written and read in one place; run folders
written before the type existed load unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.runs import journal
from hpctrain.runs.journal import WatchdogVerdict


def test_round_trip_and_old_lines(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    v = WatchdogVerdict(event="hang", time=5.0, job_id="7", attempt=0, last_step=4, silent_ranks=(1,),
                        silent_hosts=("node2",), message="no step", details=({"rank": 1, "why": "stale"},),
                        extra={"stale_s": 31.0})
    journal.write_verdict(tmp_path, v)
    old = [  # as the watchdog and the in-job driver wrote them before: plain dicts, keys of their own
        {"event": "peer_lost", "job_id": "8", "last_step": 20, "silent_ranks": [1], "silent_hosts": ["node3"],
         "detected_s": 4.2, "time": 9.0, "message": "lost its peer"},
        {"event": "unhealthy", "job_id": "8", "attempt": 1, "silent_hosts": ["node4"], "time": 10.0, "message": "x"},
        {"event": "straggler", "silent_hosts": ["node2"], "time": 11.0, "message": "slow", "in_job": "no spare"},
    ]
    with (tmp_path / "metrics" / "watchdog.jsonl").open("a") as f:
        f.write("".join(json.dumps(o) + "\n" for o in old) + '{"event": "hang", "ti')  # a torn last line
    got = journal.read_verdicts(tmp_path)
    assert got[0] == v and [g.event for g in got] == ["hang", "peer_lost", "unhealthy", "straggler"]
    assert got[1].silent_hosts == ("node3",) and got[1].extra == {"detected_s": 4.2} and got[1].blames_nodes
    assert got[3].extra["in_job"] == "no spare" and got[3].failure_class == "straggler" and not got[0].blames_nodes
    assert [g.event for g in journal.read_verdicts(tmp_path, job="8")] == ["peer_lost", "unhealthy"]
    assert got[1].to_json()["silent_ranks"] == [1]  # the shapes older readers expect: lists


def test_supervisor_notes_old_and_new() -> None:
    """The supervisor's copy in attempts.jsonl: written with its event now (a straggler stays one), read also
    when written without it (the key says hang or peer_lost)."""
    v = WatchdogVerdict(event="straggler", time=1.0, silent_hosts=("node2",), message="slow")
    assert journal.note_key(v) == "peer_lost"
    back = journal.from_note("peer_lost", v.note())
    assert back is not None and back.event == "straggler" and back.silent_hosts == ("node2",)
    old = journal.from_note("hang", {"last_step": 9, "silent_ranks": [1], "silent_hosts": ["node2"], "stale_s": 40})
    assert old is not None and old.event == "hang" and old.last_step == 9 and old.failure_class == "hang"
    assert journal.from_note("hang", None) is None


def test_decisions_and_armed_supervisors(tmp_path: Path) -> None:
    """attempts.jsonl: decision lines (the supervisor's, a person's) beside attempt rows and supervisor notes; a
    line written before the type (plain dict) loads; attempt rows are no decisions."""
    from hpctrain.runs.journal import SupervisorDecision

    rows = [{"attempt": 0, "job_id": "7", "state": "PENDING"},
            {"supervisor_job": "8", "supervises": "7", "time": 1.0},
            {"attempt": 0, "job_id": "7", "state": "FAILED", "failure_class": "node_fail", "checkpoint_step": 4,
             "decision": {"action": "retry", "reason": "node_fail", "exclude": ["node2"]}, "time": 2.0,
             "peer_lost": {"last_step": 4, "silent_ranks": [1], "silent_hosts": ["node2"], "message": "lost"},
             "next": {"attempt": 1, "job_id": "9", "supervisor": "10"}}]
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    journal.write_armed(tmp_path, "10", "9", 3.0)
    journal.write_decision(tmp_path, SupervisorDecision(
        job_id="9", checkpoint_step=None, decision={"action": "manual", "reason": "by hand"},
        next={"attempt": 2, "job_id": "11", "supervisor": None}))
    old, manual = journal.decisions(tmp_path)
    assert (old.job_id, old.action, old.attempt, old.checkpoint_step, old.next) == ("7", "retry", 0, 4, rows[2]["next"])
    assert old.verdict is not None and old.verdict.event == "peer_lost" and old.verdict.silent_hosts == ("node2",)
    assert SupervisorDecision.from_json(old.to_json()) == old
    assert manual.action == "manual" and manual.reason == "by hand" and manual.to_json()["checkpoint_step"] is None
    assert [d.job_id for d in journal.decisions(tmp_path, job="9")] == ["9"]
    assert journal.supervisors_of(tmp_path, "7") == ["8"] and journal.supervisors_of(tmp_path, "9") == ["10"]
