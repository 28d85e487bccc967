"""Prepare throughput: `hpctrain data prepare` against a plain `datasets` pipeline, same corpus, same tokenizer.

Corpus: real text, no downloads: the .py files of Python's standard library and of this venv's
site-packages, one jsonl record per file, repeated until the corpus reaches --mb megabytes. Tokenizer: a
byte-level BPE (vocabulary --vocab) trained with the `tokenizers` library on stdlib sources and saved as a
PreTrainedTokenizerFast folder (tests/datakit.py). Both pipelines do the same work: tokenize every document
without special tokens, append eos, and write the result to disk:

  baseline  load_dataset("json") -> map(tokenizer(batch), batched=True, num_proc=W) -> save_to_disk
  prepare   hpctrain.data.prepare.prepare(..., workers=W)   (hashing the inputs included: a fresh cache)
  floor     the tokenizer alone: encode_batch_fast in W processes on texts already in memory, nothing
            written: the bound on any pipeline with this tokenizer

Each run is a fresh process with fresh output and cache folders; the pipelines alternate, --runs times
each; the table shows medians. tokens/s counts the tokens written (eos included).

    python bench/data_prepare.py --mb 200 --runs 3 --workers 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "toolkit"), str(ROOT / "tests")]


def build_corpus(path: Path, mb: int) -> tuple[int, int]:
    """stdlib + site-packages sources as jsonl, repeated up to `mb` MB; returns (bytes, documents)."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    texts = []
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            try:
                t = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if t.strip():
                texts.append(json.dumps({"text": t}) + "\n")
    target, size, docs = mb << 20, 0, 0
    with path.open("w", encoding="utf-8") as fh:
        while size < target:
            for line in texts:
                fh.write(line)
                size += len(line.encode())
                docs += 1
                if size >= target:
                    break
    return size, docs


def run_baseline(corpus: Path, tok: Path, out: Path, workers: int) -> int:
    import datasets
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tok))
    eos = t.eos_token_id

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = t(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(out / "hf-cache"))
    ds = ds.map(encode, batched=True, num_proc=workers, remove_columns=ds.column_names)
    ds.save_to_disk(str(out / "saved"))
    return int(sum(len(x) for x in ds.with_format("arrow")["input_ids"].to_pylist()))


def run_prepare(corpus: Path, tok: Path, out: Path, workers: int) -> int:
    import os

    os.environ["HPCTRAIN_DATA_CACHE"] = str(out / "cache")  # fresh: the input is hashed, as on a first run
    from hpctrain.data.prepare import Options, prepare

    r = prepare([str(corpus)], str(tok), out / "prepared", Options(val_fraction=0.005), workers=workers,
                progress=False, echo=lambda _: None)
    return r.manifest.tokens + r.manifest.val.tokens


def _encode_part(args: tuple[str, list[str]]) -> int:
    import os

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args[0])
    return sum(len(e.ids) + 1 for e in tok.encode_batch_fast(args[1], add_special_tokens=False))


def run_floor(corpus: Path, tok: Path, out: Path, workers: int) -> int:
    """The tokenizer alone: texts already in memory, `workers` processes, nothing written (what no pipeline beats)."""
    import multiprocessing

    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    parts = [(str(tok / "tokenizer.json"), texts[i::workers]) for i in range(workers)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return sum(pool.map(_encode_part, parts))


def one(kind: str, corpus: Path, tok: Path, work: Path, workers: int) -> dict[str, float]:
    """One run in a fresh process (imports included, as a user's command pays them)."""
    out = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=work))
    argv = [sys.executable, __file__, "--one", kind, "--corpus", str(corpus), "--tokenizer", str(tok),
            "--work", str(out), "--workers", str(workers)]
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    if res.returncode:
        raise SystemExit(f"{kind} failed:\n{res.stdout}\n{res.stderr}")
    tokens = int(res.stdout.strip().splitlines()[-1])
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--work", default="/tmp/hpctrain-bench-prepare")
    ap.add_argument("--one", choices=("baseline", "prepare", "floor"), help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        fn = {"baseline": run_baseline, "prepare": run_prepare, "floor": run_floor}[a.one]
        print(fn(Path(a.corpus), Path(a.tokenizer), Path(a.work), a.workers))
        return
    from datakit import build_tokenizer, stdlib_texts

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus, tok = work / f"corpus-{a.mb}mb.jsonl", work / f"bpe-{a.vocab}"
    if not corpus.exists():
        size, docs = build_corpus(corpus, a.mb)
        print(f"corpus {corpus}: {size / 1e6:.0f} MB, {docs} documents")
    if not (tok / "tokenizer.json").exists():
        build_tokenizer(tok, vocab_size=a.vocab, texts=stdlib_texts(400))
    rows: dict[str, list[dict[str, float]]] = {"baseline": [], "prepare": [], "floor": []}
    for i in range(a.runs):
        for kind in ("baseline", "prepare", "floor") if i % 2 == 0 else ("floor", "prepare", "baseline"):
            r = one(kind, corpus, tok, work, a.workers)
            rows[kind].append(r)
            print(f"run {i + 1} {kind}: {r['seconds']:.1f}s, {r['tokens']:,} tokens, {r['tokens_per_s']:,.0f} tokens/s",
                  flush=True)
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in rows.items()}
    print(f"\ncorpus {corpus.stat().st_size / 1e6:.0f} MB, BPE vocab {a.vocab}, {a.workers} workers, {a.runs} "
          "alternating runs each (medians)\n")
    print("| pipeline | seconds (runs) | tokens | tokens/s (median) | vs baseline |")
    print("| --- | --- | --- | --- | --- |")
    names = {"baseline": "datasets: load_dataset + map(num_proc) + save_to_disk", "prepare": "hpctrain data prepare",
             "floor": "the tokenizer alone (texts in RAM, nothing written)"}
    for k, v in rows.items():
        secs = ", ".join(f"{r['seconds']:.1f}" for r in v)
        print(f"| {names[k]} | {secs} | {int(v[0]['tokens']):,} | {med[k]:,.0f} | {med[k] / med['baseline']:.2f}x |")
    print("RESULT " + json.dumps({"mb": a.mb, "workers": a.workers, "vocab": a.vocab, "runs": rows,
                                  "speedup": med["prepare"] / med["baseline"]}))


if __name__ == "__main__":
    main()
