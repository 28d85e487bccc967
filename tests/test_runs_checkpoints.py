"""The complete-checkpoint rule, defined once (hpctrain.runs.checkpoints) and used by the node's resume, the
collector's summary and the supervisor's retry decision."""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.collect.metrics import complete_checkpoints
from hpctrain.fault.supervisor import latest_checkpoint
from hpctrain.node.checkpoint import find_resume
from hpctrain.runs import checkpoints as rc
from hpctrain.runs.folder import RunFolder


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
