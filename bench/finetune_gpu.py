"""Fine-tuning on one H200 (issue 26 item 5): start-up, packed SFT vs synthetic, LoRA vs full, hpctrain vs a
padded DeepSpeed loop, in one device call of at most ~9 minutes each.

Device calls (the H200 machine: one H200, 16 cores, ~125 GiB, 64 GB disk, no network). The setup installs the
carried wheels under .whl/ (deepspeed 0.19.8, pydantic 2.14.4 + pydantic-core, annotated-types,
typing-inspection, typing-extensions, hjson, submitit 1.5.4, tomli-w, and peft 0.21.2 for the LoRA rows; the
image has torch 2.11 cu130, transformers 5.17, tokenizers, safetensors; `datasets` is not needed: the data are
jsonl files):

    # One call holds the asset build (~1 min) and two 8B runs (~3 min each: ~150 s to step 1, then 3 steps).
    # Every hpctrain run also gives a start-up row. Calls 5-8 repeat 1-4 with each pair's order swapped.
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --runs sft:packed-sdpa,sft:synthetic --out $OUT
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --runs sft:packed-flex,sft:packed-sdpa --out $OUT
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --runs lora:lora,lora:full --out $OUT
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --runs padded:padded-ds,padded:packed-sdpa --out $OUT
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --cases sft --fixed --out $OUT   # fixed flags
    python bench/finetune_gpu.py --tables-from c1/suite.jsonl,c2/suite.jsonl --out merged   # the calls' rows pooled
    python bench/finetune_gpu.py --cpu --out /tmp/ft-suite      # every variant, tiny llama, on this CPU

    # In-process alternation (bench/gpu/ft_alternate.py; what BENCHMARKS.md's 2026-12-03 section ran): one
    # engine per process, windows of steps alternating variants that differ only in data or attention kernel.
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --cold --alternate \
        lora:packed,full:synthetic+packed-sdpa+packed-flex --alt-cap-s 130 --rounds 3 --steps 2 \
        --budget-s 570 --out $OUT
    # The second session's calls (BENCHMARKS.md): window modifiers ".fused" (bench/gpu/lora_fused.py) and ".nodrop"
    # (LoRA dropout off) on one LoRA engine; --profile (cProfile of the engine phase, torch.profiler of one step);
    # --fast-init (then a prototype, bench/gpu/fast_init.py; now the node's hpctrain.node.model.fast_init, on by
    # default: the variant full-auto-ds-init turns it off);
    # --padded-mb (the padded loop at a micro-batch it fits, the same global batch).
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --alternate \
        full-auto:packed,lora-auto:packed+packed.fused+packed.fused.nodrop --profile both --alt-cap-s 240 --rounds 3 \
        --steps 2 --budget-s 545 --out $OUT
    source bench/gpu/setup.sh && python bench/finetune_gpu.py --profile lora --alternate \
        full-auto:synthetic,lora-auto:packed --alt-cap-s 170 --rounds 2 --steps 2 --budget-s 550 --out $OUT

What it does. First it makes its inputs on the machine (bench/gpu/ft_assets.py, kept across calls under
--assets while the machine stays warm): a Llama-3.1-8B-shaped local folder with random bf16 weights written shard
by shard (the host never holds more than one 2 GB shard), `pad_token_id` in config.json, and a byte-level BPE
tokenizer of exactly the model's 128,256 ids with a chat template saved beside it; SFT data as chat.jsonl and
alpaca.jsonl (the same 6,000 examples, log-normal prompt and response lengths, mean ~280 tokens, a long tail).
On a GPU it JIT-builds DeepSpeed's CPU Adam in the background meanwhile (50 s on first use).

Every hpctrain run is the user's own path: a RUN.toml written here, `python -m hpctrain submit RUN.toml
--executor local --json`, the job polled until its controller ends. Variants (the `[model]`/`[data]`/`[lora]`
tables differ; the plan is the planner's choice for global batch 16 x 4096, or --fixed's flags):

    packed-sdpa   [data] format = "chat", pack = true, [model] attention = "sdpa"
    packed-flex   the same with attention = "flex_attention" (transformers' block mask from packed position_ids)
    synthetic     [data] source = "synthetic" at the same plan
    lora          packed-sdpa with [lora] r = 16
    full          packed-sdpa (the full fine-tune beside lora; its rows pool with packed-sdpa's)
    padded-ds     bench/gpu/padded_ds.py: DeepSpeed's example's way (every example padded to seq_len, ZeRO-3,
                  from_pretrained under HfDeepSpeedConfig) at the ZeRO stage, offload ratio and micro-batch x
                  accumulation of hpctrain's plan for packed-sdpa

Cases alternate their variants in fresh processes, the order rotated each round; tables give medians. No run
starts that would end past --budget-s. Start-up parts come from every hpctrain run: submit (the CLI, plan,
render, submitit's controller) up to the rank's process start, then the rank's own phases (its `start` event:
entry, preflight, prepare = torch/transformers/tokenizer/data, process group, engine) with the engine phase split
by the rank log's "model built in X s; loaded ... in Y s" line into model build, weights load and engine init
(deepspeed.initialize, CPU Adam), then step 1. Response tokens/s: hpctrain's metrics count every real (non-pad)
token of a packed row; the response share is the data's (assets.json, under the chat template) unless the
metrics carry a loss-token count. Epoch time: the data's tokens / real tokens/s (hpctrain), examples / examples
per step x step s (padded loop).

Files under --out (a device call brings back at most 8): suite.jsonl (a row per run, written as it ends),
suite.md (the tables), assets.json, logs.tar.gz (every run's logs, metrics, events, plan, spec, ds_config).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "toolkit"))

PEAK_TFLOPS = 788.0  # measured bf16 matmul on the H200 (device notes)
# --fixed: the 8B planner's choice measured on 2026-12-02 (z3, optimizer offload 0.3, 4 x 4, recompute).
FIXED = {"zero": 3, "offload": "optimizer", "offload_ratio": 0.3, "micro_batch": 4, "grad_accum": 4, "ac": True}


@dataclass(frozen=True)
class Variant:
    kind: str = "hpctrain"  # or "padded" (bench/gpu/padded_ds.py)
    data: str = "sft"  # "sft" (the chat/alpaca file, packed), "prepared" (it, `data prepare`d) or "synthetic"
    attention: str = "sdpa"
    lora_r: int = 0
    kernels: str = "none"  # [model] kernels ("liger": hpctrain.node.model.kernels)
    fast_init: bool = True  # False: HPCTRAIN_FAST_INIT=0 (DeepSpeed's own ZeRO-3 offload engine build)
    load_threads: int = 0  # HPCTRAIN_LOAD_THREADS (0: the node's default; 1: the weights read one after another)


VARIANTS: dict[str, Variant] = {
    "packed-sdpa": Variant(),
    "packed-flex": Variant(attention="flex_attention"),
    "synthetic": Variant(data="synthetic"),
    "lora": Variant(lora_r=16),
    "full": Variant(),
    "padded-ds": Variant(kind="padded"),
    # [model] attention = "auto" (packed rows on a GPU rank: FlexAttention), the run file a user writes.
    "full-auto": Variant(attention="auto"),
    "lora-auto": Variant(attention="auto", lora_r=16),
    # [model] kernels = "liger" (Liger Kernel's fused norms, RoPE, SwiGLU and linear cross-entropy), and the
    # full fine-tune with DeepSpeed's own engine build (the start-up A/B of hpctrain.node.model.fast_init).
    "lora-liger": Variant(attention="auto", lora_r=16, kernels="liger"),
    "full-liger": Variant(attention="auto", kernels="liger"),
    "full-auto-ds-init": Variant(attention="auto", fast_init=False),
    # The ZeRO-3 weights read by one thread (the loader before 2026-12-03's fifth session): the start-up A/B of
    # hpctrain.node.model.build.load_threads.
    "full-auto-load1": Variant(attention="auto", load_threads=1),
    # The same SFT file tokenized once ahead by `hpctrain data prepare` (docs/finetune.md's advice for large data):
    # the rank memory-maps tokens and masks instead of rendering every chat record at start-up.
    "full-auto-prepared": Variant(attention="auto", data="prepared"),
}


@dataclass(frozen=True)
class Case:
    variants: tuple[str, ...]
    rounds: int
    note: str


CASES: dict[str, Case] = {
    "startup": Case(("full-auto", "full-auto-prepared", "full-auto-load1"), 1,
                    "process start to step 1 through `hpctrain submit --executor local`"),
    "sft": Case(("packed-sdpa", "packed-flex", "synthetic"), 2, "packed SFT (sdpa, flex) vs synthetic, same plan"),
    "lora": Case(("lora", "full"), 2, "LoRA r=16 vs the full fine-tune, packed SFT"),
    "padded": Case(("padded-ds", "packed-sdpa"), 2, "DeepSpeed's padded fine-tuning loop vs hpctrain's packed SFT"),
}


# ------------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class Setup:
    """What every run of one invocation shares."""

    cpu: bool
    assets: Path
    work: Path
    seq: int
    global_batch: int
    steps: int  # timed steps after the warm-up
    warmup: int
    fixed: bool
    fmt: str  # "chat" or "alpaca"
    rounds: int = 3  # --alternate: windows of each variant
    profile: str = ""  # --profile: "both" (cProfile of the engine phase, torch.profiler of one step) or "step"
    compile_cache: str = ""  # HPCTRAIN_COMPILE_CACHE of every run ("": the node's default)
    padded_mb: int = 0  # the padded loop's micro-batch (accumulation from the global batch); 0: hpctrain's plan
    est_s: float = 0  # --est-s: one run's expected wall time for the budget (0: est_s's rule)


def hp_tables(s: Setup, name: str, v: Variant) -> dict[str, Any]:
    """The run file of one hpctrain variant (TOML tables)."""
    model = str(s.assets / "model")
    data: dict[str, Any] = {"source": "synthetic", "seq_len": s.seq}
    if v.data == "sft":
        data = {"source": str(s.assets / f"{s.fmt}.jsonl"), "format": s.fmt, "tokenizer": model, "seq_len": s.seq,
                "pack": True, "max_raw_bytes": 0}
        if s.fmt == "chat":
            data["messages_field"] = "messages"
    elif v.data == "prepared":
        data = {"source": str(prepared_path(s)), "format": "prepared", "tokenizer": model, "seq_len": s.seq,
                "pack": True}
    res: dict[str, Any] = {"nodes": 1, "gpus_per_node": 0 if s.cpu else 1, "tasks_per_node": 1, "time": "00:30:00"}
    if not s.cpu:  # one H200: 139 GiB usable; the host's 125 GiB; its 16 cores
        res.update({"gpu_mem_gb": 139.0, "mem": "125G", "cpus_per_task": os.cpu_count() or 1})
    train: dict[str, Any] = {"steps": s.warmup + s.steps, "lr": 1e-5, "min_lr": 1e-6, "warmup_steps": 0,
                             "precision": "bf16", "peak_tflops": 0.0 if s.cpu else PEAK_TFLOPS}
    par: dict[str, Any]
    if s.fixed:
        f = FIXED if not s.cpu else {**FIXED, "offload": "none", "micro_batch": 2, "grad_accum": 2}
        train.update({"micro_batch": f["micro_batch"], "grad_accum": f["grad_accum"],
                      "activation_checkpointing": f["ac"]})
        par = {"zero": f["zero"], "offload": f["offload"],
               **({"offload_ratio": f["offload_ratio"]} if f["offload"] != "none" else {})}
    else:
        train.update({"global_batch": s.global_batch, "micro_batch": 0, "grad_accum": 0,
                      "activation_checkpointing": "auto"})
        # On the CPU the planner picks ZeRO-0 for the tiny model: ZeRO-3 is fixed there so the smoke test takes
        # the 8B's path (weights loaded into a partitioned model, the engine phase split).
        par = {"zero": 3} if s.cpu else {"zero": "auto", "offload_ratio": "auto"}
    tables: dict[str, Any] = {
        "name": f"ft-{name}", "resources": res, "data": data,
        "model": {"path": model, "attention": v.attention, **({"kernels": v.kernels} if v.kernels != "none" else {})},
        "train": train, "parallel": par, "checkpoint": {"every_steps": 0, "keep": 1, "export_hf": False},
        # No tracker: the GPU image has no tensorboard, and the padded loop writes none either.
        "tracking": {"backends": []},
    }
    if v.lora_r:
        tables["lora"] = {"r": v.lora_r}
    return tables


def prepared_path(s: Setup) -> Path:
    """Where prepare_data puts the SFT file tokenized by `hpctrain data prepare` (the prepared variants' source)."""
    return s.assets / f"prepared-{s.fmt}-{s.seq}"


def prepare_data(s: Setup) -> Path:
    """The SFT file through `hpctrain data prepare`, once per assets folder (a cache hit after that), before any
    run; its time is the report's `prepare_data_s` (paid once ahead, not at each start)."""
    out = prepared_path(s)
    if (out / "manifest.json").exists():
        return out
    t0 = time.time()
    cmd = [sys.executable, "-m", "hpctrain", "data", "prepare", str(s.assets / f"{s.fmt}.jsonl"), "--format", s.fmt,
           "--seq-len", str(s.seq), "--tokenizer", str(s.assets / "model"), "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                          env=env_for(s, s.work / "runs"), cwd=str(ROOT))
    if proc.returncode:
        raise RunFailed(proc.returncode, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    out.with_suffix(".json").write_text(json.dumps(
        {"prepare_data_s": round(time.time() - t0, 1), "command": cmd[1:], "stdout": proc.stdout[-2000:]}))
    return out


def write_runfile(path: Path, tables: dict[str, Any]) -> Path:
    import tomli_w

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(tables))
    return path


def env_for(s: Setup, runs: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "RANK", "LOCAL_RANK",
                                                                      "WORLD_SIZE", "MASTER_"))}
    env.update({"PYTHONUNBUFFERED": "1", "HPCTRAIN_RUNS_DIR": str(runs), "HPCTRAIN_STATE_DIR": str(s.work / "state"),
                "HF_HUB_OFFLINE": "1", "NCCL_NVLS_ENABLE": "0"})
    env["PYTHONPATH"] = str(ROOT / "toolkit") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if s.cpu:
        env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    if s.compile_cache:
        env["HPCTRAIN_COMPILE_CACHE"] = s.compile_cache
    return env


