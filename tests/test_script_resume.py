"""A user's HF Trainer script resumes by default (issue 29 item 4): a real Trainer run on the CPU with a tiny
local model (save_pretrained here, nothing from a hub), stopped by SIGTERM as SLURM's preemption would, run
again unchanged: it continues after the step hpctrain marked, and the Trainer's rotation (save_total_limit=1)
never leaves a marker naming a removed folder nor removes the checkpoint the rerun needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The user's script: the callback is its only hpctrain line; `trainer.train()` as any Trainer script has it.
SCRIPT = '''
import sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from hpctrain import runtime
from hpctrain.runtime.hf import HpctrainCallback

model_dir, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        time.sleep(0.1)  # room for the signal to come mid-run

class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        ids = torch.arange(16) * (i + 1) % 256
        return {"input_ids": ids, "labels": ids}

model = LlamaForCausalLM.from_pretrained(model_dir)
args = TrainingArguments(output_dir=str(runtime.checkpoint_dir()), max_steps=steps, logging_steps=1,
                         save_strategy="steps", save_steps=3, save_total_limit=1, per_device_train_batch_size=2,
                         report_to="none", disable_tqdm=True, use_cpu=True, seed=0, dataloader_num_workers=0)
trainer = Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[HpctrainCallback(), Slow()])
trainer.train(**({"resume_from_checkpoint": True} if resume == "true" else {}))
'''

MAKE_MODEL = '''
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=16,
                             use_cache=False)).save_pretrained(sys.argv[1])
'''

WAIT_S = 300  # bound for each wait (the imports alone take seconds on a busy 2-core machine)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    subprocess.run([sys.executable, "-c", MAKE_MODEL, str(out)], check=True, timeout=WAIT_S)
    return out


def _env(run: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCTRAIN_"))}
    return {**env, "HPCTRAIN_RUN_DIR": str(run), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _steps(run: Path) -> list[int]:
    try:
        lines = (run / "metrics" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def _markers(run: Path) -> dict[int, Path]:
    """step -> the checkpoint folder its hpctrain marker names."""
    out = {}
    for marker in (run / "checkpoints").glob("step-*/hpctrain.json"):
        meta = json.loads(marker.read_text(encoding="utf-8"))
        out[int(meta["step"])] = Path(meta.get("path") or marker.parent)
    return out


def _assert_markers_name_live_folders(run: Path) -> int:
    marks = _markers(run)
    assert marks and all(p.is_dir() for p in marks.values()), marks
    trainer_folders = sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*"))
    newest = max(marks)
    assert marks[newest].name == f"checkpoint-{newest}" and trainer_folders == [f"checkpoint-{newest}"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{newest}"
    return newest


def test_trainer_script_unchanged_resumes_from_the_marked_step_after_sigterm(model_dir: Path,
                                                                             tmp_path: Path) -> None:
    run, script = tmp_path / "run", tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    argv = [sys.executable, str(script), str(model_dir), "40", "plain"]
    first = subprocess.Popen(argv, env=_env(run), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not any(s >= 7 for s in _steps(run)):  # past two saves, so rotation has removed one
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)  # SLURM's preemption: the callback saves at the step's end and stops
        out, _ = first.communicate(timeout=WAIT_S)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-3000:]
    stopped = _steps(run)
    marked = _assert_markers_name_live_folders(run)
    assert marked == stopped[-1] and 7 <= marked < 40  # the save on the signal, not only the every-3-steps ones

    second = subprocess.run(argv, check=False, env=_env(run), capture_output=True, text=True, timeout=WAIT_S)
    assert second.returncode == 0, second.stderr[-3000:]
    rerun = _steps(run)[len(stopped):]
    assert rerun[0] == marked + 1 and rerun[-1] == 40, rerun  # resumed after the marked step, not from step 1
    assert _assert_markers_name_live_folders(run) == 40


def test_resume_true_on_the_first_attempt_starts_fresh(model_dir: Path, tmp_path: Path) -> None:
    """`resume_from_checkpoint=True` alone raises on the first attempt (no checkpoint yet); with the callback it
    starts fresh."""
    run, script = tmp_path / "run", tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(model_dir), "3", "true"], check=False, env=_env(run),
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(run) == [1, 2, 3] and _assert_markers_name_live_folders(run) == 3


def test_submit_warns_of_flags_a_script_building_its_own_ds_config_ignores(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    for name in ("CONFIG", "RUNS", "STATE"):
        monkeypatch.setenv(f"HPCTRAIN_{name}_DIR", str(tmp_path / name.lower()))
    own, reads = tmp_path / "own config.py", tmp_path / "reads.py"
    own.write_text("ds_config = {'zero_optimization': {'stage': 3}}\n")
    reads.write_text("import json, os\ncfg = json.load(open(os.environ['HPCTRAIN_DS_CONFIG']))\n")

    def stderr(script: Path, *flags: str) -> str:
        res = CliRunner().invoke(cli, ["submit", "--script", str(script), *flags, "--dry-run", "--out",
                                       str(tmp_path / "o" / script.stem), "--", "--steps", "3"])
        assert res.exit_code == 0, res.output
        return res.stderr

    warned = stderr(own, "--zero", "2", "--micro-batch", "4", "--data", "synthetic")
    assert "--zero 2, --micro-batch 4 only set RUN/ds_config.json" in warned and "--pass-ds-config" in warned
    assert "--data is read by hpctrain's trainer only" in warned
    assert "warning" not in stderr(own, "--zero", "2", "--pass-ds-config")  # given the file: it applies
    assert "warning" not in stderr(reads, "--zero", "2", "--micro-batch", "4")  # reads $HPCTRAIN_DS_CONFIG
    assert "warning" not in stderr(own)  # no such flag given


# A plain DeepSpeed loop whose only hpctrain line is `attach(engine)` (no report, no should_stop, no marking).
DS_SCRIPT = '''
import sys, time
import deepspeed, deepspeed.ops, torch
from hpctrain.runtime.ds import attach

steps = int(sys.argv[1])
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU: no JIT build of the shm op
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
start = attach(engine)
print(f"START {start}", flush=True)
for step in range(start + 1, steps + 1):
    for micro in range(2):
        g = torch.Generator().manual_seed(step * 2 + micro)
        x = torch.randn(2, 8, generator=g)
        loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    print(f"STEP {step} {loss.item():.6f}", flush=True)
    time.sleep(0.05)
    if step % 4 == 0 or step == steps:
        engine.save_checkpoint("saves")  # the script's own saves, into its own folder
'''


def _ds_env(run: Path) -> dict[str, str]:
    import socket

    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**_env(run), "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_plain_deepspeed_script_with_attach_resumes_after_sigterm(tmp_path: Path) -> None:
    run, script = tmp_path / "run", tmp_path / "loop.py"
    script.write_text(DS_SCRIPT, encoding="utf-8")
    argv = [sys.executable, str(script), "30"]
    first = subprocess.Popen(argv, env=_ds_env(run), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lines: list[str] = []
    try:
        assert first.stdout is not None
        for line in first.stdout:  # bounded: the process ends (30 steps) or is stopped below
            lines.append(line)
            if line.startswith("STEP 6 "):
                first.send_signal(signal.SIGTERM)
        first.wait(timeout=WAIT_S)
    finally:
        if first.poll() is None:
            first.kill()
    out = "".join(lines)
    assert first.returncode == 0, out[-3000:]
    done = [int(ln.split()[1]) for ln in lines if ln.startswith("STEP ")]
    assert 6 <= done[-1] < 30, out[-3000:]
    marks = _markers(run)
    assert max(marks) == done[-1] and all(p.is_dir() for p in marks.values())  # the save on the signal
    assert 4 in marks and marks[4] == tmp_path / "saves" / "global_step4"  # the script's own save, marked

    second = subprocess.run(argv, check=False, env=_ds_env(run), cwd=tmp_path, capture_output=True, text=True,
                            timeout=WAIT_S)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    rerun = [ln for ln in second.stdout.splitlines() if ln.startswith(("START", "STEP"))]
    assert rerun[0] == f"START {done[-1]}" and rerun[1].startswith(f"STEP {done[-1] + 1} ")
    assert rerun[-1].startswith("STEP 30 ") and max(_markers(run)) == 30
