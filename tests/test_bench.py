"""bench/gpu_suite.py, the GPU benchmarks' driver: which runs a device call makes and in what order, its
tables, and one real call on the CPU (a tiny model through bench/node_gpu.py and the node entrypoint)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_suite as G


def test_every_call_names_known_cases_and_variants() -> None:
    for call, tokens in G.CALLS.items():
        runs = G.expand(tokens, 0)
        assert runs, call
        for name, variant, _ in runs:
            assert variant in G.CASES[name].variants, (call, name, variant)


def test_rounds_alternate_and_rotate() -> None:
    case = G.CASES["8b-plan"]
    assert G.schedule(case, 3) == [("entry", 0), ("plain", 0), ("plain", 1), ("entry", 1), ("entry", 2),
                                   ("plain", 2)]
    # Single runs count their own rounds: the second "entry" of a call is round 1.
    assert G.expand(["8b-plan:entry", "8b-plan:plain", "8b-plan:entry"], 0) == [
        ("8b-plan", "entry", 0), ("8b-plan", "plain", 0), ("8b-plan", "entry", 1)]
    with pytest.raises(SystemExit, match="has the variants"):
        G.expand(["8b-plan:nope"], 0)


def _row(variant: str, rnd: int, step: float, rc: int = 0) -> dict[str, object]:
    if rc:
        return {"case": "8b-plan", "variant": variant, "round": rnd, "rc": rc, "results": [], "table": [],
                "error_tail": "RuntimeError: CUDA out of memory"}
    fig = {"step_s": step, "tokens_per_s_per_gpu": 65536 / step, "model_tflops_per_gpu": 3.4e15 / step / 1e12,
           "gpu_peak_gb": 129.4, "host_peak_gb": 67.5, "pred_gpu_gb": 130.7, "pred_host_gb": 68.5,
           "pred_step_s": 9.578, "chosen": {"zero": 3, "offload": "optimizer", "ratio": 0.3, "mb": 4, "accum": 4,
                                            "ac": True}}
    return {"case": "8b-plan", "variant": variant, "round": rnd, "rc": 0, "results": [fig], "table": [],
            "error_tail": ""}


def test_the_table_gives_medians_and_the_ratio_against_plain() -> None:
    rows = [_row("entry", 0, 9.552), _row("plain", 0, 10.717), _row("entry", 1, 9.558), _row("plain", 1, 0, rc=1)]
    text = "\n".join(G.case_table("8b-plan", rows))
    entry = next(line for line in text.splitlines() if line.startswith("| entry |"))
    assert "| 2 | 9.555 (9.552, 9.558) |" in entry and "| 1.122 |" in entry
    assert "z3 optimizer r0.3 4x4 ac=True" in entry and "| 9.578 |" in entry
    assert "FAILED plain round 1 (rc 1): RuntimeError: CUDA out of memory" in text


@pytest.mark.deepspeed
def test_a_call_on_the_cpu_writes_what_a_device_call_brings_back(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--cpu", "--cases", "cpu-smoke",
                           "--rounds", "1", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=600, check=False, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "suite.jsonl").read_text().splitlines()]
    assert [(r["case"], r["variant"], r["rc"]) for r in rows] == [("cpu-smoke", "entry", 0)]
    fig = rows[0]["results"][-1]
    # The planner chose for the tiny model (everything auto) and the entrypoint trained at its choice.
    assert fig["chosen"]["mb"] * fig["chosen"]["accum"] == 4 and fig["step_s"] > 0
    assert fig["first_loss"] > 0 and "attention" in fig
    assert "### cpu-smoke" in (out / "suite.md").read_text()
    assert (out / "logs.tar.gz").stat().st_size > 0