# ------------------------------------------------------------------------------------------------ runs
def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (the job's controller and its ranks: processes this script started)."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += kids.get(p, [])
    for p in seen:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def run_hpctrain(s: Setup, name: str, v: Variant, tag: str, timeout: float) -> dict[str, Any]:
    """`hpctrain submit RUN.toml --executor local`, waited for; the figures of its run folder."""
    from hpctrain.slurm.dispatch import local_state

    runs = s.work / "runs"
    runfile = write_runfile(s.work / "runfiles" / f"{tag}.toml", hp_tables(s, name, v))
    t0 = time.time()
    env = env_for(s, runs)
    if v.load_threads:
        env["HPCTRAIN_LOAD_THREADS"] = str(v.load_threads)
    if not v.fast_init:
        env["HPCTRAIN_FAST_INIT"] = "0"
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "submit", str(runfile), "--executor", "local", "--json"],
                          capture_output=True, text=True, timeout=120, check=False, env=env, cwd=str(ROOT))
    if proc.returncode:
        raise RunFailed(proc.returncode, proc.stdout + proc.stderr)
    sub = json.loads(proc.stdout)[0]
    run, job = Path(sub["run_dir"]), str(sub["job_id"])
    while local_state(run, job)[0] == "RUNNING":
        if time.time() - t0 > timeout:
            kill_tree(int(job))
            raise RunFailed(124, f"timed out after {timeout:.0f} s\n" + rank_log_tail(run), run)
        time.sleep(2)
    state, why = local_state(run, job)
    recs = read_metrics(run)
    if state != "COMPLETED" or len(recs) <= s.warmup:
        raise RunFailed(1, f"{state} ({why}); {len(recs)} steps\n" + rank_log_tail(run), run)
    return {"run_dir": str(run), **hp_figures(run, recs, s, t0)}


