"""Helpers for the node tests and the benchmarks: tiny run folders and multi-rank launches.

Run folders are written by `hpctrain.render.runfolder.write_run_folder`, the function `hpctrain submit`
uses, so the node under test reads the spec.toml, plan.json and ds_config.json a real run has.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port_pair() -> int:
    """A free port N with N+1 free too: torch takes MASTER_PORT, the preflight rendezvous MASTER_PORT+1.

    Drawn below Linux's ephemeral range (32768+): a port from there is soon handed out again to some
    outgoing connection (torchrun's own store clients included), so N+1 would be taken by the time the
    preflight binds it.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports in 20000-32000")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def spec_toml(tables: dict[str, Any]) -> str:
    """TOML for a spec dict of {top-level key: value, section: {key: value}}."""
    lines = [f"{k} = {toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for section, body in tables.items():
        if isinstance(body, dict):
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


TINY: dict[str, Any] = {
    "name": "tiny",
    "resources": {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2},
    "model": {"config": "llama-tiny"},
    "data": {"source": "synthetic", "seq_len": 32},
    "train": {"steps": 6, "micro_batch": 2, "grad_accum": 2, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
              "precision": "fp32", "seed": 7},
    "parallel": {"zero": 3},
    "checkpoint": {"every_steps": 0, "keep": 2, "export_hf": False},
}


def tiny_tables(**sections: Any) -> dict[str, Any]:
    """TINY updated section by section (a section's keys replace TINY's; other keys stay)."""
    tables = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
    for name, body in sections.items():
        if isinstance(body, dict):
            tables.setdefault(name, {}).update(body)
        else:
            tables[name] = body
    return tables


def make_run(root: Path, **sections: Any) -> Path:
    """The run folder `hpctrain submit` would write for TINY updated section by section: spec.toml,
    plan.json, ds_config.json. On an existing folder (a resume with a changed spec) the three are
    rewritten and the checkpoints, logs and metrics stay."""
    from hpctrain.plan.planner import make_plan
    from hpctrain.render.runfolder import write_run_folder
    from hpctrain.spec.model import from_toml_text

    spec = from_toml_text(spec_toml(tiny_tables(**sections)))
    write_run_folder(root, spec, make_plan(spec))
    return root


def spec_only(root: Path, **sections: Any) -> Path:
    """A folder holding only a spec.toml, as a user might have edited it: what the node does with input
    that `hpctrain submit` would have refused."""
    from hpctrain.runs.folder import RunFolder

    root.mkdir(parents=True, exist_ok=True)
    RunFolder(root).spec_toml.write_text(spec_toml(tiny_tables(**sections)))
    return root


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "3",
                "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")})
    env.update(extra or {})
    return env


def hang_bound(seconds: float) -> float:
    """SECONDS, the bound a launch gets on an idle machine, stretched by the load seen now (runnable tasks per
    core, up to 6x): the bound catches a hang, and a busy machine (a CPU hog, other jobs) is no hang."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(6.0, max(1.0, load))


def torchrun(run_dir: Path, nproc: int, *, timeout: float = 180, env: dict[str, str] | None = None,
             mode: str = "train") -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone` the node entrypoint, on a fresh port; bounded by TIMEOUT on an idle machine, more
    on a busy one (hang_bound)."""
    timeout = hang_bound(timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()), "-m", "hpctrain.node", str(run_dir),
           "--mode", mode]
    return subprocess.run(cmd, env=node_env(env), capture_output=True, text=True, timeout=timeout, check=False)


def jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records, skipping a line being written (a job still running appends to it)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    from hpctrain.runs.folder import RunFolder

    path = RunFolder(run_dir).metrics_jsonl
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run_dir: Path) -> list[dict[str, Any]]:
    from hpctrain.runs.folder import RunFolder

    path = RunFolder(run_dir).events_jsonl  # rank 0's training milestones: the `train` events
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in lines if r.get("kind") == "train"]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Last logged loss per step (a resumed run logs the re-run steps again)."""
    return {int(r["step"]): float(r["loss"]) for r in metrics(run_dir)}
