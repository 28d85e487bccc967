"""A plain DeepSpeed training loop, run by hpctrain as your own script.

    hpctrain submit --script examples/scripts/ds_loop.py --launcher deepspeed --pass-ds-config \
        --nodes 2 --set resources.tasks_per_node=2 --zero 2 -- --data examples/scripts/tiny.txt --steps 40

hpctrain allocates the nodes, writes the hostfile and ds_config.json (ZeRO stage, batch sizes, optimizer: from
the flags), runs the pre-flight, and starts DeepSpeed's launcher on every node, which starts this script once per
rank. The script talks to hpctrain through `hpctrain.runtime` (torch-free):

* resume_from() / resume_step(): the latest complete checkpoint after a requeue or a resubmission;
* report(step=..., loss=...): metrics.jsonl (`hpctrain summary`) and heartbeats (the hang watchdog);
* should_stop(): SLURM's pre-timeout or preemption signal came: save, mark_checkpoint(step), leave;
  hpctrain requeues the job and the next run resumes from that checkpoint, with the same losses.

The model is a tiny byte-level language model and the data a local text file: nothing is downloaded. Every
batch is a function of (step, micro-batch, rank), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import argparse
import os
import time

import deepspeed
import deepspeed.ops
import torch

from hpctrain import runtime


class TinyLM(torch.nn.Module):
    """Next-byte prediction: embedding -> MLP -> logits over 256 bytes."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.hidden(self.embed(x)))
        return torch.nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def batch(data: torch.Tensor, step: int, micro: int, rank: int, world: int, size: int, seq: int,
          accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch `micro` of `step` for `rank`: windows of the file at positions that depend on nothing else."""
    g = torch.Generator().manual_seed(((step * accum + micro) * world + rank) * 7919)
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=g)
    x = torch.stack([data[s:s + seq] for s in starts])
    y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
    return x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a local text file")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only on the signal)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait per step (to watch it)")
    p.add_argument("--fail-on-rank", type=int, default=-1, help="this rank raises at step 2 (a failure to see)")
    p.add_argument("--tag", default="", help="a label written into every metrics record")
    p.add_argument("--deepspeed_config", default=os.environ.get("HPCTRAIN_DS_CONFIG"),
                   help="DeepSpeed's config (hpctrain appends it with --pass-ds-config)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher")
    a = p.parse_args()

    cpu = not torch.cuda.is_available()
    if cpu:  # CPU ranks: gloo, and no 30 s JIT build of DeepSpeed's shared-memory op (inference only)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=a.deepspeed_config)
    with open(a.data, "rb") as fh:
        data = torch.tensor(list(fh.read()), dtype=torch.long)
    size, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    start = 0
    ckpt = runtime.resume_from()
    if ckpt is not None:
        engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name)
        start = runtime.resume_step()
        print(f"rank {rank}: resumed from {ckpt} (step {start})", flush=True)
    for step in range(start + 1, a.steps + 1):
        total = torch.zeros(1)
        for micro in range(accum):
            if step == 2 and rank == a.fail_on_rank:
                raise ValueError(f"example failure on rank {rank} at step {step}")
            x, y = batch(data, step, micro, rank, world, size, a.seq_len, accum)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu()
        torch.distributed.all_reduce(total)
        runtime.report(step=step, loss=total.item() / (accum * world), lr=engine.get_lr()[0],
                       **({"tag": a.tag} if a.tag else {}))
        time.sleep(a.step_sleep)
        stop = runtime.should_stop()
        if stop or (a.save_every and step % a.save_every == 0) or step == a.steps:
            engine.save_checkpoint(str(runtime.checkpoint_dir()), tag=f"step-{step}", save_latest=False)
            runtime.mark_checkpoint(step)
        if stop:
            print(f"rank {rank}: stopping at step {step} for requeue", flush=True)
            return


if __name__ == "__main__":
    main()