class RunFailed(Exception):
    def __init__(self, rc: int, text: str, run: Path | None = None) -> None:
        super().__init__(text)
        self.rc, self.text, self.run = rc, text, run


def read_metrics(run: Path) -> list[dict[str, Any]]:
    from hpctrain.collect.metrics import read_metrics as read

    return list(read(run / "metrics" / "metrics.jsonl")[0])


def rank_log_tail(run: Path, n: int = 30) -> str:
    logs = sorted((run / "logs").glob("attempt-*.rank-0.log")) + sorted((run / "submitit").glob("*_0_log.err"))
    return "\n".join("\n".join(p.read_text(errors="replace").splitlines()[-n:]) for p in logs)


def start_event(run: Path) -> dict[str, Any]:
    """The rank's training `start` record (its startup phases), from events.jsonl."""
    for line in (run / "events.jsonl").read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        extra = e.get("extra") or e
        if extra.get("event") == "start" and "startup" in extra:
            return dict(extra)
    return {}


BUILT = re.compile(r"model built in ([\d.]+) s; loaded \d+ tensors, ([\d.]+) GB read by this rank in ([\d.]+) s")


def startup_parts(run: Path, t_submit: float, step1_end: float) -> dict[str, float]:
    """Seconds of each part of getting to step 1 (see the module's docstring)."""
    ph = start_event(run).get("startup") or {}
    out: dict[str, float] = {}
    if ph.get("process_start"):
        out["submit_s"] = round(float(ph["process_start"]) - t_submit, 2)
    for k in ("entry_s", "preflight_s", "prepare_s", "process_group_s", "engine_s", "load_s"):
        if k in ph:
            out[k] = float(ph[k])
    text = "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("attempt-*.rank-0.log")))
    m = BUILT.search(text)
    if m and "engine_s" in out:
        out["model_build_s"], out["weights_gb"], out["weights_load_s"] = float(m[1]), float(m[2]), float(m[3])
        out["engine_init_s"] = round(out["engine_s"] - out["model_build_s"] - out["weights_load_s"], 2)
    if ph.get("process_start") and ph.get("total_s") is not None:
        out["first_step_s"] = round(step1_end - float(ph["process_start"]) - float(ph["total_s"]), 2)
    out["to_step1_s"] = round(step1_end - t_submit, 2)
    return out


