"""Dynamic batching vs padding on a long-tailed mix of document lengths, through the node entrypoint.

Same documents, same token budget per micro-batch (micro_batch x seq_len), same steps; three runs:
padded (every row padded to seq_len), dynamic (length-bucketed batches filled to the budget), pack
(documents concatenated into seq_len rows, block-diagonal attention). Reports real (non-pad) tokens/s
and the padding fraction from metrics.jsonl. Runs on CPU (default) or one GPU (--gpu).

    python bench/node_dynamic_batching.py --model llama-10m --seq 512 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "toolkit"))
sys.path.insert(0, str(ROOT / "tests"))

from runkit import make_run, metrics, torchrun


def write_corpus(path: Path, n: int, seq: int, seed: int = 0) -> dict[str, float]:
    """Log-normal lengths (median ~seq/6, long tail clipped at 2*seq bytes), words from a small vocabulary."""
    rng = np.random.default_rng(seed)
    words = ["the", "model", "data", "train", "token", "batch", "length", "node", "rank", "step", "loss", "sequence"]
    lengths = np.clip(rng.lognormal(np.log(seq / 6), 0.9, size=n), 8, 2 * seq).astype(int)
    with path.open("w") as fh:
        for k in lengths:
            text = " ".join(rng.choice(words, size=max(1, int(k) // 5)))
            fh.write(json.dumps({"text": text}) + "\n")
    return {"docs": float(n), "median_len": float(np.median(lengths)), "p95_len": float(np.percentile(lengths, 95))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-10m")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--timeout", type=float, default=300, help="per run, seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-dynbatch"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = write_corpus(out / "corpus.jsonl", a.docs, a.seq)
    print(f"corpus: {stats}")
    rows = []
    for mode in ("padded", "dynamic", "pack"):
        data = {"source": str(out / "corpus.jsonl"), "seq_len": a.seq, "dynamic_batching": mode == "dynamic",
                "pack": mode == "pack"}
        run = make_run(out / f"run-{mode}", name=f"dyn-{mode}", model={"config": a.model}, data=data,
                       resources={"gpus_per_node": 1 if a.gpu else 0, "tasks_per_node": 1},
                       train={"steps": a.steps + a.warmup, "micro_batch": a.mb, "grad_accum": 1,
                              "precision": "bf16", "lr": 3e-4, "min_lr": 3e-5},
                       parallel={"zero": 2})
        # runkit.node_env defaults to DS_ACCELERATOR=cpu (the CPU tests); a GPU run must say cuda.
        proc = torchrun(run, 1, timeout=a.timeout, env={"DS_ACCELERATOR": "cuda"} if a.gpu else None)
        if proc.returncode:
            raise SystemExit(f"{mode}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
        steady = metrics(run)[a.warmup:]
        rows.append({"mode": mode, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
                     "padding_frac": statistics.mean(r["padding_frac"] for r in steady),
                     "tokens_per_step": statistics.mean(r["tokens"] for r in steady)})
    base = rows[0]["tokens_per_s"]
    print("| mode | real tokens/s | speed-up | padding | real tokens/step |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{100 * r['padding_frac']:.1f}% | {r['tokens_per_step']:.0f} |")
    (out / "dynamic_batching.json").write_text(json.dumps({"corpus": stats, "args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
