"""transformers' Trainer with DeepSpeed (ZeRO stage from hpctrain), run by hpctrain as your own script.

    hpctrain submit --script examples/scripts/hf_trainer.py --launcher torchrun --nodes 2 \
        --set resources.tasks_per_node=2 --zero 2 -- --data examples/scripts/tiny.txt --steps 40

hpctrain renders ds_config.json from the flags (ZeRO stage, micro-batch, accumulation, optimizer, precision) and
hands its path to every rank in HPCTRAIN_DS_CONFIG; `training_args_from_ds_config` sets the TrainingArguments
that must agree with it. `HpctrainCallback` wires the Trainer to hpctrain: its logs go to metrics.jsonl
(`hpctrain summary`), its checkpoints are marked complete, and on SLURM's pre-timeout or preemption signal it
saves and stops; hpctrain requeues the job and the same `trainer.train()` continues from that checkpoint with
the same losses (the callback makes resume the default).

The model is a tiny Llama built from a config (random weights) and the data a local text file read as bytes:
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import deepspeed.ops
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hpctrain import runtime
from hpctrain.runtime.hf import HpctrainCallback, training_args_from_ds_config


class ByteBlocks(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The file's bytes cut into blocks of seq_len tokens; labels are the inputs (the model shifts them)."""

    def __init__(self, path: str, seq_len: int) -> None:
        with open(path, "rb") as fh:
            data = torch.tensor(list(fh.read()), dtype=torch.long)
        n = len(data) // seq_len
        self.blocks = data[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class Slow(TrainerCallback):  # type: ignore[misc]
    """--step-sleep: a pause per step, to watch the run (or signal it) before it ends."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        return control


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a local text file")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: on the signal and at the end)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args()

    with open(os.environ["HPCTRAIN_DS_CONFIG"], encoding="utf-8") as fh:
        ds_config = json.load(fh)
    accelerator_config = {}
    if not torch.cuda.is_available():  # CPU ranks
        # No 30 s JIT build of DeepSpeed's shared-memory op (inference only).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # accelerate (which the Trainer uses) picks a backend only for accelerators: on CPU ranks it would start
        # DeepSpeed's process group but count one process. Configure its state with gloo first, and let the
        # Trainer use it.
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        accelerator_config = {"use_configured_state": True}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                         max_position_embeddings=a.seq_len, use_cache=False))
    args = TrainingArguments(
        output_dir=str(runtime.checkpoint_dir()), max_steps=a.steps, logging_steps=1, report_to="none",
        save_strategy="steps", save_steps=a.save_every or a.steps, seed=0, data_seed=0,
        deepspeed=ds_config, dataloader_num_workers=0, disable_tqdm=True, accelerator_config=accelerator_config,
        **training_args_from_ds_config(ds_config))
    callbacks: list[TrainerCallback] = [HpctrainCallback()]
    if a.step_sleep:
        callbacks.append(Slow(a.step_sleep))
    trainer = Trainer(model=model, args=args, train_dataset=ByteBlocks(a.data, a.seq_len), callbacks=callbacks)
    trainer.train()  # with HpctrainCallback: resumes from the checkpoint hpctrain marked last, if any


if __name__ == "__main__":
    main()
