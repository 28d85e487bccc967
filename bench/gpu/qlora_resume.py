"""QLoRA end to end as a user runs it (issue 26 item 3): train, crash, `hpctrain resubmit`, resume, export.

On the H200 machine (bitsandbytes in the image; the carried wheels of bench/gpu/setup.sh):

    source bench/gpu/setup.sh && python bench/gpu/qlora_resume.py --out $OUT
    python bench/gpu/qlora_resume.py --cpu --out /tmp/qlora-cpu    # the same path with plain LoRA on this CPU

What it does, with the CLI only (`python -m hpctrain ...`, the local executor):
1. a tiny "pretrained" folder and chat data (examples/scripts/make_tiny_finetune.py);
2. a reference run: `--lora-r 8 --set lora.quantize=4bit --zero 2 --gpus-per-node 1`, STEPS steps, a checkpoint
   every EVERY steps, uninterrupted;
3. the same run with HPCTRAIN_FAIL_AT_STEP=CRASH (every rank dies hard after that step): FAILED; then
   `hpctrain resubmit RUN`: it resumes from the last checkpoint and finishes;
4. `hpctrain export RUN`: the merged folder and hf/adapter/.
It reports (report.json, printed): the resumed run's losses against the reference's at every step after the
resume, what the checkpoint holds (adapter tensors only, bytes), the export's files, and the merged model's
logits against the unquantized base with the adapter applied by PEFT (`PeftModel.from_pretrained`), and against
the 4-bit base with the adapter (what was trained).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "toolkit"))


def cli(args: list[str], env: dict[str, str], timeout: float = 180) -> str:
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False, cwd=str(ROOT))
    if proc.returncode:
        raise RuntimeError(f"hpctrain {' '.join(args)}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def wait(run: Path, env: dict[str, str], timeout: float) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        state = json.loads(cli(["status", str(run), "--json"], env))["state"]
        if state not in ("PENDING", "RUNNING", "REQUEUED", ""):
            return str(state)
        time.sleep(1)
    raise TimeoutError(f"{run}: still running after {timeout:.0f} s")


def losses(run: Path) -> dict[int, float]:
    from hpctrain.collect.metrics import read_metrics

    out: dict[int, float] = {}
    for rec in read_metrics(run / "metrics" / "metrics.jsonl")[0]:
        if "loss" in rec:
            out[int(rec["step"])] = float(rec["loss"])  # the last record of a step wins (the resumed one)
    return out


def submit(flags: list[str], env: dict[str, str]) -> Path:
    return Path(json.loads(cli(["submit", *flags, "--executor", "local", "--json"], env))[0]["run_dir"])


def rank_log(run: Path, attempt: int) -> str:
    p = run / "logs" / f"attempt-{attempt}.rank-0.log"
    return p.read_text(errors="replace") if p.exists() else ""


def checkpoint_contents(run: Path) -> dict[str, Any]:
    """The newest checkpoint's files and bytes, and the tensors its model states hold."""
    import torch

    steps = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    if not steps:
        return {}
    newest = steps[-1]
    files = {str(p.relative_to(newest)): p.stat().st_size for p in newest.rglob("*") if p.is_file()}
    names: list[str] = []
    for p in newest.rglob("*model_states.pt"):
        sd = torch.load(p, map_location="cpu", weights_only=False)
        names += list((sd.get("module") or {}).keys())
    return {"step": newest.name, "bytes": sum(files.values()), "files": files, "model_tensors": len(names),
            "non_lora_tensors": [n for n in names if "lora_" not in n][:10]}


