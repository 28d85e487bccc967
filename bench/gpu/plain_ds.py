"""A plain DeepSpeed training loop: the baseline hpctrain's entrypoint is measured against.

Written the way the DeepSpeed examples do it, with nothing of hpctrain: random-init Llama from a
config, bf16, ZeRO-N, optional activation checkpointing and optimizer offload, random tokens.
Launch one process per GPU (torchrun, or `bench/gpu/launch.py`), e.g.

    torchrun --nproc_per_node 1 bench/gpu/plain_ds.py --model llama-1b --zero 3 --mb 4 --seq 4096

Prints one line `RESULT {json}` on rank 0 (tokens/s per GPU, model TFLOPS, peak memory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import deepspeed
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

# Llama 3.2 1B / 3B and Llama 3.1 8B shapes (random init; no download).
SHAPES = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "tie_word_embeddings": True},
    "llama-3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "tie_word_embeddings": True},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "tie_word_embeddings": False},
}


def model_flops_per_token(cfg: LlamaConfig, n_params: int, seq: int) -> float:
    """6·N (N without the input-embedding lookup; a tied lm_head counted) + 12·L·H·S (attention)."""
    emb = cfg.vocab_size * cfg.hidden_size
    n = n_params - emb + (emb if cfg.tie_word_embeddings else 0)
    return 6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation steps per optimizer step")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--offload", default="none", choices=["none", "optimizer"])
    ap.add_argument("--ratio", type=float, default=1.0)
    ap.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    ap.add_argument("--init-on-cpu", action="store_true", help="random init on the CPU (before 2026-12-01b)")
    ap.add_argument("--breakdown", action="store_true",
                    help="time forward, backward, step and the ZeRO-3 step's pieces (synchronising: not a baseline)")
    ap.add_argument("--zero3-offload-fix", action="store_true",
                    help="install hpctrain.node.model.zero_offload on the engine (an A/B of the fix, not the baseline)")
    ap.add_argument("--torch-adam", action="store_true",
                    help="torch's fused AdamW instead of FusedAdam (same speed, no JIT build; not with offload)")
    ap.add_argument("--sdpa-first", default="", choices=["", "cudnn", "flash", "efficient"],
                    help="put this SDPA backend first in torch's order (an A/B of hpctrain's attention choice)")
    args = ap.parse_args()

    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=args.seq, **SHAPES[args.model])
    zero: dict = {"stage": args.zero, **({"overlap_comm": True, "contiguous_gradients": True} if args.zero else {})}
    if args.offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": args.ratio}
    if args.sdpa_first:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
        first = getattr(SDPBackend, names[args.sdpa_first])
        rest = [b for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.MATH) if b != first]
        sdpa_kernel([first, *rest], set_priority=True).__enter__()
    ds_config = {
        "train_micro_batch_size_per_gpu": args.mb,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0,
                                                  **({"torch_adam": True, "fused": True} if args.torch_adam
                                                     and args.offload == "none" else {})}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    torch.manual_seed(0)
    # The random init runs on the GPU (HF's init of 3 B parameters on the CPU took minutes per run, most of a
    # device call); deepspeed.initialize then partitions the model as before, so the steps are the same.
    with torch.device("cpu" if args.init_on_cpu else "cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if not args.no_ac:
        model.gradient_checkpointing_enable()
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if args.zero3_offload_fix:
        from hpctrain.node.model.zero_offload import install

        print("zero_offload:", install(engine.optimizer), flush=True)
    pieces: dict[str, list[float]] = {}
    if args.breakdown:
        from ds_timers import wrap_step_pieces

        wrap_step_pieces(engine.optimizer, pieces)

    tokens_per_step = args.mb * args.accum * args.seq * world
    times: list[float] = []
    losses: list[float] = []
    g = torch.Generator(device="cuda").manual_seed(rank)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for step in range(args.warmup + args.steps):
        xs = [torch.randint(0, cfg.vocab_size, (args.mb, args.seq), device="cuda", generator=g)
              for _ in range(args.accum)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        t1 = t2 = 0.0  # forward and backward of the step's micro-batches (timed only with --breakdown)
        for x in xs:  # DeepSpeed steps the optimizer at the last micro-batch's engine.step()
            a = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            b = _sync_time(args.breakdown)
            engine.backward(loss)
            c = _sync_time(args.breakdown)
            if x is not xs[-1]:
                engine.step()
            t1, t2 = t1 + (b - a), t2 + (c - b)
        t2_end = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        t1, t2 = t0 + t1, t0 + t1 + t2  # forward = t1 - t0, backward = t2 - t1, step = t3 - t2_end
        if step >= args.warmup:
            times.append(t3 - t0)
            if args.breakdown:
                for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2_end)):
                    phases[k].append(v)
        elif args.breakdown:
            for v in pieces.values():
                v.clear()  # warm-up steps are not counted
        losses.append(float(loss))
    times.sort()
    step_s = times[len(times) // 2]
    tps_gpu = tokens_per_step / step_s / world
    tflops = tps_gpu * model_flops_per_token(cfg, n_params, args.seq) / 1e12
    if rank == 0:
        print("RESULT " + json.dumps({
            "impl": "plain-deepspeed", "model": args.model, "params": n_params, "zero": args.zero,
            "offload": args.offload, "ratio": args.ratio, "world": world, "mb": args.mb, "accum": args.accum,
            "seq": args.seq, "ac": not args.no_ac, "sdpa_first": args.sdpa_first,
            "step_s": round(step_s, 4), "tokens_per_s_per_gpu": round(tps_gpu, 1),
            "model_tflops_per_gpu": round(tflops, 1),
            "gpu_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1),
            "host_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 1),
            "first_loss": round(losses[0], 3), "last_loss": round(losses[-1], 3),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""), "torch_threads": torch.get_num_threads(),
            "cpus": len(os.sched_getaffinity(0)), "zero3_offload_fix": args.zero3_offload_fix,
            **({"breakdown_s": {k: round(_median(v), 4) for k, v in phases.items() if v},
                "step_pieces_s_per_step": {k: round(sum(v) / max(1, args.steps), 4) for k, v in pieces.items()},
                "step_pieces_calls_per_step": {k: len(v) / max(1, args.steps) for k, v in pieces.items()}}
               if args.breakdown else {}),
        }), flush=True)


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def _sync_time(sync: bool) -> float:
    """perf_counter after the GPU is idle (only when timing phases: the syncs cost the overlap)."""
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter()


if __name__ == "__main__":
    main()
