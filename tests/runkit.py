"""Helpers for the node tests and the benchmarks: tiny run folders and multi-rank launches.

Run folders are written by `hpctrain.render.runfolder.write_run_folder`, the function `hpctrain submit`
uses, so the node under test reads the spec.toml, plan.json and ds_config.json a real run has.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
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


class _WarmRanks:
    """This test process's zygote (hpctrain.node.launch.zygote, the in-job restarts' warm ranks): it imports torch,
    DeepSpeed, transformers and the trainer once, and forks each rank of a warm launch from there. A cold rank
    spends ~6 of its ~8.5 CPU-s before its first step importing them (2026-12-03, w1 tiny Llama, 6 steps): on 2
    cores a 2-rank launch took 15.7-18 CPU-s cold and 4.0-4.4 warm (torchrun's own 1.5 included). The forked rank
    runs the node entry as `python -m hpctrain.node` does (runpy, the launch's environment, stdio and directory);
    when the zygote does not answer, the rank starts cold (zygote.run's fallback)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.job = f"pytest-{os.getpid()}"
        self.dir = Path()
        self.env: dict[str, str] = {}  # what the zygote imported under

    def job_id(self) -> str:
        """Started on first use; its job id (the name of its socket)."""
        if self.proc is None:
            self.dir = Path(tempfile.mkdtemp(prefix="hpctrain-zygote-"))
            self.env = node_env()
            with open(self.dir / "zygote.log", "ab") as log:
                self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(self.dir / "stop"), self.job,
                                              str(os.getpid())], env=self.env, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=log)
            atexit.register(self.stop)
        return self.job

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a launch with this environment may fork its ranks here. The zygote is started now if it is not
        yet, and again when this process's own environment has changed what it imported under (an earlier test
        set such a variable for good); a launch that sets one apart only for itself starts cold."""
        if self.proc is not None and _read_at_import(node_env()) != _read_at_import(self.env):
            self.stop()
        if self.proc is None:
            self.job_id()
        return _read_at_import(env) == _read_at_import(self.env)

    def stop(self) -> None:
        if self.proc is None:
            return
        (self.dir / "stop").touch()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


# The zygote: SIGKILLed when this test process dies (prctl PR_SET_PDEATHSIG), so a killed pytest leaves none.
_ZYGOTE = ("import ctypes, os, signal, sys\n"
           "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
           "if os.getppid() != int(sys.argv[3]): sys.exit(0)\n"
           "from hpctrain.node.launch import zygote\n"
           "sys.exit(zygote.serve(sys.argv[1], job_id=sys.argv[2]))")
# A warm rank's command: zygote.run is standard library only (the rank's own `python` starts in milliseconds).
_WARM_RANK = ("import sys\n"
              "from hpctrain.node.launch import zygote\n"
              "sys.exit(zygote.run('hpctrain.node', sys.argv[2:], job_id=sys.argv[1]))")
_WARM = _WarmRanks()
COLD_ENV = "HPCTRAIN_TESTS_COLD_RANKS"  # =1: every launch's ranks start cold (the suite as before the zygote)


# What DeepSpeed, torch, transformers and Python read once, when the zygote imports them (the accelerator, thread
# counts, hub settings, the module path). Not TORCHINDUCTOR_*: torch sets its cache dir in os.environ itself.
_READ_AT_IMPORT = ("DS_", "OMP_", "MKL_", "HF_", "TRANSFORMERS_", "PYTHONPATH")


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT)}


def torchrun(run_dir: Path, nproc: int, *, timeout: float = 180, env: dict[str, str] | None = None,
             mode: str = "train", warm: bool = True) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone` the node entrypoint, on a fresh port; bounded by TIMEOUT on an idle machine, more
    on a busy one (hang_bound). WARM: the ranks are forked by this process's zygote (_WarmRanks); cold: each
    rank is `python -m hpctrain.node` (what a launch with no zygote runs, kept by the tests that need it)."""
    timeout = hang_bound(timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair())]
    launch_env = node_env(env)
    if warm and os.environ.get(COLD_ENV) != "1" and _WARM.serves(launch_env):
        cmd += ["--no-python", sys.executable, "-c", _WARM_RANK, _WARM.job_id()]
    else:
        cmd += ["-m", "hpctrain.node"]
    cmd += [str(run_dir), "--mode", mode]
    return subprocess.run(cmd, env=launch_env, capture_output=True, text=True, timeout=timeout, check=False)


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
