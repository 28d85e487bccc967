"""bench/gpu_suite.py, the GPU benchmarks' driver: which runs a device call makes and in what order, its
tables, and one real call on the CPU (a tiny model through bench/node_gpu.py and the node entrypoint); and
bench/finetune_gpu.py's run files, schedule, start-up parts and tables (no runs: its --cpu mode takes minutes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import finetune_gpu as F
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


# ------------------------------------------------------------------ bench/finetune_gpu.py (issue 26 item 5)

def _ft_setup(tmp_path: Path, cpu: bool = False) -> F.Setup:
    return F.Setup(cpu=cpu, assets=tmp_path / "assets", work=tmp_path / "work", seq=4096, global_batch=16, steps=2,
                   warmup=1, fixed=False, fmt="chat")


def test_finetune_run_files_are_valid_specs(tmp_path: Path) -> None:
    import tomli_w

    from hpctrain.spec.model import from_toml_text

    s = _ft_setup(tmp_path)
    for name, v in F.VARIANTS.items():
        if v.kind != "hpctrain":
            continue
        spec = from_toml_text(tomli_w.dumps(F.hp_tables(s, "t", v)))
        assert spec.model.path.endswith("assets/model") and spec.train.global_batch == 16, name
        # the run file carries the variant's LoRA rank (lora and lora-auto: 16; the full fine-tunes: off)
        assert spec.lora.r == v.lora_r and spec.lora.r == (16 if name.startswith("lora") else 0), name
        if v.data == "sft":
            assert (spec.data.format, spec.data.pack, spec.data.messages_field) == ("chat", True, "messages"), name
        elif v.data == "prepared":  # `hpctrain data prepare`'s folder, made once ahead by main (no run file does it)
            assert (spec.data.format, spec.data.source) == ("prepared", str(F.prepared_path(s))), name
            assert not F.prepared_path(s).exists()
        else:
            assert spec.data.source == "synthetic"


def test_finetune_schedule_alternates_and_single_runs_count_rounds() -> None:
    plan = F.expand(["lora"], ["sft:packed-flex", "sft:packed-flex"], 0)
    assert plan == [("lora", "lora", 0), ("lora", "full", 0), ("lora", "full", 1), ("lora", "lora", 1),
                    ("sft", "packed-flex", 0), ("sft", "packed-flex", 1)]
    with pytest.raises(SystemExit, match="CASE:VARIANT"):
        F.expand([], ["sft:lora"], 0)


def test_finetune_startup_parts_and_tables(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    startup = {"entry_s": 2.0, "preflight_s": 0.1, "prepare_s": 20.0, "process_group_s": 1.0, "engine_s": 100.0,
               "load_s": 0.0, "total_s": 123.1, "process_start": 1000.0}
    (run / "events.jsonl").write_text(json.dumps({"kind": "train", "extra": {"event": "start", "startup": startup}})
                                      + "\n")
    (run / "logs" / "attempt-0.rank-0.log").write_text(
        "x rank0 INFO model built in 3.5 s; loaded 291 tensors, 16.06 GB read by this rank in 40.5 s\n")
    parts = F.startup_parts(run, t_submit=990.0, step1_end=1135.1)
    assert parts["submit_s"] == 10.0 and parts["model_build_s"] == 3.5 and parts["weights_load_s"] == 40.5
    assert parts["engine_init_s"] == 56.0 and parts["first_step_s"] == 12.0 and parts["to_step1_s"] == 145.1

    def row(variant: str, step: float, resp: float, rc: int = 0) -> dict[str, object]:
        res = {"step_s": step, "tokens_per_s": 65536 / step, "response_tokens_per_s": resp, "padding_frac": 0.01,
               "chosen": {"zero": 3, "offload": "optimizer", "ratio": 0.3, "mb": 4, "accum": 4, "ac": True},
               "startup": parts}
        return {"case": "sft", "variant": variant, "round": 0, "rc": rc, "result": res,
                "error_tail": "boom" if rc else ""}

    rows = [row("synthetic", 10.0, 6553.6), row("packed-sdpa", 10.4, 4000.0), row("lora", 5.0, 8000.0),
            row("packed-flex", 1.0, 0.0, rc=1)]
    text = F.report(rows, ["padded padded-ds round 0"], ["--cases", "sft"], {"model": "llama-8b", "data": {}})
    packed = next(ln for ln in text.splitlines() if ln.startswith("| packed-sdpa | 1 | 10.400"))
    assert "| 1.040 |" in packed and "z3 optimizer r0.3 4x4 ac=True" in packed
    lora = [ln for ln in text.splitlines() if ln.startswith("| lora |")][-1]  # the speed table, after start-up
    assert "| 2.00 |" in lora  # response tokens/s against full (= packed-sdpa's run)
    assert "## Start-up" in text and "| 145.1 |" in text
    assert "FAILED sft packed-flex round 0 (rc 1): boom" in text and "not run (budget): padded padded-ds" in text