def data_stats(s: Setup) -> dict[str, Any]:
    return dict(json.loads((s.assets / "assets.json").read_text())["data"])


LOSS_TOKEN_KEYS = ("loss_tokens", "label_tokens", "response_tokens", "target_tokens")


def hp_figures(run: Path, recs: list[dict[str, Any]], s: Setup, t_submit: float) -> dict[str, Any]:
    steady = recs[s.warmup:]
    med = lambda k: statistics.median(float(r.get(k) or 0.0) for r in steady)
    step_s = statistics.median(float(r["tokens"]) / float(r["tokens_per_s"]) for r in steady if r.get("tokens_per_s"))
    plan = json.loads((run / "plan.json").read_text())
    spec_text = (run / "spec.toml").read_text()
    synthetic = 'source = "synthetic"' in spec_text
    d = data_stats(s)
    tps = med("tokens_per_s")
    key = next((k for k in LOSS_TOKEN_KEYS if k in steady[0]), "")
    if steady[0].get("trained_tokens_per_s") is not None:  # the node's own count of the labels the loss saw
        resp_tps, resp_how = med("trained_tokens_per_s"), "metrics trained_tokens_per_s"
    elif synthetic:
        resp_tps, resp_how = tps, "every token"
    elif key:
        resp_tps, resp_how = statistics.median(float(r[key]) * float(r["tokens_per_s"]) / float(r["tokens"])
                                               for r in steady), f"metrics {key}"
    else:
        resp_tps, resp_how = tps * float(d["response_frac"]), f"x data response share {d['response_frac']}"
    return {
        "impl": "hpctrain", "step_s": round(step_s, 4),
        "runs_s": [round(float(r["tokens"]) / float(r["tokens_per_s"]), 3) for r in steady if r.get("tokens_per_s")],
        "tokens_per_s": round(tps, 1), "response_tokens_per_s": round(resp_tps, 1), "response_how": resp_how,
        "padding_frac": round(med("padding_frac"), 4), "model_tflops": round(med("tflops"), 1),
        "mfu": round(med("mfu"), 3) if steady[0].get("mfu") is not None else None,
        "epoch_s": None if synthetic else round(float(d["tokens"]) / tps, 1) if tps else None,
        "gpu_peak_gb": round(max(float(r.get("gpu_mem_gb") or 0.0) for r in recs), 1),
        "host_peak_gb": round(max(float(r.get("host_peak_gb") or 0.0) for r in recs), 1),
        "first_loss": round(float(recs[0]["loss"]), 3), "last_loss": round(float(recs[-1]["loss"]), 3),
        "chosen": chosen_of(plan), "startup": startup_parts(run, t_submit, float(recs[0]["time"])),
        "attention": attention_line(run),
    }


def attention_line(run: Path) -> str:
    text = "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("attempt-*.rank-0.log")))
    found = re.findall(r"attention: (.*)", text)
    return found[-1] if found else ""


def chosen_of(plan: dict[str, Any]) -> dict[str, Any]:
    """The settings a plan resolved, as the padded loop takes them."""
    offload = str(plan.get("offload", "none"))
    return {"zero": int(plan["zero_stage"]), "offload": "optimizer" if offload in ("optimizer", "all") else "none",
            "ratio": float(plan.get("offload_ratio") or 1.0), "mb": int(plan["micro_batch"]),
            "accum": int(plan["grad_accum"]), "ac": bool(plan.get("activation_checkpointing"))}


def planned(s: Setup, env: dict[str, str]) -> dict[str, Any]:
    """hpctrain's plan for packed-sdpa (`hpctrain plan --json`): what the padded loop runs at."""
    runfile = write_runfile(s.work / "runfiles" / "plan-packed-sdpa.toml",
                            hp_tables(s, "plan", VARIANTS["packed-sdpa"]))
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "plan", str(runfile), "--json"], capture_output=True,
                          text=True, timeout=120, check=False, env=env, cwd=str(ROOT))
    if proc.returncode:
        raise RunFailed(proc.returncode, "hpctrain plan: " + proc.stdout + proc.stderr)
    return chosen_of(json.loads(proc.stdout))


