"""`HpctrainCallback`: hpctrain.runtime wired into transformers' Trainer.

    from hpctrain import runtime
    from hpctrain.runtime.hf import HpctrainCallback

    args = TrainingArguments(output_dir=str(runtime.checkpoint_dir()), logging_steps=1, deepspeed=ds_config, ...)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[HpctrainCallback()])
    trainer.train(resume_from_checkpoint=runtime.resume_from())   # None: from scratch

* every log line (logging_steps) goes to metrics.jsonl through runtime.report (loss, lr, grad_norm, ...),
  which also beats for the hang watchdog;
* after every save, the Trainer's checkpoint-N folder is marked complete (runtime.mark_checkpoint), so that
  resume_from(), `hpctrain summary` and the supervisor count it;
* on SLURM's pre-timeout or preemption signal (runtime.should_stop, agreed by every rank), the Trainer saves at
  the end of the current step and stops; hpctrain requeues the job and the next run resumes from that save.

Importing this module imports transformers (and so torch): a script that has a Trainer has both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hpctrain import runtime

# Trainer's log keys -> the names `hpctrain summary` reads (others are written as they are).
_RENAMES = {"learning_rate": "lr"}


class HpctrainCallback(TrainerCallback):
    """Reports the Trainer's logs, marks its checkpoints complete, and saves + stops on SLURM's signal."""

    def __init__(self) -> None:
        self.stopped_on_signal = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if runtime.should_stop():  # collective: every rank calls it at every step end
            self.stopped_on_signal = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> Any:
        numbers = {_RENAMES.get(k, k): v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        if "loss" in numbers:  # a training step's log line (not the final train_loss summary)
            runtime.report(step=state.global_step, **numbers)
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # Trainer's folder name (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR), written before on_save.
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        runtime.mark_checkpoint(state.global_step, path)
        return control


def training_args_from_ds_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The TrainingArguments that must agree with hpctrain's ds_config.json (transformers refuses a config
    whose batch sizes, optimizer settings, clipping or precision differ from its arguments):
    `TrainingArguments(..., deepspeed=cfg, **training_args_from_ds_config(cfg))`."""
    out: dict[str, Any] = {
        "per_device_train_batch_size": int(cfg["train_micro_batch_size_per_gpu"]),
        "gradient_accumulation_steps": int(cfg.get("gradient_accumulation_steps", 1)),
        "bf16": bool(cfg.get("bf16", {}).get("enabled")), "fp16": bool(cfg.get("fp16", {}).get("enabled")),
    }
    if "gradient_clipping" in cfg:
        out["max_grad_norm"] = float(cfg["gradient_clipping"])
    params = cfg.get("optimizer", {}).get("params", {})
    for key, arg in (("lr", "learning_rate"), ("weight_decay", "weight_decay"), ("eps", "adam_epsilon")):
        if key in params:
            out[arg] = float(params[key])
    if "betas" in params:
        out["adam_beta1"], out["adam_beta2"] = (float(b) for b in params["betas"])
    return out
