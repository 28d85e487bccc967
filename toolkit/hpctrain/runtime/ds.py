"""`attach(engine)`: the one call a plain DeepSpeed script needs to resume by default under hpctrain.

    from hpctrain.runtime.ds import attach

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    start = attach(engine)                          # the step of the checkpoint it loaded, 0 on a fresh start
    for step in range(start + 1, steps + 1):
        ...forward / backward / engine.step()...     # unchanged; runtime.report(step=..., loss=...) if you like

`attach`:
* loads the checkpoint hpctrain marked last (runtime.resume_from: a requeue or a resubmission resumes from it)
  into the engine, and returns its step;
* marks every later `engine.save_checkpoint(...)` complete (runtime.mark_checkpoint, with the engine's step),
  so that resume, `hpctrain summary` and the supervisor count the script's own saves;
* on SLURM's pre-timeout or preemption signal (runtime.should_stop, agreed by every rank), saves
  RUN/checkpoints/step-N and ends the program at the start of the next optimizer step (SystemExit(0), on every
  rank at the same step); hpctrain requeues the job and `attach` in the next run resumes from that checkpoint.

The engine is patched on the instance only (save_checkpoint, forward); nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from hpctrain import runtime
from hpctrain.runs.checkpoints import step_tag


def attach(engine: Any, *, stop_on_signal: bool = True) -> int:
    """Resume `engine` from hpctrain's marked checkpoint (if any), mark its saves, stop on SLURM's signal.
    Call on every rank right after deepspeed.initialize; returns the step to continue after (0: fresh)."""
    start = 0
    found = runtime.resume_from()
    if found is not None:
        engine.load_checkpoint(str(found.parent), tag=found.name)
        start = runtime.resume_step()
    _mark_saves(engine)
    if stop_on_signal:
        _stop_between_steps(engine, start)
    return start


def _mark_saves(engine: Any) -> None:
    save = engine.save_checkpoint

    @functools.wraps(save)
    def save_checkpoint(save_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        tag = tag if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's own default
        result = save(save_dir, tag, *args, **kwargs)
        runtime.mark_checkpoint(int(engine.global_steps), Path(save_dir) / str(tag))  # every rank: a barrier
        return result

    engine.save_checkpoint = save_checkpoint


def _stop_between_steps(engine: Any, start: int) -> None:
    """Ask should_stop at the first micro-batch of each optimizer step, after the script reported the last
    one: the checkpoint then holds exactly the steps metrics.jsonl shows."""
    forward = engine.forward

    @functools.wraps(forward)
    def checked(*args: Any, **kwargs: Any) -> Any:
        done = int(engine.global_steps)
        first_micro = engine.micro_steps % max(1, engine.gradient_accumulation_steps()) == 0
        if first_micro and done > start and runtime.should_stop():
            engine.save_checkpoint(str(runtime.checkpoint_dir()), tag=step_tag(done), save_latest=False)
            print(f"hpctrain.runtime: rank {runtime.rank()} saved step {done} on SLURM's signal; stopping for the "
                  "requeue", flush=True)
            raise SystemExit(0)
        return forward(*args, **kwargs)

    engine.forward = checked