def run_padded(s: Setup, tag: str, timeout: float) -> dict[str, Any]:
    from hpctrain.node.dist import free_port

    env = env_for(s, s.work / "runs")
    ch = planned(s, env)
    if s.padded_mb:  # hpctrain's plan ran out of GPU memory in the padded loop (2026-12-03): the same global batch
        ch = {**ch, "mb": s.padded_mb, "accum": max(1, s.global_batch // s.padded_mb)}
    log = s.work / "logs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           str(BENCH / "gpu" / "padded_ds.py"), "--model-dir", str(s.assets / "model"),
           "--data", str(s.assets / "chat.jsonl"), "--seq", str(s.seq), "--mb", str(ch["mb"]), "--accum",
           str(ch["accum"]), "--zero", "3", "--offload", ch["offload"], "--ratio", str(ch["ratio"]),
           "--steps", str(s.steps), "--warmup", str(s.warmup), *([] if ch["ac"] else ["--no-ac"]),
           *(["--cpu"] if s.cpu else [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env,
                              cwd=str(ROOT), start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        raise RunFailed(124, f"timed out after {timeout:.0f} s\n" + _text(exc.stdout)[-3000:]
                        + _text(exc.stderr)[-3000:]) from exc
    log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RunFailed(proc.returncode or 1, (proc.stdout + proc.stderr)[-4000:])
    out = dict(json.loads(lines[-1][7:]))
    out["chosen"] = {**ch, "zero": 3}
    return out


def _text(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run_one(s: Setup, case: str, variant: str, rnd: int, timeout: float) -> dict[str, Any]:
    tag = f"{case}-{variant}-{rnd}".replace(":", "-").replace("+", "-")
    t0 = time.time()
    row: dict[str, Any] = {"case": case, "variant": variant, "round": rnd, "rc": 0}
    try:
        if case == "alt":
            row["result"] = run_alternate(s, variant, tag, timeout)
        else:
            v = VARIANTS[variant]
            row["result"] = (run_padded(s, tag, timeout) if v.kind == "padded"
                             else run_hpctrain(s, case, v, tag, timeout))
        row["error_tail"] = ""
    except RunFailed as exc:
        row.update({"rc": exc.rc, "result": {"run_dir": str(exc.run) if exc.run else ""},
                    "error_tail": "\n".join(exc.text.splitlines()[-15:])})
    row.update({"wall_s": round(time.time() - t0, 1), "utc": datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")})
    return row


def run_alternate(s: Setup, spec: str, tag: str, timeout: float) -> dict[str, Any]:
    """One process of bench/gpu/ft_alternate.py: the run file of RUNFILE_VARIANT rendered by `hpctrain submit
    --dry-run`, then windows of the listed variants alternating inside that one engine ("full:a+b+c")."""
    name, _, wins = spec.partition(":")
    env = env_for(s, s.work / "runs")
    runfile = write_runfile(s.work / "runfiles" / f"{tag}.toml", hp_tables(s, name, VARIANTS[name]))
    dry = s.work / "dry" / tag
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "submit", str(runfile), "--dry-run", "--out", str(dry)],
                          capture_output=True, text=True, timeout=120, check=False, env=env, cwd=str(ROOT))
    if proc.returncode:
        raise RunFailed(proc.returncode, "hpctrain submit --dry-run: " + proc.stdout + proc.stderr)
    res, log = s.work / f"{tag}.json", s.work / "logs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(BENCH / "gpu" / "ft_alternate.py"), "--run-dir", str(dry), "--variants",
           wins.replace("+", ","), "--rounds", str(s.rounds), "--steps", str(s.steps), "--warmup", str(s.warmup),
           "--budget-s", str(max(30.0, timeout - 15)), "--out", str(res)]
    if not VARIANTS[name].fast_init:
        cmd += ["--no-fast-init"]
    if s.profile == "both":
        cmd += ["--profile-engine", str(s.work / "logs" / f"{tag}.engine-profile.txt")]
    if s.profile and (s.profile != "lora" or VARIANTS[name].lora_r):
        cmd += ["--profile-step", str(s.work / "logs" / f"{tag}.step-profile.txt")]
    try:
        with log.open("w") as fh:
            p = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, check=False, env=env,
                               cwd=str(ROOT), start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        if not res.exists():  # else: keep the windows it finished (it writes its result after each)
            raise RunFailed(124, f"timed out after {timeout:.0f} s\n"
                            + log.read_text(errors="replace")[-3000:]) from exc
    else:
        if p.returncode or not res.exists():
            raise RunFailed(p.returncode or 1, log.read_text(errors="replace")[-4000:])
    out = dict(json.loads(res.read_text()))
    out["chosen"] = chosen_of(json.loads((dry / "plan.json").read_text()))
    out.pop("steps_rows", None)
    return out


def alt_tables(rows: list[dict[str, Any]]) -> list[str]:
    """One table per ft_alternate process: each variant's windows (medians of their steps) and the median."""
    out: list[str] = []
    for r in rows:
        if r["case"] != "alt" or r["rc"]:
            continue
        res = r["result"]
        summ = res.get("summary", {})
        base = summ.get("synthetic", {}).get("step_s")
        out += [f"### {r['variant']} (round {r['round']}; plan {_chosen([res])}, LoRA r={res.get('lora_r')})", "",
                ("| variant | windows (median step s each) | median step s | x synthetic | tok/s | trained tok/s | "
                 "padding | GPU peak GB |"), "|---|---|---|---|---|---|---|---|"]
        for v, f in summ.items():
            ratio = f"{f['step_s'] / base:.3f}" if base else "-"
            out.append(f"| {v} | {', '.join(f'{w:.3f}' for w in f['windows_s'])} | {f['step_s']:.3f} | {ratio} | "
                       f"{f['tokens_per_s']:,.0f} | {f['trained_per_s']:,.0f} | {f['padding_frac']:.1%} | "
                       f"{f['gpu_peak_gb']} |")
        st = res.get("startup", {})
        out += ["", "Start-up (s): " + ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in st.items()), ""]
    return out


# ------------------------------------------------------------------------------------------------ schedule
def schedule(names: tuple[str, ...], rounds: int) -> list[tuple[str, int]]:
    """(variant, round) in run order: each round runs every variant once, the order rotated by one each round."""
    out = []
    for rnd in range(rounds):
        k = rnd % len(names)
        out += [(v, rnd) for v in names[k:] + names[:k]]
    return out


def expand(cases: list[str], runs: list[str], rounds: int) -> list[tuple[str, str, int]]:
    """(case, variant, round): every round of each case, then single runs "case:variant"."""
    out: list[tuple[str, str, int]] = []
    for c in cases:
        out += [(c, v, r) for v, r in schedule(CASES[c].variants, rounds or CASES[c].rounds)]
    for tok in runs:
        c, _, v = tok.partition(":")
        if c not in CASES or v not in CASES[c].variants:
            raise SystemExit(f"--runs {tok}: use CASE:VARIANT with " + "; ".join(
                f"{k}: {', '.join(x.variants)}" for k, x in CASES.items()))
        out.append((c, v, sum(1 for cc, vv, _ in out if (cc, vv) == (c, v))))
    return out


def est_s(s: Setup, variant: str) -> float:
    """One run's expected wall time, start to end (the budget's unit): 8B ~150 s to step 1, ~10 s a step."""
    if s.est_s:
        return s.est_s
    if s.cpu:
        return 60.0
    if ":" in variant:  # an ft_alternate process: it stops its windows at the budget itself
        return 100.0 if VARIANTS[variant.split(":")[0]].lora_r else 200.0
    return 150.0 + 11.0 * (s.warmup + s.steps) * (0.5 if VARIANTS[variant].lora_r else 1.0)


# ------------------------------------------------------------------------------------------------ tables
def _ok(rows: list[dict[str, Any]], *variants: str, case: str = "") -> dict[str, list[dict[str, Any]]]:
    per: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in rows:
        if r["rc"] == 0 and r["variant"] in per and (not case or r["case"] == case):
            per[r["variant"]].append(r["result"])
    return per


def _med(fs: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(f[key]) for f in fs if f.get(key) is not None]
    return statistics.median(vals) if vals else None


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def _chosen(fs: list[dict[str, Any]]) -> str:
    ch = fs[0].get("chosen") if fs else None
    return (f"z{ch['zero']} {ch['offload']} r{ch['ratio']} {ch['mb']}x{ch['accum']} ac={ch['ac']}") if ch else "-"


def speed_table(per: dict[str, list[dict[str, Any]]], base: str) -> list[str]:
    """Median step s, tokens/s, response tokens/s, epoch, memory; x `base` on step time and response tokens/s."""
    out = ["| variant | n | median step s (runs) | tok/s | response tok/s | x " + base + " (step) | x " + base
           + " (resp tok/s) | padding | epoch s | TFLOPS | GPU GB | host GB | loss first->last | plan |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    b_step, b_resp = _med(per.get(base, []), "step_s"), _med(per.get(base, []), "response_tokens_per_s")
    for v, fs in per.items():
        if not fs:
            continue
        step, resp = _med(fs, "step_s"), _med(fs, "response_tokens_per_s")
        runs = ", ".join(f"{f['step_s']:.3f}" for f in fs)
        tok = _med(fs, "tokens_per_s") or _med(fs, "real_tokens_per_s")
        out.append(f"| {v} | {len(fs)} | {_fmt(step, '.3f')} ({runs}) | {_fmt(tok)} | {_fmt(resp)} | "
                   f"{_fmt(step / b_step if step and b_step else None, '.3f')} | "
                   f"{_fmt(resp / b_resp if resp and b_resp else None, '.2f')} | "
                   f"{_fmt(_med(fs, 'padding_frac'), '.1%')} | "
                   f"{_fmt(_med(fs, 'epoch_s'))} | {_fmt(_med(fs, 'model_tflops'))} | "
                   f"{_fmt(_med(fs, 'gpu_peak_gb'), '.1f')} | "
                   f"{_fmt(_med(fs, 'host_peak_gb'), '.1f')} | {fs[0].get('first_loss')}->{fs[-1].get('last_loss')} | "
                   f"{_chosen(fs)} |")
    return out


# (key, column): the engine phase is model build + weights load + engine init when the rank logs the first two
# (ZeRO-3's partitioned load); "resume" is the checkpoint load (none here).
STARTUP_PARTS = (("submit_s", "submit"), ("entry_s", "entry"), ("preflight_s", "preflight"), ("prepare_s", "prepare"),
                 ("process_group_s", "process group"), ("engine_s", "engine phase"), ("model_build_s", "model build"),
                 ("weights_load_s", "weights load"), ("engine_init_s", "engine init"), ("load_s", "resume"),
                 ("first_step_s", "first step"), ("to_step1_s", "to step 1"))


def startup_table(rows: list[dict[str, Any]]) -> list[str]:
    """Medians of each start-up part per hpctrain variant (every hpctrain run has them)."""
    per: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        st = (r.get("result") or {}).get("startup")
        if r["rc"] == 0 and st:
            per.setdefault(r["variant"], []).append(st)
    if not per:
        return []
    out = ["| variant | n | " + " | ".join(c for _, c in STARTUP_PARTS) + " |",
           "|---|---|" + "---|" * len(STARTUP_PARTS)]
    for v, sts in per.items():
        out.append(f"| {v} | {len(sts)} | " + " | ".join(_fmt(_med(sts, k), ".1f") for k, _ in STARTUP_PARTS) + " |")
    return out + ["", ("submit: `hpctrain submit` start to the rank's process start (CLI, plan, render, submitit); "
                  "entry: interpreter and hpctrain's imports; prepare: torch, transformers, tokenizer, data; "
                  "engine init: deepspeed.initialize with the optimizer (CPU Adam) and the rest of the engine phase; "
                  "first step: the rank's start event to step 1's end; to step1: submit start to step 1's end.")]


def report(rows: list[dict[str, Any]], skipped: list[str], argv: list[str], assets: dict[str, Any]) -> str:
    gpu = "cpu"
    with contextlib.suppress(OSError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout.strip() or gpu
    d = assets.get("data", {})
    lines = [f"# bench/finetune_gpu.py, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", "",
             f"Machine: {gpu}; {os.cpu_count()} cores; {platform.platform()}.",
             f"Command: `python bench/finetune_gpu.py {' '.join(argv)}`", "",
             (f"Model: {assets.get('model')} shape, {assets.get('params', 0) / 1e9:.2f} B params, vocab "
             f"{assets.get('vocab')} (tokenizer = model), {assets.get('shards')} shards; built in "
             f"{assets.get('weights_s')} s (+ tokenizer {assets.get('tokenizer_s')} s, data {assets.get('data_s')} s). "
             f"Data: {d.get('examples')} examples, mean {d.get('mean_tokens')} tokens "
             f"(median {d.get('median_tokens')}, p99 {d.get('p99_tokens')}, max {d.get('max_tokens')}), "
             f"responses {d.get('response_frac')} of tokens."), ""]
    st = startup_table(rows)
    if st:
        lines += ["## Start-up (seconds, medians)", "", *st,
                  (f"Imports alone (torch, transformers' Llama, deepspeed in a fresh process, once a call): "
                   f"{assets.get('imports_alone_s', '-')} s."),
                  *([(f"`hpctrain data prepare` of the SFT file for the prepared variant, once ahead: "
                      f"{assets['prepare_data']['prepare_data_s']} s.")] if assets.get("prepare_data") else []), ""]
    tables = [("Packed SFT vs synthetic (same plan)", ("synthetic", "packed-sdpa", "packed-flex"), "synthetic", ""),
              ("LoRA vs full fine-tune (packed SFT; full pools packed-sdpa's runs)", ("full", "lora"), "full", ""),
              ("hpctrain packed SFT vs DeepSpeed's padded loop", ("padded-ds", "packed-sdpa"), "padded-ds", "")]
    for title, variants, base, case in tables:
        per = _ok(rows, *variants, case=case)
        if variants[0] == "full":  # the same run file as packed-sdpa
            per["full"] += _ok(rows, "packed-sdpa")["packed-sdpa"]
        if any(per.values()):
            lines += [f"## {title}", "", *speed_table(per, base), ""]
    alt = alt_tables(rows)
    if alt:
        lines += ["## In-process alternation (bench/gpu/ft_alternate.py: one engine, windows A B C / B C A / C A B)",
                  "", *alt]
    lines += [f"- FAILED {r['case']} {r['variant']} round {r['round']} (rc {r['rc']}): "
              f"{r['error_tail'].splitlines()[-1] if r['error_tail'] else ''}" for r in rows if r["rc"]]
    lines += [f"- note {r['case']} {r['variant']} round {r['round']}: {r['result']['load_workaround']}"
              for r in rows if r["rc"] == 0 and (r.get("result") or {}).get("load_workaround")]
    lines += [f"- not run (budget): {x}" for x in skipped]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main
def make_assets(s: Setup, examples: int) -> tuple[dict[str, Any], float]:
    """bench/gpu/ft_assets.py in its own process, unless --assets already holds them."""
    done = s.assets / "assets.json"
    if done.exists():
        return dict(json.loads(done.read_text())), 0.0
    t0 = time.time()
    cmd = [sys.executable, str(BENCH / "gpu" / "ft_assets.py"), "--model", "llama-tiny" if s.cpu else "llama-8b",
           "--examples", str(examples), "--seq", str(s.seq), "--out", str(s.assets)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=str(ROOT))
    (s.work / "logs").mkdir(parents=True, exist_ok=True)
    (s.work / "logs" / "assets.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"ft_assets.py failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return dict(json.loads(done.read_text())), time.time() - t0


def time_imports(s: Setup) -> float | None:
    """torch + transformers' Llama + deepspeed imported in a fresh process: the imports inside the rank's prepare
    phase (which also loads the tokenizer and reads the data), measured alone once a call."""
    code = ("import time; t = time.time(); import torch, deepspeed; "
            "from transformers import AutoModelForCausalLM, LlamaForCausalLM; print(time.time() - t)")
    env = env_for(s, s.work / "runs")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                              check=False)
        return round(float(proc.stdout.strip().splitlines()[-1]), 2) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def prebuild_cpu_adam() -> subprocess.Popen[bytes] | None:
    """DeepSpeed JIT-builds CPU Adam on first use (50 s on the H200 machine): start it beside the asset build."""
    try:
        code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def pack_logs(work: Path, out: Path) -> None:
    keep = (".log", ".jsonl", ".json", ".toml", ".out", ".err", ".txt")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for p in sorted(work.rglob("*")):
            if (p.is_file() and p.suffix in keep and "state" not in p.parts and p.stat().st_size < 20 << 20
                    and p.name not in ("chat.jsonl", "alpaca.jsonl")):
                tar.add(p, arcname=str(p.relative_to(work)))


def merge_tables(files: list[Path], out: Path, argv: list[str]) -> None:
    """suite.md from the rows of several calls (their medians pooled)."""
    rows = [json.loads(ln) for f in files for ln in f.read_text().splitlines() if ln.strip()]
    side = [f.parent / "assets.json" for f in files if (f.parent / "assets.json").exists()]
    assets = dict(json.loads(side[0].read_text())) if side else {}
    out.mkdir(parents=True, exist_ok=True)
    text = report(rows, [], argv, assets)
    (out / "suite.md").write_text(text)
    print(text, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help=f"comma list of {', '.join(CASES)} (default: all; --cpu: all)")
    ap.add_argument("--runs", default="", help="single runs CASE:VARIANT, comma separated, after --cases")
    ap.add_argument("--rounds", type=int, default=0, help="override each case's rounds (--alternate: windows, 3)")
    ap.add_argument("--alternate", default="", help="ft_alternate processes first, comma separated "
                    "RUNFILE_VARIANT:WINDOW+WINDOW..., e.g. full:synthetic+packed-sdpa+packed-flex,lora:packed")
    ap.add_argument("--alt-cap-s", type=float, default=0, help="at most this many s for each --alternate process "
                    "but the last (its windows stop in time), so the processes after it fit in one call")
    ap.add_argument("--cold", action="store_true", help="no CPU Adam prebuild by the bench (the node's own "
                    "start-up then pays or overlaps it, as on a fresh machine)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=0, help="seq_len (default 4096; --cpu 256)")
    ap.add_argument("--global-batch", type=int, default=0, help="sequences per step (default 16; --cpu 4)")
    ap.add_argument("--fixed", action="store_true", help=f"fixed flags instead of the planner's choice: {FIXED}")
    ap.add_argument("--format", default="chat", choices=["chat", "alpaca"], help="[data] format of the SFT runs")
    ap.add_argument("--examples", type=int, default=0, help="SFT examples made (default 6000; --cpu 300)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no run expected to end past this (default 540; --cpu 1200)")
    ap.add_argument("--profile", default="", choices=["", "both", "step", "lora"], help="--alternate processes: "
                    "cProfile of the engine phase (both) and torch.profiler of one step of the first window variant "
                    "(both, step; lora: the LoRA processes' only); texts in logs.tar.gz")
    ap.add_argument("--compile-cache", default="", help="HPCTRAIN_COMPILE_CACHE for every run (torch.compile's "
                    "per-node cache: FlexAttention's kernels)")
    ap.add_argument("--cold-compile", action="store_true", help="empty --compile-cache before the first run")
    ap.add_argument("--padded-mb", type=int, default=0, help="the padded loop's micro-batch (default: hpctrain's "
                    "plan's); accumulation = global batch / it")
    ap.add_argument("--est-s", type=float, default=0, help="one run's expected wall time, for the budget (default: "
                    "~150 s + 11 s a step; warm start-up runs take ~65 s)")
    ap.add_argument("--cpu", action="store_true", help="tiny llama on CPU ranks (DS_ACCELERATOR=cpu): a smoke test")
    ap.add_argument("--assets", default="/tmp/ft-assets", help="model, tokenizer and data (kept across calls)")
    ap.add_argument("--work", default="/tmp/ft-suite-work")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ft-suite-out"))
    ap.add_argument("--tables-from", default="", help="comma list of suite.jsonl files (several calls): only write "
                    "--out/suite.md from their rows, pooled (each file's assets.json beside it)")
    a = ap.parse_args()
    if a.tables_from:
        merge_tables([Path(p) for p in a.tables_from.split(",") if p], Path(a.out), sys.argv[1:])
        return
    cases = [c for c in a.cases.split(",") if c] or ([] if a.runs or a.alternate else list(CASES))
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; use {', '.join(CASES)}")
    plan = [("alt", x, i) for i, x in enumerate(y for y in a.alternate.split(",") if y)]
    plan += expand(cases, [r for r in a.runs.split(",") if r], a.rounds)
    if a.cpu:  # torch's FlexAttention has no backward on the CPU (NotImplementedError): a GPU-only row
        plan = [p for p in plan if p[0] == "alt" or VARIANTS[p[1]].attention != "flex_attention"]
    assets_dir = Path(a.assets + ("-cpu" if a.cpu and a.assets == "/tmp/ft-assets" else ""))
    s = Setup(cpu=a.cpu, assets=assets_dir, work=Path(a.work), seq=a.seq or (256 if a.cpu else 4096),
              global_batch=a.global_batch or (4 if a.cpu else 16), steps=a.steps, warmup=a.warmup, fixed=a.fixed,
              fmt=a.format, rounds=a.rounds or 3, profile=a.profile, padded_mb=a.padded_mb,
              compile_cache=a.compile_cache, est_s=a.est_s)
    if a.cold_compile and a.compile_cache:
        shutil.rmtree(a.compile_cache, ignore_errors=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("runs", "logs", "runfiles", "state"):  # this call's runs only (the assets stay)
        shutil.rmtree(s.work / sub, ignore_errors=True)
    s.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    builder = None if a.cpu or a.cold else prebuild_cpu_adam()
    assets, took = make_assets(s, a.examples or (300 if a.cpu else 6000))
    budget = a.budget_s or (1200 if a.cpu else 540)
    if builder is not None:  # before the imports are timed (a compile beside them would slow them) and any run
        try:
            builder.wait(timeout=max(1.0, budget - (time.time() - t0) - est_s(s, plan[0][1] if plan else "full")))
        except subprocess.TimeoutExpired:
            builder.kill()  # the first run builds it itself
        builder = None
    assets["imports_alone_s"] = time_imports(s)
    if any(c != "alt" and VARIANTS[v].data == "prepared" for c, v, _ in plan):  # once, ahead, not in a start-up
        assets["prepare_data"] = json.loads(prepare_data(s).with_suffix(".json").read_text())
    (out / "assets.json").write_text(json.dumps({**assets, "made_in_this_call_s": round(took, 1)}, indent=1))
    print(f"{time.time() - t0:6.0f} s  assets ready ({took:.0f} s), imports alone {assets['imports_alone_s']} s: "
          f"{json.dumps(assets)[:300]}", flush=True)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for case, variant, rnd in plan:
        left = budget - (time.time() - t0)
        if left < est_s(s, variant):
            skipped.append(f"{case} {variant} round {rnd}")
            continue
        last_alt = case == "alt" and not any(c == "alt" for c, _, _ in plan[plan.index((case, variant, rnd)) + 1:])
        cap = a.alt_cap_s if case == "alt" and a.alt_cap_s and not last_alt else left - 5
        row = run_one(s, case, variant, rnd, timeout=max(30.0, min(left - 5, cap)))
        rows.append(row)
        with (out / "suite.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"{time.time() - t0:6.0f} s  {case} {variant} round {rnd}: rc {row['rc']}, {row['wall_s']} s; "
              + json.dumps(row["result"])[:500] + (("\n" + row["error_tail"]) if row["rc"] else ""), flush=True)
    text = report(rows, skipped, sys.argv[1:], assets)
    (out / "suite.md").write_text(text)
    pack_logs(s.work, out)
    print(text, flush=True)


if __name__ == "__main__":
    main()
