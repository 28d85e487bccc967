"""`HpctrainCallback`: hpctrain.runtime wired into transformers' Trainer.

    from hpctrain import runtime
    from hpctrain.runtime.hf import HpctrainCallback

    args = TrainingArguments(output_dir=str(runtime.checkpoint_dir()), logging_steps=1, deepspeed=ds_config, ...)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[HpctrainCallback()])
    trainer.train()          # resumes from the checkpoint hpctrain marked last, or starts fresh when there is none

* every log line (logging_steps) goes to metrics.jsonl through runtime.report (loss, lr, grad_norm, ...),
  which also beats for the hang watchdog;
* after every save, the Trainer's checkpoint-N folder is marked complete (runtime.mark_checkpoint), so that
  resume_from(), `hpctrain summary` and the supervisor count it;
* on SLURM's pre-timeout or preemption signal (runtime.should_stop, agreed by every rank), the Trainer saves at
  the end of the current step and stops; hpctrain requeues the job and the next run resumes from that save;
* resume is the default: `trainer.train()` (or `resume_from_checkpoint=True`, which on its own fails on the
  first attempt) of a Trainer with this callback resumes from runtime.resume_from(), the checkpoint hpctrain
  marked last, and starts fresh when there is none; an explicit path or `False` is kept as given;
* the callback rotates the checkpoints itself (save_total_limit): a marker is removed before its folder, and
  the newest marked checkpoint, the one a requeue resumes from, is never removed (the Trainer's own rotation
  orders by mtime and runs before the new save is marked).

Importing this module imports transformers (and so torch): a script that has a Trainer has both.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback

from hpctrain import runtime
from hpctrain.runs.checkpoints import MARKER, complete_steps, step_tag

# Trainer's log keys -> the names `hpctrain summary` reads (others are written as they are).
_RENAMES = {"learning_rate": "lr"}


class HpctrainCallback(TrainerCallback):  # type: ignore[misc]  # transformers is not type-checked (pyproject: mypy)
    """Reports the Trainer's logs, marks its checkpoints complete, and saves + stops on SLURM's signal."""

    def __init__(self) -> None:
        self.stopped_on_signal = False
        self.keep: int | None = None  # the script's save_total_limit, applied by _rotate

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # Rotation is ours (see _rotate): the Trainer's, by mtime before on_save, could remove the one marked
        # checkpoint while the new save is not yet marked, and it leaves markers of removed folders behind.
        self.keep, args.save_total_limit = args.save_total_limit, None
        return control

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
        if self.keep and self.keep > 0 and args.should_save:
            _rotate(Path(args.output_dir), self.keep, state.best_model_checkpoint, protect=path)
        return control


def _rotate(output_dir: Path, keep: int, best: str | None, protect: Path) -> None:
    """Keep the `keep` newest checkpoint-N folders by step (and the best model's, and the one just marked);
    each removed folder's hpctrain marker goes first, so no marker ever names a removed folder."""
    found = sorted((int(p.name.split("-", 1)[1]), p) for p in output_dir.glob("checkpoint-*")
                   if p.is_dir() and p.name.split("-", 1)[1].isdigit())
    kept = {p.resolve() for _, p in found[-keep:]} | {protect.resolve()}
    if best:
        kept.add(Path(best).resolve())
    for _, folder in found:
        if folder.resolve() not in kept:
            _unmark(folder)
            shutil.rmtree(folder, ignore_errors=True)


def _unmark(removed: Path) -> None:
    """Remove the hpctrain markers (step-N folders) that name `removed`, or a folder already gone: a marker
    must never point at a removed folder (the resume rule refuses a run whose marked checkpoints are all
    damaged). Rank 0 only, before the folder itself goes."""
    ckpt = runtime.checkpoint_dir()
    for step in complete_steps(ckpt):
        folder = ckpt / step_tag(step)
        try:
            named = json.loads((folder / MARKER).read_text(encoding="utf-8")).get("path")
        except (OSError, ValueError, AttributeError):
            continue
        if named and (Path(named).resolve() == removed.resolve() or not Path(named).is_dir()):
            shutil.rmtree(folder, ignore_errors=True)  # the marker's own folder holds only the marker


def _resume_by_default(train: Any) -> Any:
    """Trainer.train of a Trainer with HpctrainCallback: None or True means hpctrain's marked checkpoint."""

    @functools.wraps(train)
    def wrapped(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        ours = any(isinstance(cb, HpctrainCallback) for cb in self.callback_handler.callbacks)
        if ours and (resume_from_checkpoint is None or resume_from_checkpoint is True):
            found = runtime.resume_from()
            resume_from_checkpoint = str(found) if found is not None else None
        return train(self, resume_from_checkpoint, *args, **kwargs)

    wrapped.__hpctrain__ = True  # type: ignore[attr-defined]
    return wrapped


if not getattr(Trainer.train, "__hpctrain__", False):  # once, however often this module is reloaded
    Trainer.train = _resume_by_default(Trainer.train)


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
