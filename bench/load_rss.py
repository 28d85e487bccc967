"""Loading a pretrained folder under ZeRO-3: peak host memory of each rank against the model's size, and time.

Makes a Llama folder (default: Llama-3.2-1B's shape, 1.24 B parameters, bf16 safetensors, ~2.5 GB) under
--dir unless one is there, then starts `--ranks` DeepSpeed ranks on the CPU (gloo) that load it through
hpctrain's own `build_model` under ZeRO-3 in bf16, as the node does, and prints one row per rank: the
rank's RSS after imports, after construction and after loading, its peak RSS (VmHWM), the bytes it read
and the seconds construction and loading took. A rank that held the whole model would peak above
imports + model bytes; hpctrain's loader should peak near imports + model bytes / ranks (its partition).

`--mode gather` runs, for comparison, the loader hpctrain had before issue 26 (rank 0 reads every tensor
through safetensors' mmap, then GatheredParameters broadcasts it, a collective per tensor).

    python bench/load_rss.py --dir /tmp/load1b             # makes the folder (once), measures, prints
    python bench/load_rss.py --dir /tmp/load1b --mode gather
    python bench/load_rss.py --dir /tmp/load1b --delete    # ... and removes the folder afterwards
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "toolkit"))

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 4096, "tie_word_embeddings": True, "pad_token_id": 128004,
            "rope_parameters": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                "rope_theta": 500000.0}}


def make_folder(folder: Path, layers: int) -> None:
    """save_pretrained of a bf16 Llama with uniform random weights (built without init: it is overwritten)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    body = {**LLAMA_1B, "num_hidden_layers": layers}
    cfg = AutoConfig.for_model(body.pop("model_type"), **body)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    model.tie_weights()
    model.save_pretrained(folder)


def _rss() -> dict[str, int]:
    """VmRSS and VmHWM (peak) of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _gather_load(model: Any, path: str) -> int:
    """hpctrain's loader before issue 26: rank 0 reads whole tensors (safetensors mmap), one broadcast each."""
    import glob

    import deepspeed
    import torch
    from safetensors import safe_open

    params = dict(model.named_parameters())
    rank0 = torch.distributed.get_rank() == 0
    read = 0
    for f in sorted(glob.glob(str(Path(path) / "*.safetensors"))):
        with safe_open(f, framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                param = params.get(key)
                if param is None:
                    continue
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                    if rank0:
                        t = fh.get_tensor(key)
                        read += t.numel() * t.element_size()
                        param.copy_(t.to(param.dtype))
    return read


def worker(folder: str, out: str, mode: str) -> None:
    """One rank: build and load under ZeRO-3 in bf16 through hpctrain's build_model; write its figures."""
    from types import SimpleNamespace

    import torch

    from hpctrain.node import dist
    from hpctrain.node.model import build as model

    dist.init_process_group(dist.detect(), use_gpu=False, timeout_min=10)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    spec = SimpleNamespace(path=folder, config="", overrides={}, freeze=())
    cfg = model.hf_config(spec)
    model._import_model_code(cfg)
    torch.distributed.barrier()
    rec: dict[str, Any] = {"rank": torch.distributed.get_rank(), "after_imports": _rss()["VmRSS"]}
    t0 = time.perf_counter()
    if mode == "gather":
        from transformers import AutoModelForCausalLM

        with model._partitioned_construction(ds_config):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.tie_weights()
        rec["built_s"] = time.perf_counter() - t0
        rec["after_build"] = _rss()["VmRSS"]
        rec["bytes_read"] = _gather_load(m, folder)
    else:
        real_load = model.load_partitioned

        def timed_load(mod: Any, path: str) -> Any:  # construction ends where loading starts
            rec["built_s"] = time.perf_counter() - t0
            rec["after_build"] = _rss()["VmRSS"]
            stats = real_load(mod, path)
            rec["bytes_read"] = stats.bytes_read
            return stats

        model.load_partitioned = timed_load  # type: ignore[assignment]
        m = model.build_model(spec, cfg, "bf16", ds_config, zero3=True)
    rec["total_s"] = time.perf_counter() - t0
    rec["load_s"] = rec["total_s"] - rec["built_s"]
    rec["after_load"] = _rss()["VmRSS"]
    rec["peak"] = _rss()["VmHWM"]
    rec["partition_bytes"] = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in m.parameters())
    rec["model_bytes"] = sum(p.ds_numel * p.ds_tensor.element_size() for p in m.parameters())
    rec["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).with_suffix(f".rank{rec['rank']}.json").write_text(json.dumps(rec))
    torch.distributed.barrier()


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hpctrain-load-rss"), help="where the folder is made")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16, help="16: Llama-3.2-1B's shape (1.24 B parameters)")
    ap.add_argument("--mode", choices=["partition", "gather"], default="partition")
    ap.add_argument("--delete", action="store_true", help="remove the folder afterwards")
    ap.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(str(a.dir / "model"), *a.worker)
        return
    folder = a.dir / "model"
    if a.make:
        make_folder(folder, a.layers)
        return
    if not (folder / "config.json").is_file():
        t = time.perf_counter()
        # in a process of its own: its memory (the whole model, once) is not the measured ranks'
        subprocess.run([sys.executable, __file__, "--dir", str(a.dir), "--layers", str(a.layers), "--make"],
                       check=True)
        print(f"[bench] made {folder} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    out = a.dir / f"result-{a.mode}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), __file__, "--dir", str(a.dir),
           "--worker", str(out), a.mode]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=1800)
    wall = time.perf_counter() - t
    rows = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(a.ranks)]
    model_bytes = rows[0]["model_bytes"]
    print(f"\n{folder} ({_gb(on_disk)} GB on disk; model {_gb(model_bytes)} GB in bf16), ZeRO-3, {a.ranks} CPU "
          f"ranks, loader: {a.mode}; launch to exit {wall:.0f} s")
    print(f"{'rank':>4} {'imports GB':>10} {'built GB':>8} {'loaded GB':>9} {'peak GB':>7} {'peak-imports':>12} "
          f"{'partition GB':>12} {'read GB':>7} {'build s':>7} {'load s':>6}")
    for r in rows:
        print(f"{r['rank']:>4} {_gb(r['after_imports']):>10} {_gb(r['after_build']):>8} {_gb(r['after_load']):>9} "
              f"{_gb(r['peak']):>7} {_gb(r['peak'] - r['after_imports']):>12} {_gb(r['partition_bytes']):>12} "
              f"{_gb(r['bytes_read']):>7} {r['built_s']:>7.1f} {r['load_s']:>6.1f}")
    print("RESULT " + json.dumps({"mode": a.mode, "ranks": a.ranks, "model_bytes": model_bytes, "on_disk": on_disk,
                                  "wall_s": round(wall, 1), "rows": rows}))
    if a.delete:
        shutil.rmtree(a.dir)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