def compare_export(base: Path, export: Path, quantized: bool) -> dict[str, Any]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    ids = tok.apply_chat_template([{"role": "user", "content": "What do bees make?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = ids.to(dev)

    def logits(model: Any) -> Any:
        with torch.no_grad():
            return model.to(dev).eval()(ids).logits.float()

    merged = logits(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32))
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    base_logits = logits(plain)
    adapted = logits(PeftModel.from_pretrained(plain, export / "adapter"))
    out: dict[str, Any] = {"merged_vs_base_plus_adapter_max_abs": float((merged - adapted).abs().max()),
                           "adapter_changed_logits_max_abs": float((adapted - base_logits).abs().max()),
                           "logit_scale": float(merged.abs().max())}
    if quantized:
        from transformers import BitsAndBytesConfig

        q = AutoModelForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16), dtype=torch.bfloat16)
        trained = logits(PeftModel.from_pretrained(q, export / "adapter"))
        out["merged_vs_4bit_plus_adapter_max_abs"] = float((merged - trained).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qlora-resume"))
    ap.add_argument("--cpu", action="store_true", help="plain LoRA on CPU ranks (the path, without 4-bit)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--crash", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update({"HPCTRAIN_RUNS_DIR": str(a.work / "runs"), "HPCTRAIN_STATE_DIR": str(a.work / "state"),
                "HPCTRAIN_CONFIG_DIR": str(a.work / "config"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = str(ROOT / "toolkit") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if a.cpu:
        env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    report: dict[str, Any] = {"argv": sys.argv[1:]}
    t0 = time.monotonic()
    subprocess.run([sys.executable, str(ROOT / "examples/scripts/make_tiny_finetune.py"), str(a.work)], check=True,
                   capture_output=True, timeout=300)
    flags = ["--model", str(a.work / "model"), "--data", str(a.work / "chat.jsonl"), "--set", "data.format=chat",
             "--steps", str(a.steps), "--global-batch", "8", "--set", "data.seq_len=128", "--set", "train.lr=2e-3",
             "--set", f"checkpoint.every_steps={a.every}", "--lora-r", "8", "--zero", "2"]
    gpu = ["--gpus-per-node", "1", "--set", "lora.quantize=4bit"]
    flags += ["--set", "resources.tasks_per_node=1"] if a.cpu else gpu
    report["flags"] = flags
    try:
        plan = cli(["plan", *flags], env)
        (a.out / "plan.txt").write_text(plan)
        ref = submit(flags, env)
        report["reference"] = {"state": wait(ref, env, a.timeout), "losses": losses(ref)}
        crash_env = {**env, "HPCTRAIN_FAIL_AT_STEP": str(a.crash)}
        run = submit(flags, crash_env)
        report["crashed"] = {"state": wait(run, env, a.timeout), "losses": losses(run)}
        report["resubmit"] = cli(["resubmit", str(run), "--json"], env).strip()
        report["resumed_state"] = wait(run, env, a.timeout)
        log1 = rank_log(run, 1)
        resumed = [ln for ln in log1.splitlines() if "resumed from" in ln]
        report["resumed_line"] = resumed[:1]
        got, want = losses(run), report["reference"]["losses"]
        diffs = {s: abs(got[s] - want[s]) for s in want if s in got}
        report["losses_after_resume"] = {s: [want[s], got.get(s)] for s in sorted(want)}
        report["max_abs_loss_diff"] = max(diffs.values()) if diffs else None
        report["all_steps"] = sorted(got) == sorted(want)
        report["checkpoint"] = checkpoint_contents(run)
        cli(["export", str(run), "--out", str(a.work / "export")], env, timeout=600)
        export = a.work / "export"
        report["export_files"] = sorted(str(p.relative_to(export)) for p in export.rglob("*") if p.is_file())
        report["export_check"] = compare_export(a.work / "model", export, quantized=not a.cpu)
        report["summary"] = cli(["summary", str(run)], env)
    except Exception as e:  # noqa: BLE001 - the report says what broke, with the logs beside it
        report["error"] = f"{type(e).__name__}: {e}"
    report["wall_s"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=1, default=str)
    (a.out / "report.json").write_text(text)
    print(text)
    subprocess.run(["tar", "czf", str(a.out / "runs.tar.gz"), "-C", str(a.work), "runs"], check=False)
    sys.exit(1 if "error" in report else 0)


if __name__ == "__main__":
    main()
