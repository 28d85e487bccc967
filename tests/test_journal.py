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


def test_in_job_restarts_and_health_checks_are_events_read_back_typed(tmp_path: Path) -> None:
    """Both travel in events.jsonl as events of their kind (restart, health); an event written before the types
    existed (extra keys only) reads back the same."""
    from hpctrain.runs import events as ev
    from hpctrain.runs.journal import HealthCheck, InJobRestart

    r = InJobRestart(time=5.0, job_id="7", attempt=0, host="node2", failure_class="node_fail", message="lost",
                     step_id="7.0", step_hosts=("node1", "node2"), next_step_id="7.1", next_attempt=1,
                     hosts=("node1", "node3"), replaced={"node2": "node3"}, restart=1, budget=2, detected=4.0,
                     stopped=4.5, first_error=3.9, job_hosts=("node1", "node2", "node3"), launched=5.0)
    h = HealthCheck(time=1.0, job_id="7", attempt=0, step_id="7.0", hosts=("node1", "node2", "node3"),
                    failed={"node2": "slow"}, train_hosts=("node1", "node3"), replaced={"node2": "node3"},
                    elapsed_s=12.5)
    (tmp_path / "events.jsonl").touch()
    ev.append_event(tmp_path, h.to_event())
    ev.append_event(tmp_path, r.to_event())
    old = {"time": 9.0, "kind": "restart", "job_id": "8", "attempt": 2, "host": "", "class": "hang", "message": "x",
           "step_id": "8.2", "next_step_id": "8.3", "next_attempt": 3, "hosts": ["node4"], "replaced": {}}
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write(json.dumps(old) + "\n")
    evs = ev.read_events(tmp_path)
    assert journal.health_checks(evs) == [h] and h.to_event().message == "node2: slow"
    got = journal.restarts(evs)
    assert got[0] == r
    assert (got[1].job_id, got[1].next_attempt, got[1].hosts, got[1].restart, got[1].detected) == \
        ("8", 3, ("node4",), 0, None)
