"""The node's data loader: rank start-up time and peak RSS against corpus size, and tokens/s delivered.

Writes two prepared folders with hpctrain.data.format.write_shard (random ids, log-normal document lengths,
median 600 tokens, vocab 32k -> uint16) of --small-gb and --large-gb in --tmp, measures, then deletes them.

  start-up   a fresh process per measurement, as a rank: import the node's data module (torch), build the
             DataSource from a run folder's spec (manifest, index, pieces), plan the epoch, read its first
             micro-batch. Baseline: the in-RAM path (raw jsonl of --raw-mb, read and tokenized by the rank).
  throughput micro-batches of one data-parallel rank (dp 8), packing on, seq 4096 x micro 4 (the 1B H200
             configuration, which consumes ~47k tokens/s per GPU): real tokens/s built into tensors.
             Baseline: the in-RAM DataSource over the same documents held as arrays.

    python bench/loader_bench.py                      # 0.1 GB and 2 GB, ~3 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "toolkit"))
sys.path.insert(0, str(ROOT / "tests"))

from datakit import synthetic_prepared
from runkit import make_run

SEQ, MICRO, DP = 4096, 4, 8
H200_1B_TOKENS_S = 47_000

# Peak RSS from VmHWM, the high-water mark of this process's own memory map: ru_maxrss would also count the
# parent's (Linux carries it across the vfork + exec that subprocess uses), here the 2 GB generator's.
RANK = r"""
import json, sys, time
t0 = time.perf_counter()
from hpctrain.node.data.loader import build_source
from hpctrain.node.runconf import read_spec
from hpctrain.node.data.tokenize import ByteTokenizer
from hpctrain.runs.folder import RunFolder
t1 = time.perf_counter()
spec = read_spec(RunFolder(sys.argv[1]))
src = build_source(spec, ByteTokenizer(), micro=int(sys.argv[2]), vocab=32768)
t2 = time.perf_counter()
src.prefetch(0)  # what node/train.prepare does: the plan is made while the engine is built
n = src.batches_per_epoch()  # waits for the plan
t3 = time.perf_counter()
b = src.batch(int(sys.argv[3]))
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "plan_s": t3 - t2, "batch_s": t4 - t3,
                  "data_s": t4 - t1, "critical_s": t2 - t1 + t4 - t3,
                  "rss_gb": next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")) / 1e6,
                  "pieces": len(src.lengths), "batches": src.batches_per_epoch(), "tokens": b.tokens}))
"""


def rank_startup(run: Path, repeats: int) -> dict[str, float]:
    """Median over fresh processes (the page cache is warm after the first: the index is small)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "toolkit"), "OMP_NUM_THREADS": "1"}
    outs = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, "-c", RANK, str(run), str(MICRO), "3"], capture_output=True,
                              text=True, env=env, timeout=1200, check=True)
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {k: sorted(o[k] for o in outs)[len(outs) // 2] for k in outs[0]}


def throughput(src: object, batches: int, rank: int = 0) -> float:
    """Real tokens per second that one data-parallel rank's batches deliver (plan already built)."""
    src.batch(rank)  # type: ignore[attr-defined]
    t0, tokens = time.perf_counter(), 0
    for k in range(1, batches + 1):
        tokens += src.batch(k * DP + rank).tokens  # type: ignore[attr-defined]
    return tokens / (time.perf_counter() - t0)


def raw_corpus(path: Path, mb: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    words = ["the", "model", "data", "train", "token", "batch", "length", "node", "rank", "step", "loss"]
    with path.open("w") as fh:
        while fh.tell() < mb * 1_000_000:
            k = max(8, int(rng.lognormal(np.log(600), 1.0)))
            fh.write(json.dumps({"text": " ".join(rng.choice(words, size=k // 5))}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small-gb", type=float, default=0.1)
    ap.add_argument("--large-gb", type=float, default=2.0)
    ap.add_argument("--raw-mb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--tmp", default="/tmp/hpctrain-loader-bench")
    a = ap.parse_args()
    tmp = Path(a.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows: list[tuple[str, dict[str, float]]] = []
    try:
        for gb in (a.small_gb, a.large_gb):
            t0 = time.perf_counter()
            m = synthetic_prepared(tmp / f"prep-{gb}", int(gb * 1e9 / 2))  # uint16: 2 bytes a token
            print(f"wrote {gb} GB: {m.train.tokens} tokens, {m.train.documents} documents in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            run = make_run(tmp / f"run-{gb}", data={"source": str(tmp / f"prep-{gb}"), "seq_len": SEQ, "pack": True})
            rows.append((f"prepared {gb} GB", rank_startup(run, a.repeats)))
            print(rows[-1], flush=True)
            if gb == a.small_gb:
                small = run
            else:
                large_tps = lazy_throughput(run, a.batches)
        raw_corpus(tmp / "raw.jsonl", a.raw_mb)
        run = make_run(tmp / "run-raw", data={"source": str(tmp / "raw.jsonl"), "seq_len": SEQ, "pack": True})
        rows.append((f"in-RAM raw jsonl {a.raw_mb} MB (baseline)", rank_startup(run, 1)))
        print(rows[-1], flush=True)
        print_startup(rows)
        print_throughput(small, a.batches, a.small_gb, a.large_gb, large_tps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_startup(rows: list[tuple[str, dict[str, float]]]) -> None:
    print("\n| corpus | pieces | import torch+node (s) | build source (s) | epoch plan (s) | first batch (s) "
          "| data total (s) | critical path, plan overlapped (s) | peak RSS (GB) |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {int(r['pieces'])} | {r['import_s']:.2f} | {r['build_s']:.2f} | {r['plan_s']:.2f} "
              f"| {r['batch_s']:.3f} | {r['data_s']:.2f} | {r['critical_s']:.2f} | {r['rss_gb']:.3f} |")


def lazy_source(run: Path) -> object:
    from hpctrain.node.data.loader import build_source
    from hpctrain.node.data.tokenize import ByteTokenizer
    from hpctrain.node.runconf import read_spec
    from hpctrain.runs.folder import RunFolder

    return build_source(read_spec(RunFolder(run)), ByteTokenizer(), micro=MICRO, vocab=32768)


def lazy_throughput(run: Path, batches: int) -> float:
    return throughput(lazy_source(run), batches)


def print_throughput(run: Path, batches: int, small_gb: float, large_gb: float, large_tps: float) -> None:
    from hpctrain.node.data.loader import DataSource

    lazy: Any = lazy_source(run)
    docs = [lazy.docs[i].astype("int64") for i in range(len(lazy.lengths))]
    in_ram = DataSource(docs, mode="pack", micro=MICRO, seq_len=SEQ, budget=MICRO * SEQ, seed=lazy.seed,
                        pad_id=lazy.pad_id, vocab=32768, lengths=lazy.lengths)
    print(f"\n| loader (pack, seq {SEQ} x micro {MICRO}, rank 0 of dp {DP}) | real tokens/s | x H200 1B need "
          f"({H200_1B_TOKENS_S // 1000}k/s) |\n|---|---|---|")
    for name, src in ((f"in-RAM arrays, {small_gb} GB (baseline)", in_ram),
                      (f"prepared, memory-mapped, {small_gb} GB", lazy)):
        tps = throughput(src, batches)
        print(f"| {name} | {tps:,.0f} | {tps / H200_1B_TOKENS_S:.0f}x |")
    print(f"| prepared, memory-mapped, {large_gb} GB | {large_tps:,.0f} | {large_tps / H200_1B_TOKENS_S:.0f}x |")


if __name__ == "__main__":
    main()
