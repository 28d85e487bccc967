"""The checkpoint rules, defined once (hpctrain.runs.checkpoints): which checkpoints count, and which one a resume
starts from. The rule is tested once (property tests), then each caller once over the same damaged folders: the
node's trainer (find_resume), hpctrain.runtime (resume_from/resume_step), the collector (status's checkpoint) and
the supervisor (the step a retry resumes from) all give the rule's answer."""

from __future__ import annotations

import json
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.collect.metrics import complete_checkpoints
from hpctrain.collect.progress import read_progress
from hpctrain.fault.supervisor import latest_checkpoint
from hpctrain.node.checkpointing.checkpoint import find_resume
from hpctrain.node.runconf import NodeInputError
from hpctrain.runs import checkpoints as rc
from hpctrain.runs.folder import RunFolder

REFUSED = "refused"


def _folder(tmp_path: Path) -> RunFolder:
    run = RunFolder(tmp_path / "run")
    ck = run.checkpoints_dir
    for step, done in ((10, True), (20, True), (30, False)):  # step-30: a crash mid-save, no marker
        (ck / rc.step_tag(step)).mkdir(parents=True)
        if done:
            (ck / rc.step_tag(step) / rc.MARKER).write_text(json.dumps({"step": step, "files": {}}))
    (ck / ".tmp-step-40").mkdir()
    (ck / "universal-step-20").mkdir()
    (ck / rc.LATEST).write_text("step-20\n")
    return run


def test_one_rule_for_node_collector_and_supervisor(tmp_path: Path) -> None:
    run = _folder(tmp_path)
    assert rc.complete_steps(run.checkpoints_dir) == [10, 20]
    assert complete_checkpoints(run.checkpoints_dir) == [10, 20]
    assert latest_checkpoint(run.path) == 20
    assert rc.latest_tag(run.checkpoints_dir) == "step-20"
    assert find_resume(run.checkpoints_dir).tag == "step-20"  # type: ignore[union-attr]
    (run.checkpoints_dir / rc.LATEST).unlink()  # no pointer: the newest complete one, never step-30
    assert find_resume(run.checkpoints_dir).tag == "step-20"  # type: ignore[union-attr]


def test_no_checkpoints_folder_means_none(tmp_path: Path) -> None:
    assert rc.complete_steps(tmp_path / "missing") == [] and rc.latest_tag(tmp_path / "missing") is None
    assert rc.choose_resume(tmp_path / "missing") == rc.ResumeChoice(None)


# ------------------------------------------------------------------------------------------- the pure rule
def _expected(latest: str | None, marked: set[int], bad: set[int]) -> int | None:
    whole = marked - bad
    named = rc.STEP_RE.fullmatch(latest or "")
    if named and int(named.group(1)) in whole:
        return int(named.group(1))
    return max(whole) if whole else None


LATEST_TEXT = st.one_of(st.none(), st.integers(0, 12).map(rc.step_tag), st.text(max_size=12),
                        st.sampled_from(["../other/step-3", "/abs/step-3", "step-3/..", "step-03x"]))


@settings(max_examples=400, deadline=None)
@given(marked=st.sets(st.integers(0, 12)), bad=st.sets(st.integers(0, 12)), latest=LATEST_TEXT)
def test_the_rule_latest_when_whole_else_the_newest_whole(marked: set[int], bad: set[int], latest: str | None) -> None:
    asked: list[int] = []

    def problem(step: int) -> str | None:
        asked.append(step)
        return "torn" if step in bad else None

    step, skipped = rc.decide(latest, sorted(marked), problem)
    assert step == _expected(latest, marked, bad)
    assert step is None or step in marked and step not in bad  # only a marked, whole checkpoint
    assert len(asked) == len(set(asked)) and set(asked) <= marked  # each asked once, only marked ones
    assert step is not None or set(asked) == marked  # no answer only once every marked one was tried
    assert all(s in bad for s in asked if s != step)  # stops at the first whole one
    latest_bad = latest is not None and not (rc.STEP_RE.fullmatch(latest) and int(latest[5:]) in marked)
    assert len(skipped) == len([s for s in asked if s != step]) + latest_bad  # every pass-over has its reason


# ----------------------------------------------------------------------------------------- on a folder
STATES = ("whole", "partial", "torn", "bad-marker", "gone-elsewhere")


def _zip(path: Path, payload: bytes = b"x" * 64) -> None:
    with zipfile.ZipFile(path, "w") as z:  # a torch.save file's format: the rule reads its zip index
        z.writestr("data.pkl", payload)


