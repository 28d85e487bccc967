"""The GPU benchmarks of issues 8 and 18 on one H200, in device calls that fit the 10-minute limit.

Every timed case runs the hpctrain entrypoint and the plain DeepSpeed loop (bench/gpu/plain_ds.py) at the same
settings in fresh processes (bench/node_gpu.py --only entry|plain), alternating, the order rotated each round;
the table gives medians and the ratio of medians. Cases with `plan` in their name leave ZeRO, offload ratio,
micro-batch x accumulation and recompute to the planner (global batch 16 x 4096 tokens) and run the plain loop
at the planner's choice. A call runs its cases in order and starts no run that would end past --budget-s.

    source bench/gpu/setup.sh
    python bench/gpu_suite.py --call 1 --out $OUT      # sdpa probe, 3B offload vs its parts, 1B planner's choice
    python bench/gpu_suite.py --call 2 --out $OUT      # 8B, the planner's choice then (ratio 0.15, 2 x 8)
    python bench/gpu_suite.py --call 3 --out $OUT      # 1B choice again, 8B planner's choice
    python bench/gpu_suite.py --call 4 --out $OUT      # calls 4-6 (run 2026-12-02): n >= 3 on every row, 3B choice
    python bench/gpu_suite.py --cases 1b-mb6 --rounds 3 --out $OUT
    python bench/gpu_suite.py --cpu --cases cpu-smoke --out /tmp/suite   # this script on the CPU (tiny model)

Files under --out (what a device call brings back: at most 8 files): suite.jsonl (one row per run, written as
it ends), suite.md (the tables), logs.tar.gz (every run's log and metrics).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
NODE_GPU = str(BENCH / "node_gpu.py")
PLAN_AUTO = ["--zero", "auto", "--offload-ratio", "auto", "--ac", "auto", "--global-batch", "16"]


@dataclass(frozen=True)
class Case:
    """One benchmark: `variants` (name -> extra node_gpu.py args) alternate for `rounds` rounds."""

    args: list[str]
    variants: dict[str, list[str]] = field(default_factory=lambda: {"entry": ["--only", "entry"],
                                                                    "plain": ["--only", "plain"]})
    rounds: int = 3
    est_s: float = 60.0  # one run, start to end (the budget's unit)
    cpu_adam: bool = False  # needs DeepSpeedCPUAdam (JIT-built once per machine, in the background)
    script: str = NODE_GPU
    note: str = ""


CASES: dict[str, Case] = {
    # torch's SDPA backends alone at the Llama shapes (decides [model] attention = "auto").
    "sdpa": Case([], {"probe": []}, rounds=1, est_s=45, script=str(BENCH / "gpu" / "sdpa_probe.py"),
                 note="forward+backward of causal SDPA by backend"),
    # Issue 18 goal 3: the parts of the 3B offload step alone (same call as the steps below).
    "3b-parts": Case(["--parts-only", "--model", "llama-3b", "--mb", "4", "--seq", "4096"], {"parts": []},
                     rounds=1, est_s=110, cpu_adam=True, script=str(BENCH / "gpu" / "offload_parts.py"),
                     note="forward+backward, CPU Adam and the copies of the 3B offload step, each alone"),
    "3b-offload": Case(["--model", "llama-3b", "--zero", "3", "--offload", "optimizer", "--mb", "4",
                        "--steps", "3", "--warmup", "2"], rounds=3, est_s=75, cpu_adam=True,
                       note="Llama-3B ZeRO-3, full optimizer offload, micro-batch 4, recompute (issue 18 goals 1, 3)"),
    "1b-plan": Case(["--model", "llama-1b", *PLAN_AUTO, "--steps", "4", "--warmup", "2"],
                    {"entry": ["--only", "entry"], "entry-cudnn": ["--only", "entry", "--attention", "sdpa-cudnn"],
                     "plain": ["--only", "plain"]}, rounds=3, est_s=50,
                    note="Llama-1B, the planner's choice (issue 18 goals 1, 5)"),
    "3b-plan": Case(["--model", "llama-3b", *PLAN_AUTO, "--steps", "3", "--warmup", "2"], rounds=3, est_s=70,
                    note="Llama-3B, the planner's choice (issue 18 goal 1)"),
    "8b-plan": Case(["--model", "llama-8b", *PLAN_AUTO, "--steps", "3", "--warmup", "1", "--timeout", "330"],
                    rounds=3, est_s=125, cpu_adam=True,
                    note="Llama-8B, the planner's choice (issue 18 goals 1, 4)"),
    "1b-mb6": Case(["--model", "llama-1b", "--zero", "3", "--mb", "6", "--no-ac", "--steps", "8", "--warmup", "3"],
                   rounds=3, est_s=45, note="Llama-1B ZeRO-3, micro-batch 6, no recompute (issue 18's row)"),
    "1b-mb4": Case(["--model", "llama-1b", "--zero", "3", "--mb", "4", "--steps", "8", "--warmup", "3"],
                   rounds=3, est_s=40, note="Llama-1B ZeRO-3, micro-batch 4, recompute (issue 18's row)"),
    # Issue 8's single runs (entrypoint only or their own baselines).
    "dynbatch": Case(["--model", "llama-1b", "--seq", "4096", "--mb", "4", "--steps", "6", "--warmup", "2", "--gpu"],
                     {"run": []}, rounds=1, est_s=150, script=str(BENCH / "node_dynamic_batching.py"),
                     note="padded vs dynamic vs packed batches (issue 8 goal 6)"),
    "ckpt": Case(["--model", "llama-1b", "--gpu", "--dir", "/tmp/hpctrain-ckio"], {"run": []}, rounds=1, est_s=200,
                 script=str(BENCH / "checkpoint_io.py"),
                 note="dd vs sync vs async checkpoint writes (issue 18 goal 2)"),
    # --cpu: the suite's own smoke test on a tiny model (tests/test_bench.py).
    "cpu-smoke": Case(["--model", "llama-tiny", "--zero", "auto", "--offload-ratio", "auto", "--ac", "auto",
                       "--global-batch", "4", "--seq", "64", "--steps", "2", "--warmup", "1", "--cpu"],
                      {"entry": ["--only", "entry"]}, rounds=2, est_s=30, note="tiny model on the CPU"),
}
# A call: cases (every round of each) or single runs "case:variant", in order, most needed first. Calls 1 and 2
# are sent back to back (the machine stays warm 30 s: call 2 keeps call 1's CPU Adam build and wheels).
CALLS: dict[str, list[str]] = {
    "1": ["sdpa", "3b-parts", "3b-offload:entry", "1b-plan:entry", "1b-plan:entry-cudnn", "1b-plan:plain",
          "3b-offload:plain", "3b-offload:entry"],
    "2": ["8b-plan:entry", "8b-plan:plain", "8b-plan:entry"],
    "3": ["1b-plan:entry", "1b-plan:plain", "8b-plan:entry", "8b-plan:plain", "8b-plan:entry"],
    # 2026-12-02, second session: the 3B choice, and the runs that bring the medians of calls 1-3 to n >= 3.
    # 1b-mb6 runs one alternating pair per call (each pair in one call).
    "4": ["1b-plan:plain", "1b-plan:entry", "8b-plan:plain", "8b-plan:entry", "8b-plan:plain",
          "1b-mb6:entry", "1b-mb6:plain"],
    "5": ["3b-parts", "3b-offload:plain", "3b-offload:entry", "3b-offload:plain", "3b-offload:entry",
          "1b-mb6:plain", "1b-mb6:entry"],
    "6": ["3b-plan", "1b-mb6:entry", "1b-mb6:plain"],
    "8": ["dynbatch", "ckpt"],
}


def command(name: str, case: Case, variant: str, rnd: int, work: Path) -> list[str]:
    folder = work / f"{name}-{variant}-{rnd}"
    where = {"checkpoint_io.py": ["--json", str(folder / "result.json")], "offload_parts.py": ["--out", str(folder)]}
    tail = where.get(Path(case.script).name, ["--out", str(folder)])
    return [sys.executable, case.script, *case.args, *case.variants[variant], *tail]


def run_one(name: str, case: Case, variant: str, rnd: int, work: Path, timeout: float) -> dict[str, Any]:
    """One fresh process; its RESULT/ROW lines become rows; its output is kept in work/logs."""
    cmd = command(name, case, variant, rnd, work)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                              cwd=str(BENCH.parent))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = _text(exc.stdout) + _text(exc.stderr) + f"\ntimed out after {timeout:.0f} s"
        rc = 124
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / "logs" / f"{name}-{variant}-{rnd}.log").write_text(" ".join(cmd) + "\n" + text)
    results = [json.loads(ln.split(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(("RESULT ", "ROW "))]
    return {"case": name, "variant": variant, "round": rnd, "rc": rc, "wall_s": round(time.time() - t0, 1),
            "utc": datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S"), "results": results,
            "table": [ln for ln in text.splitlines() if ln.startswith("| ")],
            "error_tail": "" if rc == 0 else "\n".join(text.splitlines()[-15:])}


def _text(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def prebuild_cpu_adam() -> subprocess.Popen[bytes] | None:
    """DeepSpeed JIT-builds CPU Adam on first use (46 s on the H200 machine): start it now, beside other cases."""
    try:
        code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def schedule(case: Case, rounds: int) -> list[tuple[str, int]]:
    """(variant, round) in run order: every round runs each variant once, the order rotated by one each round."""
    names = list(case.variants)
    out = []
    for rnd in range(rounds):
        k = rnd % len(names)
        out += [(v, rnd) for v in names[k:] + names[:k]]
    return out


def expand(tokens: list[str], rounds: int) -> list[tuple[str, str, int]]:
    """(case, variant, round) of a call or --cases list: "case" = every round of it, "case:variant" = one run."""
    out: list[tuple[str, str, int]] = []
    for tok in tokens:
        name, _, variant = tok.partition(":")
        if variant:
            if variant not in CASES[name].variants:
                raise SystemExit(f"{tok}: {name} has the variants {', '.join(CASES[name].variants)}")
            out.append((name, variant, sum(1 for c, v, _ in out if (c, v) == (name, variant))))
        else:
            out += [(name, v, r) for v, r in schedule(CASES[name], rounds or CASES[name].rounds)]
    return out


# ------------------------------------------------------------------------------------------ tables
def _figures(row: dict[str, Any]) -> dict[str, Any]:
    return row["results"][-1] if row["results"] else {}


def case_table(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """Median per variant; speed ratio against the plain loop's median; the planner's predictions."""
    ok = [r for r in rows if r["case"] == name and r["rc"] == 0 and r["results"]]
    failed = [r for r in rows if r["case"] == name and r["rc"] != 0]
    out = [f"### {name}: {CASES[name].note}" if name in CASES else f"### {name}", ""]
    per: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        per.setdefault(r["variant"], []).append(_figures(r))
    if any("tokens_per_s_per_gpu" in f for fs in per.values() for f in fs):
        plain = per.get("plain")
        base = statistics.median(f["step_s"] for f in plain) if plain else None
        head = ("| variant | n | median step s (runs) | tok/s | model TFLOPS | MFU | x plain | GPU GB (pred) | "
                "host GB (pred) | chosen | predicted step s |")
        out += [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
        for v, fs in per.items():
            med = statistics.median(f["step_s"] for f in fs)
            runs = ", ".join(f"{f['step_s']:.3f}" for f in fs)
            tflops = statistics.median(f["model_tflops_per_gpu"] for f in fs)
            mfu = tflops / 788.0 if tflops else None
            ratio = f"{base / med:.3f}" if base and v != "plain" else ("1" if v == "plain" else "-")
            f0 = fs[0]
            host = f0.get("host_peak_gb") or f0.get("host_rss_gb")
            ch = f0.get("chosen") or {}
            chosen = (f"z{ch.get('zero')} {ch.get('offload')} r{ch.get('ratio')} {ch.get('mb')}x{ch.get('accum')} "
                      f"ac={ch.get('ac')}") if ch else "-"
            out.append(f"| {v} | {len(fs)} | {med:.3f} ({runs}) | "
                       f"{statistics.median(f['tokens_per_s_per_gpu'] for f in fs):,.0f} | {tflops:.0f} | "
                       f"{f'{mfu:.1%}' if mfu else '-'} | {ratio} | "
                       f"{f0.get('gpu_peak_gb')} ({f0.get('pred_gpu_gb', '-')}) | "
                       f"{host} ({f0.get('pred_host_gb', '-')}) | {chosen} | {f0.get('pred_step_s') or '-'} |")
    else:
        for r in ok:
            out += [f"{r['variant']} round {r['round']}:", "", *(r["table"] or
                    [f"    {json.dumps(x)}" for x in r["results"]]), ""]
    out += [f"- FAILED {r['variant']} round {r['round']} (rc {r['rc']}): "
            f"{r['error_tail'].splitlines()[-1] if r['error_tail'] else ''}" for r in failed]
    return out + [""]


def report(rows: list[dict[str, Any]], skipped: list[str], argv: list[str]) -> str:
    gpu = "cpu"
    with contextlib.suppress(OSError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout.strip() or gpu
    lines = [f"# bench/gpu_suite.py, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", "",
             f"Machine: {gpu}; {os.cpu_count()} cores; {platform.platform()}.",
             f"Command: `python bench/gpu_suite.py {' '.join(argv)}`", ""]
    for name in dict.fromkeys(r["case"] for r in rows):
        lines += case_table(name, rows)
    lines += [f"- not run (budget): {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call", default="", help=f"a call's cases: {CALLS}")
    ap.add_argument("--cases", default="", help=f"comma list of {sorted(CASES)}")
    ap.add_argument("--rounds", type=int, default=0, help="override each case's rounds")
    ap.add_argument("--budget-s", type=float, default=560, help="start no run expected to end past this")
    ap.add_argument("--cpu", action="store_true", help="allow running on a machine without a GPU (cpu-smoke)")
    ap.add_argument("--work", default="/tmp/hpctrain-gpu-suite")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/hpctrain-gpu-suite-out"))
    a = ap.parse_args()
    tokens = CALLS[a.call] if a.call else [c for c in a.cases.split(",") if c]
    names = list(dict.fromkeys(t.partition(":")[0] for t in tokens))
    unknown = [n for n in names if n not in CASES]
    if not names or unknown:
        raise SystemExit(f"pick a --call ({', '.join(CALLS)}) or --cases from {', '.join(CASES)}"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    builder = prebuild_cpu_adam() if any(CASES[n].cpu_adam for n in names) and not a.cpu else None
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name, variant, rnd in expand(tokens, a.rounds):
        case = CASES[name]
        left = a.budget_s - (time.time() - t0)
        if left < case.est_s:
            skipped.append(f"{name} {variant} round {rnd}")
            continue
        if case.cpu_adam and builder is not None:
            try:
                builder.wait(timeout=max(1.0, left - case.est_s))
            except subprocess.TimeoutExpired:
                builder.kill()  # the run builds it itself
            builder = None
        row = run_one(name, case, variant, rnd, work, timeout=max(30.0, left - 5))
        rows.append(row)
        with (out / "suite.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"{time.time() - t0:6.0f} s  {name} {variant} round {rnd}: rc {row['rc']}, {row['wall_s']} s; "
              + json.dumps(_figures(row))[:400], flush=True)
    text = report(rows, skipped, sys.argv[1:])
    (out / "suite.md").write_text(text)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for p in sorted(work.rglob("*")):
            if p.is_file() and p.suffix in (".log", ".jsonl", ".json", ".md") and p.stat().st_size < 20 << 20:
                tar.add(p, arcname=str(p.relative_to(work)))
    print(text, flush=True)


if __name__ == "__main__":
    main()
