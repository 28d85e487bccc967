"""examples/finetune-tiny.sh, the newcomer's fine-tune, runs as the README says: it makes a tiny model folder and
chat data here, fine-tunes it on the local executor (real DeepSpeed, 1 CPU rank), summarises, exports, and the
exported model answers the training questions with their pattern."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from runkit import hang_bound

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

REPO = Path(__file__).resolve().parents[1]


def test_the_tiny_finetune_example_learns_and_exports(tmp_path: Path) -> None:
    work = tmp_path / "work dir ü"  # a space and a non-ASCII letter in every path it makes
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(work / "runs"), "HPCTRAIN_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run(["bash", str(REPO / "examples" / "finetune-tiny.sh"), str(work)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=hang_bound(600),
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "COMPLETED" in proc.stdout
    (metrics,) = (work / "runs").glob("*/metrics/metrics.jsonl")
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert len(losses) == 120 and losses[-1] < losses[0] / 10, (losses[0], losses[-1])
    assert (work / "export" / "config.json").is_file() and (work / "export" / "chat_template.jinja").is_file()
    assert "Which animal says woof? -> Answer: dog." in proc.stdout, proc.stdout[-2000:]
    assert "What do bees make? -> Answer: honey." in proc.stdout, proc.stdout[-2000:]