def _make(ck: Path, step: int, state: str) -> None:
    """checkpoints/step-N in one of STATES: whole; partial (a crash mid-save: no marker); torn (a file shorter than
    its manifest says); bad-marker (unreadable JSON); gone-elsewhere (its marker names a folder outside the run
    that was removed)."""
    folder = ck / rc.step_tag(step)
    folder.mkdir(parents=True)
    _zip(folder / "mp_rank_00_model_states.pt")
    size = (folder / "mp_rank_00_model_states.pt").stat().st_size
    meta: dict[str, Any] = {"step": step, "files": {"mp_rank_00_model_states.pt": size}}
    if state == "partial":
        return
    if state == "torn":
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"PK")
    if state == "gone-elsewhere":
        meta["path"] = str(ck.parent.parent / "removed-elsewhere" / f"checkpoint-{step}")
    text = "{not json" if state == "bad-marker" else json.dumps(meta)
    (folder / rc.MARKER).write_text(text)


@settings(max_examples=60, deadline=None)
@given(states=st.dictionaries(st.integers(1, 6), st.sampled_from(STATES), max_size=5),
       latest=st.one_of(st.none(), st.integers(0, 7).map(rc.step_tag), st.just("../../elsewhere/step-3")))
def test_the_rule_on_real_folders(states: dict[int, str], latest: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(tmp) / "run" / "checkpoints"
        ck.mkdir(parents=True)
        for step, state in states.items():
            _make(ck, step, state)
        if latest is not None:
            (ck / rc.LATEST).write_text(latest + "\n")
        choice = rc.choose_resume(ck)
    marked = {s for s, state in states.items() if state != "partial"}
    bad = {s for s, state in states.items() if state != "whole"}
    assert choice.step == _expected(latest, marked, bad)
    assert (choice.refused is not None) == (bool(marked) and choice.step is None)


# ------------------------------------------------------------------------------------------- each caller
# name -> (checkpoint states, `latest` text, the answer: a step, None (start at 0) or REFUSED)
SCENARIOS: dict[str, tuple[dict[int, str], str | None, int | str | None]] = {
    "bad latest": ({10: "whole", 20: "whole"}, "step-30", 20),
    "latest names an older whole one": ({10: "whole", 20: "whole"}, "step-10", 10),
    "partial newest folder": ({10: "whole", 20: "partial"}, "step-10", 10),
    "torn newest, named by latest": ({10: "whole", 20: "torn"}, "step-20", 10),
    "no checkpoints": ({}, None, None),
    "latest pointing outside the run": ({10: "whole", 20: "whole"}, "../../other/checkpoints/step-30", 20),
    "marker pointing outside the run, folder gone": ({10: "whole", 20: "gone-elsewhere"}, "step-20", 10),
    "every marked one damaged": ({10: "torn", 20: "bad-marker"}, "step-20", REFUSED),
}


@pytest.fixture(params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RunFolder, int | str | None]]:
    states, latest, answer = SCENARIOS[request.param]
    run = RunFolder(tmp_path / "run")
    run.checkpoints_dir.mkdir(parents=True)
    other = tmp_path / "other" / "checkpoints"  # another run's whole step-30, which `latest` may point at
    _make(other, 30, "whole")
    for step, state in states.items():
        _make(run.checkpoints_dir, step, state)
    if latest is not None:
        (run.checkpoints_dir / rc.LATEST).write_text(latest + "\n")
    choice = rc.choose_resume(run.checkpoints_dir)
    assert (REFUSED if choice.refused else choice.step) == answer  # the rule's answer, then each caller's
    yield run, answer


def _answer(call: Callable[[], int | None], refusal: type[Exception]) -> int | str | None:
    try:
        return call()
    except refusal as exc:
        assert "Fix:" in str(exc)
        return REFUSED


def test_the_trainer_resumes_from_the_rules_answer(scenario: tuple[RunFolder, int | str | None]) -> None:
    run, answer = scenario

    def step() -> int | None:
        point = find_resume(run.checkpoints_dir)
        return point.step if point else None

    assert _answer(step, NodeInputError) == answer


def test_the_runtime_resumes_from_the_rules_answer(scenario: tuple[RunFolder, int | str | None],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain import runtime

    run, answer = scenario
    monkeypatch.setenv("HPCTRAIN_RUN_DIR", str(run.path))
    assert _answer(runtime.resume_step, rc.UnusableCheckpoints) == (0 if answer is None else answer)
    if isinstance(answer, int):
        assert runtime.resume_from() == run.checkpoints_dir / rc.step_tag(answer)


def test_the_collector_shows_the_rules_answer(scenario: tuple[RunFolder, int | str | None]) -> None:
    run, answer = scenario  # status shows where the next attempt resumes; nothing when the rule refuses
    assert read_progress(run.path, total=100).checkpoint == (None if answer == REFUSED else answer)


def test_the_supervisor_records_the_rules_answer(scenario: tuple[RunFolder, int | str | None]) -> None:
    run, answer = scenario  # the retry's resume point in attempts.jsonl and the policy's progress test
    assert latest_checkpoint(run.path) == (None if answer == REFUSED else answer)
