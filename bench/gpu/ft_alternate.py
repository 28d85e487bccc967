"""One process, one engine: windows of optimizer steps that alternate variants differing only in the data or the
attention kernel (issue 26 item 5), plus the start-up of that process part by part (item 1).

What it measures. The node's own code builds everything from a run folder that `hpctrain submit --dry-run --out
DIR` rendered (spec, plan, ds_config): `train.prepare` (tokenizer, SFT data, packing plan), the process group,
`train.build_engine` (model built partitioned and loaded from the local folder, deepspeed.initialize), then
optimizer steps through the node's own `_train_step` (gas micro-batches, engine.backward, engine.step). Only the
batches and the attention kernel change between windows, never the engine, the plan or the optimizer:

    synthetic     the node's synthetic rows (seq_len tokens each, no position_ids: one causal document a row)
    packed-sdpa   the run's packed SFT rows (documents concatenated, position_ids restarting per document);
                  transformers turns position_ids into a block-diagonal (micro x 1 x seq x seq) boolean mask
                  for SDPA, which then cannot take its flash kernel
    packed-flex   the same rows with the model switched to attn_implementation "flex_attention": a BlockMask
                  built from the position_ids, no seq x seq mask in memory
    packed        the run's own attention (for a LoRA or full run timed alone, e.g. beside the padded loop)

Each round runs every variant once, order rotated each round (A B C, B C A, C A B); the first window of each
variant starts with --warmup untimed steps (FlexAttention's compile). Every step is timed alone (wall clock
after a device sync); a window's figure is its median step, a variant's the median of its windows. Start-up
parts are seconds from this process's start: imports, prepare, process group, model build, weights load,
engine init (deepspeed.initialize, CPU Adam), first step.

    python bench/gpu/ft_alternate.py --run-dir DIR --variants synthetic,packed-sdpa,packed-flex --rounds 3 \
        --steps 2 --out result.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "toolkit"))


def process_start() -> float:
    from hpctrain.node import phases

    return phases.process_start()


class BuiltLine(logging.Handler):
    """Catches the node's "model built in X s; loaded ... in Y s" line (node/model/build.py) for the start-up split."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "model built" in msg or "attention:" in msg or "CPU Adam" in msg:
            self.lines.append(msg)


