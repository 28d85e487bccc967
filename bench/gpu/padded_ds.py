"""A padded DeepSpeed fine-tuning loop, the baseline for hpctrain's packed SFT (nothing of hpctrain in it).

Written the way DeepSpeed's own single-GPU fine-tuning example (DeepSpeed-Chat step 1, `training/utils/data`)
does it: `HfDeepSpeedConfig` so `from_pretrained` builds the model partitioned under ZeRO-3, every example
rendered with the tokenizer's chat template and padded to the max length (with an attention mask), micro-batches
of whole examples, `engine(...)`, `engine.backward`, `engine.step`. The loss covers the responses only
(labels -100 on the prompt and the pads), as hpctrain's SFT formats do, so the same tokens are learned.

    torchrun --nproc_per_node 1 bench/gpu/padded_ds.py --model-dir /tmp/ft-assets/model \
        --data /tmp/ft-assets/chat.jsonl --seq 4096 --mb 4 --accum 4 --offload optimizer --ratio 0.3

Prints `RESULT {json}` on rank 0: step s, real and response tokens/s, padding, and the epoch time
(examples / (mb x accum x world) steps at the median step).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig


def encode(tok: Any, record: dict[str, Any], seq: int) -> tuple[list[int], int]:
    """Token ids of one chat example (truncated to seq) and how many of them are the prompt."""
    msgs = record["messages"]
    full = tok.apply_chat_template(msgs, tokenize=False)
    head = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
    ids = tok(full, add_special_tokens=False)["input_ids"][:seq]
    return ids, min(len(ids), len(tok(head, add_special_tokens=False)["input_ids"]))


def padded_batch(examples: list[tuple[list[int], int]], seq: int, pad: int) -> dict[str, torch.Tensor]:
    """Every row padded to `seq` (the example's way), labels -100 on prompt and pads, an attention mask."""
    x = torch.full((len(examples), seq), pad, dtype=torch.long)
    y = torch.full_like(x, -100)
    m = torch.zeros_like(x)
    for r, (ids, n_prompt) in enumerate(examples):
        t = torch.tensor(ids, dtype=torch.long)
        x[r, :len(ids)] = t
        y[r, n_prompt:len(ids)] = t[n_prompt:]
        m[r, :len(ids)] = 1
    return {"input_ids": x, "labels": y, "attention_mask": m}


def ds_config(a: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": a.zero, "overlap_comm": True, "contiguous_gradients": True}
    if a.offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not a.cpu, "ratio": a.ratio}
    torch_adam = a.cpu or a.offload == "none"  # no JIT build of FusedAdam; CPU Adam with offload, as the example
    return {"train_micro_batch_size_per_gpu": a.mb, "gradient_accumulation_steps": a.accum, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0,
                                                      **({"torch_adam": True} if torch_adam else {})}}}


def load_model(folder: str) -> tuple[Any, str]:
    """from_pretrained (partitioned at construction under HfDeepSpeedConfig's ZeRO-3). On the H200 machine's
    transformers 5.17 a config with pad_token_id once failed there (IndexError in `_init_weights` on a partitioned
    embedding, device notes 2026-12-02): then the loop loads without it, and its RESULT says so."""
    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), ""
    except IndexError as exc:
        cfg = AutoConfig.from_pretrained(folder)
        cfg.pad_token_id = None
        model = AutoModelForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.bfloat16)
        return model, f"loaded without pad_token_id after IndexError: {exc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data", required=True, help="chat jsonl (messages)")
    ap.add_argument("--seq", type=int, default=4096, help="the max length every example is padded to")
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--offload", default="none", choices=["none", "optimizer"])
    ap.add_argument("--ratio", type=float, default=1.0)
    ap.add_argument("--no-ac", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cpu", action="store_true", help="CPU rank (DS_ACCELERATOR=cpu, gloo)")
    a = ap.parse_args()
    t_start = time.time()
    if a.cpu:
        from deepspeed import ops as ds_ops  # not `import deepspeed.ops`: that would make `deepspeed` a local

        ds_ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a 30 s g++ build, unused here
    deepspeed.init_distributed(dist_backend="gloo" if a.cpu else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dev = torch.device("cpu") if a.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if not a.cpu:
        torch.cuda.set_device(dev)
    cfg = ds_config(a)
    keep = HfDeepSpeedConfig(cfg) if a.zero == 3 else None  # noqa: F841 - must live while the model is built
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    need = (a.warmup + a.steps) * a.mb * a.accum * world
    lines = Path(a.data).read_text().splitlines()
    examples = [encode(tok, json.loads(ln), a.seq) for ln in lines[:need]]
    t0 = time.time()
    model, workaround = load_model(a.model_dir)
    load_s = time.time() - t0
    if not a.no_ac:
        model.gradient_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.time() - t0 - load_s
    times, losses, resp, real = [], [], [], []
    k = 0
    for step in range(a.warmup + a.steps):
        if not a.cpu:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        n_resp = n_real = 0
        for _ in range(a.accum):
            mine = examples[(k + rank) * a.mb:(k + rank + 1) * a.mb]
            k += world
            batch = padded_batch(mine, a.seq, tok.pad_token_id)
            n_resp += int((batch["labels"] != -100).sum())
            n_real += int(batch["attention_mask"].sum())
            loss = engine(**{key: v.to(dev) for key, v in batch.items()}).loss
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
        if not a.cpu:
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t1)
            resp.append(n_resp)
            real.append(n_real)
    step_s = statistics.median(times)
    slots = a.mb * a.accum * a.seq
    if rank == 0:
        print("RESULT " + json.dumps({
            "impl": "padded-deepspeed", "world": world, "zero": a.zero, "offload": a.offload, "ratio": a.ratio,
            "mb": a.mb, "accum": a.accum, "seq": a.seq, "ac": not a.no_ac, "step_s": round(step_s, 4),
            "steps": a.steps, "runs_s": [round(t, 3) for t in times],
            "response_tokens_per_s": round(world * statistics.mean(resp) / step_s, 1),
            "real_tokens_per_s": round(world * statistics.mean(real) / step_s, 1),
            "slots_per_s": round(world * slots / step_s, 1),
            "padding_frac": round(1 - statistics.mean(real) / slots, 4),
            "epoch_s": round(len(lines) / (a.mb * a.accum * world) * step_s, 1), "examples": len(lines),
            "load_s": round(load_s, 1), "load_workaround": workaround, "engine_init_s": round(init_s, 1),
            "first_loss": round(losses[0], 3), "last_loss": round(losses[-1], 3),
            "gpu_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if not a.cpu else 0.0,
            "host_peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 1),
            "wall_s": round(time.time() - t_start, 1)}), flush=True)


if __name__ == "__main__":
    main()
