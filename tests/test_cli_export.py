"""`hpctrain export RUN`: a from_pretrained folder from the latest complete checkpoint, clear errors otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain.cli.main import cli
from runkit import make_run, torchrun


def test_unknown_run_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    res = CliRunner().invoke(cli, ["export", "no-such-run"])
    assert res.exit_code == 2 and "no-such-run" in res.output and "hpctrain list" in res.output


@pytest.mark.deepspeed
def test_export_writes_a_loadable_folder_and_refuses_a_run_without_checkpoint(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", train={"steps": 4}, checkpoint={"every_steps": 4, "export_hf": False})
    proc = torchrun(run, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "hf").exists()

    out = tmp_path / "exported"
    res = subprocess.run([sys.executable, "-m", "hpctrain", "export", str(run), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2  # llama-tiny

    empty = make_run(tmp_path / "empty")
    res = subprocess.run([sys.executable, "-m", "hpctrain", "export", str(empty)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "checkpoint" in res.stderr
