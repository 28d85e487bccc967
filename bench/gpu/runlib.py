"""Shared by the GPU benchmarks: run folders rendered by hpctrain, the two launch paths, metric summaries.

A run folder holds what `hpctrain submit` writes for a job (spec.toml, plan.json, ds_config.json from
hpctrain.plan.planner / hpctrain.render.sbatch). The node entrypoint is then started the way a SLURM allocation of one
node starts it:

* ``launch_srun_style``: one process per GPU with the environment srun gives each task (SLURM_PROCID,
  SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID, SLURM_JOB_ID, SLURM_JOB_NODELIST) plus what hpctrain's
  sbatch script exports (MASTER_ADDR = first host, MASTER_PORT = rendezvous_port(job id), HPCTRAIN_RUN_DIR);
  every task sees the node's GPUs and takes the one of its local rank, as under ``--gpus-per-node``.
* ``launch_deepspeed``: one task running ``python -m hpctrain.node RUN --launcher deepspeed`` with a
  ``localhost slots=N`` hostfile: the node entry starts DeepSpeed's runner, which starts the ranks.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "toolkit"))
sys.path.insert(0, str(ROOT / "tests"))

from hpctrain.nodelist import rendezvous_port
from runkit import spec_toml

# NVLink multicast stays off in every process on the shared multi-GPU hosts (device notes).
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def bench_tables(*, name: str, model: str, zero: int, gpus: int, mb: int, seq: int, steps: int,
                 offload: str = "none", ac: bool | str = True, cpu: bool = False, ckpt_every: int = 0,
                 peak_tflops: float = 788.0, extra: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The spec of one benchmark run (random-init preset, synthetic tokens, bf16)."""
    tables: dict[str, Any] = {
        "name": name,
        "resources": {"nodes": 1, "gpus_per_node": 0 if cpu else gpus, "tasks_per_node": gpus},
        "model": {"config": model},
        "data": {"source": "synthetic", "seq_len": seq},
        "train": {"steps": steps, "micro_batch": mb, "grad_accum": 1, "lr": 1e-4, "min_lr": 1e-5,
                  "warmup_steps": 0, "precision": "bf16", "activation_checkpointing": ac,
                  "peak_tflops": 0.0 if cpu else peak_tflops},
        "parallel": {"zero": zero, "offload": offload},
        "checkpoint": {"every_steps": ckpt_every, "keep": 1, "export_hf": False},
        # No tracker: the GPU image has no tensorboard, and the plain loop beside it writes none either.
        "tracking": {"backends": []},
    }
    if not cpu:  # one H200: 139 GiB usable (nvidia-smi 143,771 MiB less the CUDA context)
        tables["resources"]["gpu_mem_gb"] = 139.0
    for section, body in (extra or {}).items():
        tables.setdefault(section, {}).update(body)
    return tables


def write_run_folder(run: Path, tables: dict[str, Any], *,
                     zero_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """spec.toml + plan.json + ds_config.json as `hpctrain submit` writes them; returns the plan as a dict.
    Keeps an existing checkpoints/ folder (a resume at another world size rewrites the rest).
    `zero_overrides` are merged into the rendered zero_optimization block (a variant under test)."""
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.deepspeed import build_ds_config, to_json
    from hpctrain.render.runfolder import write_run_folder as write_folder
    from hpctrain.runs.folder import RunFolder
    from hpctrain.spec.model import from_toml_text

    spec = from_toml_text(spec_toml(tables))
    plan = make_plan(spec)
    write_folder(run, spec, plan)
    if zero_overrides:
        cfg = build_ds_config(spec, plan)
        cfg["zero_optimization"].update(zero_overrides)
        RunFolder(run).ds_config_json.write_text(to_json(cfg))
    return dict(json.loads(plan.to_json()))


def _base_env(cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "RANK", "LOCAL_RANK",
                                                                      "WORLD_SIZE", "MASTER_"))}
    env.update(NVLS_OFF)
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    return env


