"""Checkpoint I/O on this machine: raw disk vs hpctrain's synchronous save vs its asynchronous save.

One process, one rank (a GPU with --gpu, else DeepSpeed on the CPU with gloo), a random-init Llama preset
trained a couple of steps so Adam's state exists, ZeRO-3 by default. It measures

  1. dd if=/dev/zero of=DIR/dd.bin bs=64M count=N oflag=direct  (N ~ the checkpoint's size, bounded)
  2. a synchronous hpctrain node save (hpctrain.node.checkpoint.save: every file fsynced, marker, rename)
  3. the asynchronous save, --repeats times: what the training loop waits (copy to host buffers; the first
     save also allocates them), the background write's time and throughput (save start -> checkpoint
     complete), and the training step time while the write runs vs before it

and prints a table, then `RESULT {json}` (ratios: sync/dd and async/dd throughput, async blocking/sync).

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
        (folder / "dd.bin").unlink(missing_ok=True)


def run(a: argparse.Namespace, folder: Path) -> None:
    import torch

    from hpctrain.node import checkpoint as ckpt
    from hpctrain.node import ckpt_async

    t_start = time.time()
    engine, n_params = build(a)
    print(f"[bench] model + deepspeed.initialize: {time.time() - t_start:.1f} s", file=sys.stderr, flush=True)
    vocab = int(engine.module.config.vocab_size)
    for _ in range(2):
        step(engine, a, vocab)
    idle = statistics.median(step(engine, a, vocab) for _ in range(3))
    meta = {"world_size": 1, "dp": 1, "pp": 1, "tp": 1, "zero": a.zero}

    def save(io: Any, s: int, wait: bool) -> Any:
        return ckpt.save(engine, folder / "ckpt", s, {"step": s}, meta, keep=1, io=io, wait=wait)

    # 2. synchronous
    io = ckpt_async.install(engine, async_mode=False, pin=False, rank=0, world=1)
    sync = save(io, 1, True)
    ck_bytes = int(sync.bytes or 0)
    # 1. dd, about the checkpoint's size
    count = max(4, min(math.ceil(ck_bytes / (64 << 20)), int(a.max_dd_gb * 1e9 / (64 << 20))))
    disk = dd(folder, count)
    # 3. asynchronous
    io = ckpt_async.install(engine, async_mode=True, pin=a.gpu, rank=0, world=1)
    runs = []
    for i in range(a.repeats):
        step(engine, a, vocab)
        st = save(io, 2 + i, False)
        busy = []
        job = io.job
        while job is not None and not job.done.is_set() and len(busy) < 10000:
            busy.append(step(engine, a, vocab))
        ckpt.drain(io)
        runs.append({"blocking_s": st.blocking_s, "write_s": job.write_s if job else None,
                     "bytes": job.total_bytes if job else None, "steps_during_write": len(busy),
                     "step_s_during_write": statistics.median(busy) if busy else None})
        r = runs[-1]
        r["gbps"] = r["bytes"] / r["write_s"] / 1e9 if r["bytes"] and r["write_s"] else None
    last = runs[-1]
    res = {
        "model": a.model, "params": n_params, "device": torch.cuda.get_device_name(0) if a.gpu else "cpu",
        "zero": a.zero, "dir": str(folder), "ckpt_bytes": ck_bytes,
        "dd": disk, "sync": {"s": sync.write_s, "gbps": ck_bytes / sync.write_s / 1e9},
        "async": runs, "step_s_idle": idle,
        "sync_vs_dd": ck_bytes / sync.write_s / 1e9 / disk["gbps"],
        "async_write_vs_dd": (last["gbps"] or 0) / disk["gbps"],
        "async_blocking_vs_sync": last["blocking_s"] / sync.write_s,
        "first_async_blocking_vs_sync": runs[0]["blocking_s"] / sync.write_s,
        "wall_s": time.time() - t_start,
    }
    rows = [("disk", f"dd bs=64M count={count} {disk['flag']}", disk["s"], disk["bytes"], disk["gbps"], "")]
    rows.append(("sync save", "hpctrain node save, fsynced", sync.write_s, ck_bytes, res["sync"]["gbps"],
                 f"{res['sync_vs_dd']:.2f}x dd"))
    for i, r in enumerate(runs):
        tag = "first (allocates buffers)" if i == 0 else "buffers reused"
        rows.append((f"async #{i + 1} blocking", tag, r["blocking_s"], None, None,
                     f"{r['blocking_s'] / sync.write_s:.3f}x sync"))
        rows.append((f"async #{i + 1} write", f"{r['steps_during_write']} steps meanwhile", r["write_s"], r["bytes"],
                     r["gbps"], f"{(r['gbps'] or 0) / disk['gbps']:.2f}x dd"))
    print(f"\n{a.model} ({n_params / 1e6:.1f} M params, ZeRO-{a.zero}, {res['device']}), checkpoint "
          f"{ck_bytes / 1e9:.3f} GB in {folder}; step {idle:.3f} s idle, "
          f"{last['step_s_during_write'] or 0:.3f} s during the async write")
    print(f"{'what':<22} {'how':<34} {'seconds':>9} {'GB':>9} {'GB/s':>7}  ratio")
    for what, how, s, b, g, ratio in rows:
        gb = f"{b / 1e9:.3f}" if b else ""
        rate = f"{g:.3f}" if g else ""
        print(f"{what:<22} {how:<34} {s:>9.3f} {gb:>9} {rate:>7}  {ratio}")
    line = json.dumps(res)
    if a.json:
        Path(a.json).write_text(line + "\n")
    print("RESULT " + line)


if __name__ == "__main__":
    main()
