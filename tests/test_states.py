"""hpctrain.states: every SLURM state sacct can print maps to one state; final, retryable and exit-code decisions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain import states
from hpctrain.fault.policy import AttemptRecord, Fit, Policy, decide
from hpctrain.states import (
    ACTIVE_STATES,
    FINAL_STATES,
    RETRYABLE,
    RUN_ENDED_STATES,
    STOPPED_BY_PERSON,
    USER_ERRORS,
    ExitCode,
    FailureClass,
    JobState,
    normalize_state,
)

# `man sacct`, JOB STATE CODES (slurm 23.x/24.x), and the extra ones `man squeue` lists.
SACCT_STATES = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PENDING", "PREEMPTED", "RUNNING", "REQUEUED", "RESIZING", "REVOKED", "SUSPENDED", "TIMEOUT")
SQUEUE_STATES = ("CONFIGURING", "COMPLETING", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SIGNALING",
                 "SPECIAL_EXIT", "STAGE_OUT", "STOPPED", "UPDATE_DB", "POWER_UP_NODE")


@pytest.mark.parametrize("text", [*SACCT_STATES, *SQUEUE_STATES])
def test_every_state_slurm_prints_is_one_state(text: str) -> None:
    state = normalize_state(text)
    assert isinstance(state, JobState) and state == text
    kinds = [state in FINAL_STATES, state in ACTIVE_STATES, state == JobState.REQUEUED]
    assert kinds.count(True) == 1, (text, kinds)


@pytest.mark.parametrize("text, want", [("CANCELLED by 1000", JobState.CANCELLED),
                                        ("CANCELLED by 0", JobState.CANCELLED), ("COMPLETED+", JobState.COMPLETED),
                                        (" running ", JobState.RUNNING),
                                        ("", JobState.UNKNOWN), ("NODE_FAIL", JobState.NODE_FAIL)])
def test_sacct_variants_normalize(text: str, want: JobState) -> None:
    assert normalize_state(text) is want


def test_a_newer_slurms_word_is_kept_and_asked_about_again() -> None:
    assert normalize_state("FUTURE_STATE by 3") == "FUTURE_STATE"
    assert not states.is_final("FUTURE_STATE") and states.class_of_state("FUTURE_STATE") is None


def test_states_partition() -> None:
    every = set(JobState)
    assert ACTIVE_STATES | RUN_ENDED_STATES | {JobState.UNKNOWN} == every
    assert not ACTIVE_STATES & RUN_ENDED_STATES and JobState.UNKNOWN not in ACTIVE_STATES | RUN_ENDED_STATES
    assert {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "SUBMIT_FAILED"} == FINAL_STATES
    # A submission whose answer was lost may be queued: treated as active until reconciled.
    assert JobState.SUBMIT_UNKNOWN in ACTIVE_STATES


def test_requeued_job_is_not_final_but_its_ended_run_is(tmp_path: Path) -> None:
    """The decision where the registry's and the collector's copies disagreed."""
    from hpctrain.collect.summary import RunInput, cached
    from hpctrain.runs.registry import Attempt

    assert not states.is_final("REQUEUED") and states.run_ended("REQUEUED")
    assert not Attempt(run_id="r", attempt=0, job_id="1", state="REQUEUED").final
    assert Attempt(run_id="r", attempt=0, job_id="1", state="NODE_FAIL").final
    # A summary.json marked complete is not reused while the job is REQUEUED: it will run again.
    (tmp_path / "summary.json").write_text(json.dumps({"complete": True, "collector": "x", "attempts": [
        {"job_id": "1", "state": "REQUEUED"}]}))
    inp = RunInput("r", tmp_path, attempts=[{"attempt": 0, "job_id": "1", "state": "REQUEUED"}])
    assert cached(inp) is None


def test_on_disk_values_never_change() -> None:
    """summary.json, attempts.jsonl and the registry hold these strings: renaming one orphans old runs."""
    assert {c.value for c in FailureClass} == {
        "gpu_oom", "host_oom", "comm_timeout", "hang", "python_exception", "input_error", "container_error",
        "preflight", "node_fail", "straggler", "time_limit", "preempted", "cancelled", "unknown"}
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4]
    assert json.dumps([JobState.NODE_FAIL, FailureClass.GPU_OOM]) == '["NODE_FAIL", "gpu_oom"]'
    assert f"{JobState.TIMEOUT} {FailureClass.HANG}" == "TIMEOUT hang"


def test_summary_schema_knows_every_class() -> None:
    import hpctrain.collect

    text = (Path(hpctrain.collect.__file__).parent / "summary_schema.json").read_text()
    for cls in FailureClass:
        assert f'"{cls.value}"' in text, cls


def test_every_class_has_one_retry_verdict() -> None:
    for cls in FailureClass:
        verdicts = [cls in RETRYABLE, cls in USER_ERRORS, cls in STOPPED_BY_PERSON]
        assert verdicts.count(True) == 1, (cls, verdicts)
    assert states.is_retryable("node_fail") and states.is_retryable(FailureClass.UNKNOWN)
    assert not states.is_retryable("input_error") and not states.is_retryable(None)
    assert states.OUTSIDE_EVENTS <= RETRYABLE and states.IMPLICATES_HOST <= RETRYABLE


@pytest.mark.parametrize("state, cls", [("TIMEOUT", "time_limit"), ("DEADLINE", "time_limit"),
                                        ("PREEMPTED", "preempted"), ("NODE_FAIL", "node_fail"),
                                        ("BOOT_FAIL", "node_fail"), ("CANCELLED", "cancelled"),
                                        ("OUT_OF_MEMORY", "host_oom"), ("FAILED", "unknown"),
                                        ("COMPLETED", None), ("RUNNING", None), ("REQUEUED", None), (None, None)])
def test_class_of_state(state: str | None, cls: str | None) -> None:
    assert states.class_of_state(state) == cls


@pytest.mark.parametrize("code, status, cls", [("2:0", 2, "input_error"), ("4:0", 4, "preflight"),
                                               (2, 2, "input_error"), ("1:0", 1, None), ("0:9", 0, None),
                                               ("137:0", 137, None),
                                               ("", None, None), (None, None, None)])
def test_exit_codes(code: str | int | None, status: int | None, cls: str | None) -> None:
    assert states.exit_status(code) == status
    assert states.class_of_exit(code) == cls


def test_policy_reads_the_classes_from_states() -> None:
    """A pre-flight exit (4) with no log is retried as `preflight`; bad input (2) stops as a user error."""
    def rec(exit_code: str) -> AttemptRecord:
        return AttemptRecord(attempt=0, job_id="7", state="FAILED", failure_class="unknown", exit_code=exit_code)

    retry = decide([rec("4:0")], Policy(), Fit(1))
    assert retry.action == "retry" and retry.failure_class == "preflight"
    stop = decide([rec("2:0")], Policy(), Fit(1))
    assert stop.action == "stop" and stop.failure_class == "input_error"