def _job_env(run: Path, ntasks: int, job_id: int) -> dict[str, str]:
    """What srun + hpctrain's sbatch script give every task of a one-node job."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_NTASKS": str(ntasks), "SLURM_NNODES": "1", "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": str(ntasks),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous_port(str(job_id))), "HPCTRAIN_RUN_DIR": str(run)}


def _wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> int:
    """Wait for every rank; past the timeout kill them all. Returns the first non-zero exit code."""
    deadline = time.time() + timeout
    rc = 0
    for p in procs:
        try:
            code = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return 124
        rc = rc or code
        if code:  # like srun --kill-on-bad-exit: one rank failed, stop the others
            for q in procs:
                if q.poll() is None:
                    q.terminate()
    return rc


def launch_srun_style(run: Path, ntasks: int, log: Path, *, timeout: float, cpu: bool = False,
                      gpus: str | None = None) -> int:
    """One process per rank with srun's task environment. `gpus` = the node's CUDA_VISIBLE_DEVICES."""
    job_id = random.randrange(100000, 999999)
    env = _base_env(cpu) | _job_env(run, ntasks, job_id)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    procs = []
    with log.open("w") as fh:
        for r in range(ntasks):
            task_env = env | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}
            procs.append(subprocess.Popen([sys.executable, "-u", "-m", "hpctrain.node", str(run)], env=task_env,
                                          stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          text=True, cwd=str(ROOT)))
        return _wait_all(procs, timeout)


def launch_deepspeed(run: Path, slots: int, log: Path, *, timeout: float, cpu: bool = False) -> int:
    """One task, `python -m hpctrain.node RUN --launcher deepspeed`: DeepSpeed's runner starts `slots` ranks."""
    job_id = random.randrange(100000, 999999)
    (run / "hostfile").write_text(f"localhost slots={slots}\n")
    env = _base_env(cpu) | _job_env(run, 1, job_id) | {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    # The runner script: next to python in a venv, or on PATH (setup.sh adds the carried wheels' bin/).
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-u", "-m", "hpctrain.node", str(run), "--launcher", "deepspeed"],
                                env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                cwd=str(ROOT), start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            return 124


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """The run's step records (the collector's reader: a line cut mid-write is skipped)."""
    from hpctrain.collect.metrics import read_metrics as read

    return read(run / "metrics" / "metrics.jsonl")[0]


def summarize(recs: list[dict[str, Any]], world: int, warmup: int) -> dict[str, Any]:
    """Median of the steady steps (after `warmup`): tokens/s per GPU, model TFLOPS, MFU; peaks over all."""
    if not recs:
        return {"steps": 0}
    steady = recs[warmup:] or recs
    med = lambda key: statistics.median(float(r.get(key) or 0.0) for r in steady)
    return {
        "steps": len(recs),
        "tokens_per_s_per_gpu": round(med("tokens_per_s") / world, 1),
        "model_tflops_per_gpu": round(med("tflops"), 1),
        "mfu": round(med("mfu"), 3) if steady and steady[0].get("mfu") is not None else None,
        "step_s": round(statistics.median(float(r["tokens"]) / float(r["tokens_per_s"]) for r in steady
                                          if r.get("tokens_per_s")), 3) if steady else None,
        "gpu_peak_gb": round(max(float(r.get("gpu_mem_gb") or 0.0) for r in recs), 1) if recs else None,
        "gpu_reserved_gb": round(max(float(r.get("gpu_reserved_gb") or 0.0) for r in recs), 1) if recs else None,
        "host_peak_gb": round(max(float(r.get("host_peak_gb") or r.get("host_mem_gb") or 0.0) for r in recs), 1)
        if recs else None,
        "first_loss": round(float(recs[0]["loss"]), 3) if recs else None,
        "last_loss": round(float(recs[-1]["loss"]), 3) if recs else None,
    }


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
