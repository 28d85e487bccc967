"""Checkpoint I/O on this machine: raw disk vs hpctrain's synchronous save vs its asynchronous save.

One process, one rank (a GPU with --gpu, else DeepSpeed on the CPU with gloo), a random-init Llama preset
trained a couple of steps so Adam's state exists, ZeRO-3 by default. In `--rounds` alternating rounds it
measures the same checkpoint written by

  1. dd if=/dev/zero of=DIR/dd.bin bs=64M count=N oflag=direct  (N ~ the checkpoint's size, bounded)
  2. hpctrain's synchronous save with the one-thread writer of November (torch.save, fsynced): the baseline
  3. hpctrain's synchronous save with the parallel writer (node/checkpointing/ckpt_write.py, fsynced)
  4. DeepSpeed's own engine.save_checkpoint (torch.save, no fsync)

then the asynchronous save, --repeats times, with the host buffers reserved when the writer is installed (as
the node does): what the training loop waits, the background write's time and throughput, and the step time
while it runs. It prints a table of medians and `RESULT {json}`.

    python bench/checkpoint_io.py --model llama-10m --dir /tmp/ckio            # CPU, seconds
    source bench/gpu/setup.sh && python bench/checkpoint_io.py --gpu --model llama-1b --dir /tmp/ckio
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "toolkit"))


def _stub_click() -> None:
    """hpctrain.errors subclasses click.UsageError; a GPU image may have only torch/deepspeed/transformers."""
    if importlib.util.find_spec("click") is not None:
        return
    click = types.ModuleType("click")

    class UsageError(Exception):
        def format_message(self) -> str:
            return str(self)

    click.UsageError = UsageError  # type: ignore[attr-defined]
    click.ClickException = UsageError  # type: ignore[attr-defined]
    click.echo = lambda *a, **k: print(*a)  # type: ignore[attr-defined]
    sys.modules["click"] = click


def dd(folder: Path, count: int) -> dict[str, Any]:
    """Direct-I/O write throughput of the disk (falls back to conv=fsync where O_DIRECT is refused)."""
    target = folder / "dd.bin"
    out: dict[str, Any] = {}
    for flag in ("oflag=direct", "conv=fsync"):
        proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={count}", flag],
                              capture_output=True, text=True, check=False)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", proc.stderr)
        if proc.returncode == 0 and m:
            out = {"flag": flag, "bytes": int(m.group(1)), "s": float(m.group(2))}
            out["gbps"] = out["bytes"] / out["s"] / 1e9
            break
    target.unlink(missing_ok=True)
    if not out:
        raise SystemExit(f"dd failed on {folder}")
    return out


def build(a: argparse.Namespace) -> tuple[Any, int]:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpctrain.spec.presets import preset_config

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**preset_config(a.model), "max_position_embeddings": max(a.seq, 128)})
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    ds = {"train_micro_batch_size_per_gpu": a.mb, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": a.zero}, "bf16": {"enabled": a.gpu}, "gradient_clipping": 1.0,
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    # torch's AdamW: no DeepSpeed op to compile; the state saved (fp32 master, exp_avg, exp_avg_sq) is the same.
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    return engine, n


def step(engine: Any, a: argparse.Namespace, vocab: int) -> float:
    import torch

    t0 = time.time()
    x = torch.randint(0, vocab, (a.mb, a.seq), device=engine.device)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    loss.item()
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-10m", help="hpctrain preset (llama-10m on CPU, llama-1b on a GPU)")
    ap.add_argument("--gpu", action="store_true", help="one CUDA GPU (default: DeepSpeed on the CPU)")
    ap.add_argument("--dir", default="", help="folder on the disk to measure (default: a temp folder)")
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--mb", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="async saves (the first allocates the host buffers)")
    ap.add_argument("--max-dd-gb", type=float, default=16.0)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of dd and each sync writer")
    ap.add_argument("--json", default="", help="also write the result here")
    a = ap.parse_args()

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    if not a.gpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    _stub_click()
    import tempfile

    import torch

    folder = Path(a.dir or tempfile.mkdtemp(prefix="ckio-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if a.gpu:
        torch.cuda.set_device(0)
    try:
        run(a, folder)
    finally:  # never leave 15 GB behind (e.g. in a folder that is copied back)
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
        shutil.rmtree(folder / "ds", ignore_errors=True)
        (folder / "dd.bin").unlink(missing_ok=True)


def _sync_variants(engine: Any, folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The three synchronous ways to write the same checkpoint; each returns (seconds, bytes)."""
    from hpctrain.node.checkpointing import checkpoint as ckpt
    from hpctrain.node.checkpointing import ckpt_async

    def hpctrain_save(serial: bool) -> Any:
        def go(s: int) -> tuple[float, int]:
            io = ckpt_async.install(engine, async_mode=False, pin=False, rank=0, world=1)
            real = ckpt.write_file
            if serial:  # the November writer: torch.save through one thread, fsynced
                ckpt.write_file = ckpt.write_serial  # type: ignore[assignment]
                ckpt_async.write_file = ckpt.write_serial  # type: ignore[assignment]
            try:
                st = ckpt.save(engine, folder / "ckpt", s, {"step": s}, meta, keep=1, io=io, wait=True)
            finally:
                ckpt.write_file = real  # type: ignore[assignment]
                ckpt_async.write_file = real  # type: ignore[assignment]
            return float(st.write_s), int(st.bytes or 0)
        return go

    def deepspeed_save(s: int) -> tuple[float, int]:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        engine.checkpoint_engine = TorchCheckpointEngine(None)
        t0 = time.time()
        engine.save_checkpoint(str(folder / "ds"), tag=f"s{s}")  # DeepSpeed's own writer: torch.save, no fsync
        dt = time.time() - t0
        size = sum(f.stat().st_size for f in (folder / "ds").rglob("*") if f.is_file())
        shutil.rmtree(folder / "ds", ignore_errors=True)
        return dt, size

    return {"one-thread (Nov.)": hpctrain_save(True), "parallel (Dec.)": hpctrain_save(False),
            "DeepSpeed's own": deepspeed_save}


