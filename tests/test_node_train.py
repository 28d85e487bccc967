"""The node trainer for real: DeepSpeed on CPU (gloo), several ranks via torchrun, tiny Llama.

Each launch costs ~10 s (imports + init on 2 busy cores); the module keeps launches few by checking
several facts per run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from runkit import COLD_ENV, events, losses_by_step, make_run, metrics, node_env, torchrun

pytestmark = pytest.mark.deepspeed


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One uninterrupted 20-step run and one that crashes after step 12 and resumes from step-10. The uninterrupted
    one starts its ranks cold (`python -m hpctrain.node`), the others warm (forked by runkit's zygote): the resumed
    steps equal to the bit say a forked rank trains as a cold one does."""
    base = tmp_path_factory.mktemp("zero3")
    common: dict = {"train": {"steps": 20}, "checkpoint": {"every_steps": 10, "keep": 2, "export_hf": True}}
    full = make_run(base / "full", **common)
    _ok(torchrun(full, 2, warm=False))
    crash = make_run(base / "crash", **common)
    first = torchrun(crash, 2, env={"HPCTRAIN_FAIL_AT_STEP": "12"})
    assert first.returncode != 0
    _ok(torchrun(crash, 2))
    return {"full": full, "crash": crash}


def test_zero3_resume_is_bit_identical(zero3_runs: dict[str, Path]) -> None:
    full, crash = losses_by_step(zero3_runs["full"]), losses_by_step(zero3_runs["crash"])
    assert sorted(full) == list(range(1, 21))
    assert full[1] == pytest.approx(5.77, abs=0.15)  # ln(320): a sane random init
    assert full[20] < full[1] - 0.5
    for step in range(11, 21):  # steps after the checkpoint at 10, re-run by the resumed attempt
        assert crash[step] == full[step], (step, crash[step], full[step])
    starts = [e for e in events(zero3_runs["crash"]) if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, "step-10"]
    # forked by runkit's zygote (the crash run's two attempts) against started cold (the uninterrupted run)
    assert all("zygote" in s["startup"] for s in starts) or os.environ.get(COLD_ENV) == "1", [s["startup"]
                                                                                           for s in starts]
    assert "zygote" not in next(e for e in events(zero3_runs["full"]) if e["event"] == "start")["startup"]
    ck = zero3_runs["crash"] / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-20"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-10", "step-20"]


def test_metrics_heartbeat_and_logs(zero3_runs: dict[str, Path]) -> None:
    run = zero3_runs["full"]
    rec = metrics(run)[-1]
    for key in ("step", "loss", "lr", "tokens", "tokens_per_s", "tflops", "mfu", "gpu_mem_gb", "host_mem_gb",
                "padding_frac", "ckpt_s", "time"):
        assert key in rec
    assert rec["tokens"] == 2 * 2 * 2 * 32 and rec["ckpt_s"] > 0
    beat = json.loads((run / "metrics" / "heartbeat").read_text())
    assert beat["step"] == 20 and beat["state"] == "finished"
    assert sorted(p.name for p in (run / "logs").glob("attempt-*")) == ["attempt-0.rank-0.log", "attempt-0.rank-1.log"]
    assert "step 20 | loss" in (run / "logs" / "attempt-0.rank-0.log").read_text()