def set_attention(engine: Any, impl: str) -> str:
    """Switch the model's attention kernel in place (transformers reads config._attn_implementation per call)."""
    model = engine.module
    base = getattr(model, "get_base_model", lambda: model)()
    try:
        base.set_attn_implementation(impl)
    except (AttributeError, ValueError, ImportError):
        base.config._attn_implementation = impl
    return str(base.config._attn_implementation)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="a folder written by `hpctrain submit --dry-run --out`")
    ap.add_argument("--variants", default="synthetic,packed-sdpa,packed-flex")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps a window")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before a variant's first window")
    ap.add_argument("--budget-s", type=float, default=0, help="start no window past this many s of process time")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--profile-engine", default="", help="cProfile the engine phase (train.build_engine); text here")
    ap.add_argument("--no-fast-init", action="store_true", help="HPCTRAIN_FAST_INIT=0: DeepSpeed's own ZeRO-3 "
                    "offload engine build (the node's hpctrain.node.model.fast_init is on by default)")
    ap.add_argument("--profile-step", default="", help="torch.profiler over one step of the first variant at the "
                    "end (its kernels by GPU time); text here")
    a = ap.parse_args()
    t_start = process_start()
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = time.time()

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from hpctrain.node import dist
    from hpctrain.node.launch import imports

    os.environ.setdefault("MASTER_PORT", str(dist.free_port()))
    imports.install()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    caught = BuiltLine()
    logging.getLogger("hpctrain.node").addHandler(caught)
    import torch

    from hpctrain.node import train
    from hpctrain.node.data.loader import DataSource

    mark("imports")
    d = dist.detect()
    run = Path(a.run_dir).absolute()
    os.chdir(run)
    spec = train.read_spec(train.RunFolder(run))
    dist.prepare_process_env(d, use_gpu=spec.resources.gpus_per_node > 0,
                             cpus_per_task=max(1, spec.resources.cpus_per_task), run_dir=str(run))
    prep = train.prepare(run, d)
    mark("prepare")
    dist.init_process_group(d, prep.use_gpu, timeout_min=10)
    mark("process_group")
    if a.no_fast_init:  # the A/B switch of the node's hpctrain.node.model.fast_init
        os.environ["HPCTRAIN_FAST_INIT"] = "0"
    if a.profile_engine:  # where the engine phase's time goes (deepspeed.initialize above all), by function
        import cProfile

        prof = cProfile.Profile()
        engine, n_params = prof.runcall(train.build_engine, prep)
        mark("engine")
        write_pstats(prof, Path(a.profile_engine))
    else:
        engine, n_params = train.build_engine(prep)
        mark("engine")
    cuda = prep.use_gpu and torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run_attn = set_attention(engine, str(engine.module.config._attn_implementation))
    synthetic = DataSource(None, mode="padded", micro=prep.micro, seq_len=prep.spec.data.seq_len,
                           budget=prep.micro * prep.spec.data.seq_len, seed=prep.spec.train.seed,
                           pad_id=prep.tokenizer.pad_id, vocab=int(prep.hf_cfg.vocab_size))
    sources = {"synthetic": (synthetic, run_attn), "packed-sdpa": (prep.source, "sdpa"),
               "packed-flex": (prep.source, "flex_attention"), "packed": (prep.source, run_attn)}
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if strip_mods(v) not in sources]
    if bad:
        raise SystemExit(f"--variants {bad}: use {', '.join(sources)}, each optionally with {', '.join(MODS)}")
    cursor = 0
    checks: dict[str, Any] = {}
    warm: set[str] = set()
    steps: list[dict[str, Any]] = []
    first_step_end = 0.0
    last_dt = 0.0
    skipped: list[str] = []
    for rnd in range(a.rounds):
        k = rnd % len(names)
        for v in names[k:] + names[:k]:
            n_warm = 0 if v in warm else a.warmup
            # A window that would end past the budget is not started (a compile of flex: ~60 s more).
            need = (n_warm + a.steps) * last_dt * 1.2 + (60.0 if n_warm and "flex" in v else 0.0)
            if a.budget_s and time.time() - t_start + need > a.budget_s:
                skipped.append(f"{v} round {rnd}")
                print(f"budget: window {v} round {rnd} not run", flush=True)
                continue
            src, impl = sources[strip_mods(v)]
            got = set_attention(engine, impl) + set_mods(engine, v)
            warm.add(v)
            for i in range(n_warm + a.steps):
                batches = [src.batch(cursor + m) for m in range(prep.gas)]
                cursor += prep.gas
                sync()
                t0 = time.time()
                loss = train._train_step(engine, batches, False) / prep.gas
                sync()
                dt = time.time() - t0
                last_dt = max(last_dt, dt) if i < n_warm else dt
                if not first_step_end:
                    first_step_end = time.time()
                    checks["first_step_compile"] = compile_stats()
                tokens = sum(b.tokens for b in batches)
                row = {"variant": v, "round": rnd, "timed": i >= n_warm, "step_s": round(dt, 4),
                       "tokens": tokens, "trained": sum(b.trained for b in batches),
                       "slots": sum(b.slots for b in batches), "loss": round(loss, 4), "attn": got,
                       "gpu_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else 0.0}
                steps.append(row)
                print(json.dumps(row), flush=True)
            write_result(a, marks, t_start, first_step_end, caught, steps, skipped, prep, n_params, names, checks)
    if a.profile_step and (not a.budget_s or time.time() - t_start + 3 * last_dt + 30 < a.budget_s):
        profile_step(engine, prep, sources, names[0], cursor, Path(a.profile_step), train)
    checks["compile_end"] = compile_stats()
    liger_room = not a.budget_s or time.time() - t_start + 2 * last_dt + 40 < a.budget_s
    if liger_room and any(".liger" in v for v in names):  # one micro-batch without and with Liger, at the end
        import liger_toggle

        from hpctrain.node.model import kernels

        set_attention(engine, run_attn)
        fused = kernels.fused_ce_allowed(prep.zero, prep.spec.parallel.pp)
        checks["liger_loss"] = liger_toggle.loss_check(engine, prep.source.batch(0), fused)
        checks["liger_fused_ce"] = fused
        print("liger loss check " + json.dumps(checks["liger_loss"]), flush=True)
    out = write_result(a, marks, t_start, first_step_end, caught, steps, skipped, prep, n_params, names, checks)
    print("RESULT " + json.dumps({k: out[k] for k in ("startup", "summary", "micro", "gas", "zero", "lora_r")}),
          flush=True)


# Window modifiers, appended to a source name ("packed-flex.fused.nodrop"): LoRA's forward fused
# (bench/gpu/lora_fused.py) and its dropout switched off, in place, on the same engine.
MODS = (".fused", ".nodrop", ".liger")


def strip_mods(v: str) -> str:
    for m in MODS:
        v = v.replace(m, "")
    return v


def set_mods(engine: Any, v: str) -> str:
    """Apply the window's modifiers (and undo those it lacks); '' when the run has no LoRA."""
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import lora_fused

    model = engine.module
    if ".fused" in v:  # (it read "+fused", which no window name holds: the .fused windows ran unfused)
        lora_fused.install(model)
    else:
        lora_fused.uninstall(model)
    lora_fused.set_dropout(model, off=".nodrop" in v)
    if ".liger" in v or "liger_toggle" in sys.modules:  # Liger's kernels on this window, or off again
        import liger_toggle

        from hpctrain.node.model import kernels

        if ".liger" in v:
            liger_toggle.on(model, kernels.fused_ce_allowed(int(getattr(engine, "zero_optimization_stage",
                                                                            lambda: 0)()), 1))
        else:
            liger_toggle.off(model)
    return "".join(m for m in MODS if m in v)


def compile_stats() -> dict[str, Any]:
    """What torch.compile did so far (FlexAttention): its cache hits and misses and the compile time by phase."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import compile_times, counters

    out: dict[str, Any] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd", "stats", "frames")
                           if k in counters}
    try:
        out["compile_times"] = compile_times(repr="str", aggregate=True)
    except (TypeError, ValueError, RuntimeError) as exc:
        out["compile_times"] = f"unavailable ({exc})"
    out["inductor_cache_dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    return out


def fast_init_times() -> dict[str, float]:
    mod = sys.modules.get("hpctrain.node.model.fast_init")
    return {k: round(v, 2) for k, v in getattr(mod, "TIMES", {}).items()}


def write_pstats(prof: Any, path: Path) -> None:
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(70)
    st.sort_stats("tottime").print_stats(40)
    path.write_text(buf.getvalue())


def profile_step(engine: Any, prep: Any, sources: dict[str, Any], v: str, cursor: int, path: Path,
                 train: Any) -> None:
    """One optimizer step of variant v under torch.profiler: its kernels and ops by GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    src, impl = sources[strip_mods(v)]
    set_attention(engine, impl)
    set_mods(engine, v)
    batches = [src.batch(cursor + m) for m in range(prep.gas)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        train._train_step(engine, batches, False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ka = prof.key_averages()
    text = []
    for key in ("self_cuda_time_total", "self_device_time_total", "cuda_time_total", "self_cpu_time_total"):
        try:
            text.append(f"sorted by {key}\n" + ka.table(sort_by=key, row_limit=60, max_name_column_width=70))
            break
        except (AttributeError, KeyError, ValueError):
            continue
    path.write_text(f"variant {v}\n" + "\n".join(text))
    print(f"profile of one {v} step written to {path}", flush=True)


def write_result(a: argparse.Namespace, marks: dict[str, float], t_start: float, first_step_end: float,
                 caught: BuiltLine, steps: list[dict[str, Any]], skipped: list[str], prep: Any, n_params: int,
                 names: list[str], checks: dict[str, Any]) -> dict[str, Any]:
    """The result JSON so far (written after every window: a process killed at its limit keeps its windows)."""
    parts = {"imports_s": marks["imports"] - t_start, "prepare_s": marks["prepare"] - marks["imports"],
             "process_group_s": marks["process_group"] - marks["prepare"],
             "engine_s": marks["engine"] - marks["process_group"], "first_step_s": first_step_end - marks["engine"],
             "to_step1_s": first_step_end - t_start}
    for line in caught.lines:
        if line.startswith("model built in"):
            w = line.split()
            parts["model_build_s"], parts["weights_load_s"] = float(w[3]), float(w[-2])
            parts["engine_init_s"] = parts["engine_s"] - parts["model_build_s"] - parts["weights_load_s"]
    out = {"run_dir": str(Path(a.run_dir).absolute()), "variants": names, "rounds": a.rounds, "steps": a.steps,
           "n_params": n_params,
           "micro": prep.micro, "gas": prep.gas, "zero": prep.zero, "checkpointing": prep.checkpointing,
           "lora_r": prep.spec.lora.r, "startup": {k: round(v, 2) for k, v in parts.items()},
           "fast_init": fast_init_times(),
           "log": caught.lines, "summary": summarize(steps), "steps_rows": steps}
    out["skipped"] = skipped
    out["checks"] = checks
    out["host_peak_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)  # KiB -> ~GB
    Path(a.out).write_text(json.dumps(out, indent=1))
    return out


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: each window's median step, the median of the windows, tokens and trained tokens a step."""
    out: dict[str, Any] = {}
    for v in dict.fromkeys(r["variant"] for r in steps):
        rows = [r for r in steps if r["variant"] == v and r["timed"]]
        windows = [statistics.median(r["step_s"] for r in rows if r["round"] == k)
                   for k in dict.fromkeys(r["round"] for r in rows)]
        if not windows:
            continue
        step = statistics.median(windows)
        tok = statistics.median(r["tokens"] for r in rows)
        trained = statistics.median(r["trained"] for r in rows)
        out[v] = {"windows_s": [round(w, 4) for w in windows], "step_s": round(step, 4),
                  "tokens_per_step": tok, "trained_per_step": trained, "tokens_per_s": round(tok / step, 1),
                  "trained_per_s": round(trained / step, 1),
                  "padding_frac": round(1 - tok / max(1, statistics.median(r["slots"] for r in rows)), 4),
                  "gpu_peak_gb": max(r["gpu_peak_gb"] for r in rows)}
    return out


if __name__ == "__main__":
    main()