def run(a: argparse.Namespace, folder: Path) -> None:
    import torch

    from hpctrain.node.checkpointing import checkpoint as ckpt
    from hpctrain.node.checkpointing import ckpt_async

    t_start = time.time()
    engine, n_params = build(a)
    print(f"[bench] model + deepspeed.initialize: {time.time() - t_start:.1f} s", file=sys.stderr, flush=True)
    vocab = int(engine.module.config.vocab_size)
    for _ in range(2):
        step(engine, a, vocab)
    idle = statistics.median(step(engine, a, vocab) for _ in range(3))
    meta = {"world_size": 1, "dp": 1, "pp": 1, "tp": 1, "zero": a.zero}

    # 1+2. dd and the synchronous writers, alternating, `rounds` times each
    variants = _sync_variants(engine, folder, meta)
    times: dict[str, list[float]] = {k: [] for k in ["dd", *variants]}
    ck_bytes, dd_flag, count = 0, "", 4
    for r in range(a.rounds):
        for name, go in variants.items():
            dt, nbytes = go(10 * r + len(times[name]))
            times[name].append(nbytes / dt / 1e9)
            ck_bytes = ck_bytes or nbytes
            shutil.rmtree(folder / "ckpt", ignore_errors=True)
            print(f"[bench] round {r + 1} {name}: {dt:.2f} s, {nbytes / dt / 1e9:.2f} GB/s", file=sys.stderr,
                  flush=True)
        count = max(4, min(math.ceil(ck_bytes / (64 << 20)), int(a.max_dd_gb * 1e9 / (64 << 20))))
        disk = dd(folder, count)
        dd_flag = disk["flag"]
        times["dd"].append(disk["gbps"])
    med = {k: statistics.median(v) for k, v in times.items()}
    sync_s = ck_bytes / med["parallel (Dec.)"] / 1e9

    # 3. asynchronous: host buffers reserved at install, as the node does; training goes on meanwhile
    io = ckpt_async.install(engine, async_mode=True, pin=a.gpu, rank=0, world=1,
                            reserve_bytes=ckpt.estimate_state_bytes(n_params, 1, a.zero, "bf16" if a.gpu else "fp32"))
    for _ in range(3):
        step(engine, a, vocab)
    runs = []
    for i in range(a.repeats):
        step(engine, a, vocab)
        st = ckpt.save(engine, folder / "ckpt", 100 + i, {"step": 100 + i}, meta, keep=1, io=io, wait=False)
        busy = []
        job = io.job
        while job is not None and not job.done.is_set() and len(busy) < 10000:
            busy.append(step(engine, a, vocab))
        ckpt.drain(io)
        gbps = job.total_bytes / job.write_s / 1e9 if job and job.total_bytes and job.write_s else None
        runs.append({"blocking_s": st.blocking_s, "write_s": job.write_s if job else None, "gbps": gbps,
                     "steps_during_write": len(busy), "step_s_during_write": statistics.median(busy) if busy else None})
    res = {"model": a.model, "params": n_params, "device": torch.cuda.get_device_name(0) if a.gpu else "cpu",
           "zero": a.zero, "dir": str(folder), "ckpt_bytes": ck_bytes, "rounds": a.rounds, "gbps": times,
           "median_gbps": med, "dd_flag": dd_flag, "async": runs, "step_s_idle": idle,
           "sync_vs_dd": med["parallel (Dec.)"] / med["dd"],
           "sync_vs_deepspeed": med["parallel (Dec.)"] / med["DeepSpeed's own"],
           "async_write_vs_dd": (runs[-1]["gbps"] or 0) / med["dd"],
           "first_async_blocking_vs_sync": runs[0]["blocking_s"] / sync_s,
           "async_blocking_vs_sync": runs[-1]["blocking_s"] / sync_s, "wall_s": time.time() - t_start}
    print(f"\n{a.model} ({n_params / 1e6:.1f} M params, ZeRO-{a.zero}, {res['device']}), checkpoint "
          f"{ck_bytes / 1e9:.3f} GB in {folder}; medians of {a.rounds} alternating rounds; step {idle:.3f} s idle")
    print(f"{'writer':<30} {'GB/s (median)':>13} {'runs':<24} vs dd")
    for name, v in times.items():
        label = f"dd bs=64M count={count} {dd_flag}" if name == "dd" else f"sync: {name}"
        runs_txt = " ".join(f"{x:.2f}" for x in v)
        print(f"{label:<30} {med[name]:>13.3f} {runs_txt:<24} {med[name] / med['dd']:.2f}x")
    for i, r in enumerate(runs):
        tag = "first (buffers reserved at start)" if i == 0 else "buffers reused"
        print(f"async #{i + 1} {tag}: training blocked {r['blocking_s']:.3f} s = "
              f"{r['blocking_s'] / sync_s:.3f}x a sync save; background write {r['write_s'] or 0:.2f} s "
              f"({r['gbps'] or 0:.2f} GB/s), {r['steps_during_write']} steps meanwhile")
    line = json.dumps(res)
    if a.json:
        Path(a.json).write_text(line + "\n")
    print("RESULT " + line)


if __name__ == "__main__":
    main()