def test_exported_model_loads_and_reproduces_loss(zero3_runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from hpctrain.node.data.loader import DataSource

    run = zero3_runs["full"]
    final = [e for e in events(run) if e["event"] == "finished"][-1]
    model = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    assert json.loads((run / "hf" / "tokenizer_info.json").read_text())["type"] == "byte"
    src = DataSource(None, mode="padded", micro=2, seq_len=32, budget=64, seed=7, pad_id=256, vocab=320)
    b = src.batch(final["next_batch"])  # the batch rank 0 checked after the last step
    with torch.no_grad():
        loss = model(**b.model_inputs()).loss.item()
    assert loss == pytest.approx(final["next_batch_loss"], abs=1e-5)


def test_a_damaged_latest_checkpoint_is_passed_over_for_the_previous_whole_one(zero3_runs: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    # The one resume rule (runs.checkpoints.choose_resume): step-20's optimizer file cut in half, the run starts
    # again from step-10 on every rank, and says why step-20 was passed over (rank 0 only).
    import shutil

    run = tmp_path / "broken"
    shutil.copytree(zero3_runs["crash"], run)
    victim = min((run / "checkpoints" / "step-20").glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    proc = torchrun(run, 2, timeout=300)
    _ok(proc)
    starts = [e for e in events(run) if e["event"] == "start"]
    assert starts[-1]["resumed_from"] == "step-10", starts[-1]
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "resume: passed over" in ln]
    assert len(said) == 1 and "step-20" in said[0], said
    full = losses_by_step(zero3_runs["full"])
    again = losses_by_step(run)
    assert all(again[s] == full[s] for s in range(11, 21))  # steps 11-20 trained again from step-10, the same


def test_resume_two_to_four_ranks_through_universal(zero3_runs: dict[str, Path], tmp_path: Path) -> None:
    """The 2-rank ZeRO-3 run, continued on 4 ranks: its step-20 checkpoint through a universal one. (ZeRO-2's
    conversion, which must inject state, 2 -> 1 rank: test_node_ckpt_async's universal test.)"""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(zero3_runs["full"], run)
    before = losses_by_step(run)
    make_run(run, train={"steps": 23}, checkpoint={"every_steps": 10, "keep": 2, "export_hf": False})  # now 4 ranks
    _ok(torchrun(run, 4, timeout=240))
    after = losses_by_step(run)
    assert sorted(after) == list(range(1, 24))
    assert all(after[s] == before[s] for s in range(1, 21))  # the 2-rank history is kept
    assert after[21] < before[1] - 0.3  # continued from trained weights, not from scratch
    start = [e for e in events(run) if e["event"] == "start"][-1]
    assert (start["world_size"], start["resumed_from"]) == (4, "step-20")
    assert (run / "checkpoints" / "universal-step-20").is_dir()
    # The allocation's edits, beside the config as submitted, and in the log.
    rendered = json.loads((run / "ds_config.json").read_text())
    effective = json.loads((run / "ds_config.effective.json").read_text())
    assert {k for k in {*rendered, *effective} if rendered.get(k) != effective.get(k)} == {"train_batch_size",
                                                                                          "checkpoint"}
    assert (rendered["train_batch_size"], effective["train_batch_size"]) == (8, 16)
    assert effective["checkpoint"] == {"load_universal": True}
    assert "ds_config: train_batch_size 8 -> 16" in (run / "logs" / "attempt-0.rank-0.log").read_text()


def test_pipeline_two_stages(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", train={"steps": 8, "precision": "bf16"}, parallel={"zero": 1, "pp": 2},
                   checkpoint={"export_hf": True})
    _ok(torchrun(run, 2))
    loss = losses_by_step(run)
    assert loss[1] == pytest.approx(5.77, abs=0.2) and loss[8] < loss[1] - 0.3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert model.config.num_hidden_layers == 2 and not model.config.tie_word_embeddings


def test_fp16_dynamic_loss_scaling(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", train={"steps": 12, "precision": "fp16"}, parallel={"zero": 2})
    cfg = json.loads((run / "ds_config.json").read_text())  # as `hpctrain submit` wrote it; a user may edit it
    cfg["fp16"].update(initial_scale_power=22, loss_scale_window=2, hysteresis=1)  # start too high: overflow
    (run / "ds_config.json").write_text(json.dumps(cfg))
    _ok(torchrun(run, 2, env={"HPCTRAIN_CPU_FP16": "1"}))
    recs = metrics(run)
    scales = [r["loss_scale"] for r in recs]
    assert scales[0] < 2**22, scales  # the first step overflowed and halved the scale
    assert len(set(scales)) > 1, scales  # and it keeps moving (down on overflow, up after the window)
    assert all(r["loss"] == r["loss"] for r in recs)  # finite
    assert len({r["lr"] for r in recs}) > 1  # steps stopped being skipped: the schedule moved
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.05


def test_packed_jsonl_data_zero2_bf16(tmp_path: Path) -> None:
    data = tmp_path / "corpus.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    data.write_text("".join(json.dumps({"text": " ".join(words[: 1 + i % 5]) * (1 + i % 3)}) + "\n"
                            for i in range(200)))
    run = make_run(tmp_path / "run", data={"source": str(data), "pack": True, "seq_len": 64},
                   train={"steps": 6, "precision": "bf16"}, parallel={"zero": 2})
    _ok(torchrun(run, 2))
    recs = metrics(run)
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert all(r["padding_frac"] < 0.3 for r in recs)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigusr2_checkpoints_at_step_boundary_and_stops(tmp_path: Path, mode: str) -> None:
    """Ranks started by hand (RANK/WORLD_SIZE env): SIGUSR2 to one rank -> all agree, save, exit 3.
    Async: saves every 2 steps with slow background writes; the save on the signal waits for its write."""
    from runkit import free_port_pair

    extra: dict = {"checkpoint": {"every_steps": 2, "async_save": True}} if mode == "async" else {}
    run = make_run(tmp_path / "run", train={"steps": 100000}, **extra)
    port = str(free_port_pair())
    procs = []
    for r in range(2):
        env = node_env({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port, "HPCTRAIN_CKPT_WRITE_DELAY_S": "0.5" if mode == "async" else "0"})
        procs.append(subprocess.Popen([sys.executable, "-m", "hpctrain.node", str(run)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.time() + 120
        while len(metrics(run)) < 3 and time.time() < deadline:
            time.sleep(0.5)
        assert len(metrics(run)) >= 3, procs[0].communicate(timeout=5)
        procs[1].send_signal(signal.SIGUSR2)  # only one rank sees it; the all_reduce spreads it
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [3, 3]
    last = metrics(run)[-1]["step"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{last}"
    assert (run / "checkpoints" / f"step-{last}" / "hpctrain.json").is_file()
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert json.loads((run / "metrics" / "heartbeat").read_text())["state"] == "stopped-on-signal"


def test_deepspeed_launcher_path(tmp_path: Path) -> None:
    """`python -m hpctrain.node RUN --launcher deepspeed`: DeepSpeed's runner (no ssh) starts the ranks."""
    run = make_run(tmp_path / "run", train={"steps": 3})
    (run / "hostfile").write_text("localhost slots=2\n")
    from runkit import free_port_pair

    env = node_env({"MASTER_PORT": str(free_port_pair())})
    proc = subprocess.run([sys.executable, "-m", "hpctrain.node", str(run), "--launcher", "deepspeed"], env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    _ok(proc)
    assert "--no_ssh" in proc.stdout or "launch.py" in proc.stdout
    assert sorted(losses_by_step(run)) == [1, 2, 3]
    assert {p.name for p in (run / "logs").glob("attempt-*")} == {"attempt-0.rank-0.log", "attempt-0.rank-1.log"}


def test_deepspeed_launcher_refuses_missing_hostfile(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "hpctrain.node", str(run), "--launcher", "deepspeed"],
                          env=node_env(), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "hostfile is missing or empty" in proc.stderr


@pytest.mark.parametrize("parallel", [{"zero": 3}, {"zero": 1, "pp": 2}], ids=["zero3", "pp2"])
def test_finetune_from_exported_folder(zero3_runs: dict[str, Path], tmp_path: Path, parallel: dict) -> None:
    """model.path = an exported HF folder: weights load (ZeRO-3 from_pretrained, or per pipeline stage)."""
    src = zero3_runs["full"]
    final_loss = losses_by_step(src)[20]
    freeze = ["model.embed_tokens.*"] if "pp" not in parallel else []
    run = make_run(tmp_path / "run", model={"config": "", "path": str(src / "hf"), "freeze": freeze},
                   train={"steps": 3, "warmup_steps": 0, "lr": 1e-4, "min_lr": 1e-5}, parallel=parallel)
    _ok(torchrun(run, 2))
    first = losses_by_step(run)[1]
    assert first < final_loss + 0.3 < 5.5, (first, final_loss)  # trained weights, not a random init (5.77)
    if freeze:
        assert "froze 1 parameter tensors" in (run / "logs" / "attempt-0.rank-0.log").read_text()


def test_tensor_parallel_autotp_matches_one_rank(tmp_path: Path) -> None:
    """tp=2 (DeepSpeed AutoTP, dp=1) trains the same numbers as one rank, and exports a whole model."""
    common: dict = {"train": {"steps": 4}, "parallel": {"zero": 1}, "checkpoint": {"export_hf": True}}
    one = make_run(tmp_path / "one", **common)
    _ok(torchrun(one, 1))
    tp = make_run(tmp_path / "tp", **{**common, "parallel": {"zero": 1, "tp": 2}})
    _ok(torchrun(tp, 2))
    a, b = losses_by_step(one), losses_by_step(tp)
    assert all(a[s] == pytest.approx(b[s], abs=1e-5) for s in a), (a, b)
    assert sorted(p.name for p in (tp / "checkpoints" / "step-4").glob("mp_rank_*")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # sharded for real
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(tp / "hf")
    ref = AutoModelForCausalLM.from_pretrained(one / "hf")
    for (n, x), (_, y) in zip(whole.named_parameters(), ref.named_parameters(), strict=True):
        assert x.shape == y.shape and torch.allclose(x, y, atol=1e-5), n


def test_auto_choices_come_from_the_plan(tmp_path: Path) -> None:
    # zero auto, micro-batch auto and activation checkpointing auto: the node runs what plan.json and
    # ds_config.json say (it never plans again).
    run = make_run(tmp_path / "run", train={"steps": 2, "micro_batch": 0, "grad_accum": 0, "global_batch": 8,
                                            "activation_checkpointing": "auto"}, parallel={"zero": "auto"})
    from hpctrain.plan.model import Plan

    plan = Plan.from_json((run / "plan.json").read_text())
    _ok(torchrun(run, 2))
    start = next(e for e in events(run) if e.get("event") == "start")
    assert start["zero"] == plan.zero_stage and plan.activation_checkpointing is False
    assert len(metrics(run)) == 2
    assert not (run / "ds_config.effective.json").exists()  # the planned allocation: nothing to edit
