"""Distributed start: who am I (rank, world, master), the process group, and the one agreement collective.

Three launchers set three different environments; all five torch variables (RANK WORLD_SIZE
MASTER_ADDR MASTER_PORT LOCAL_RANK) are exported before `deepspeed.init_distributed`, because with any
one missing DeepSpeed falls back to MPI discovery and dies with "No module named 'mpi4py'".
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, MutableMapping
from typing import Any

from hpctrain.nodelist import expand, rendezvous_port

TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # "torch" (torchrun / deepspeed launcher), "submitit-local", "slurm", "single"
    job_id: str = ""
    node_rank: int = 0

    def exports(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist ("node[1-4]" -> "node1")."""
    return expand(nodelist)[0]


def _int(env: Mapping[str, str], name: str, default: str = "") -> int:
    try:
        return int(env.get(name, "").strip() or default)
    except ValueError:
        raise ValueError(f"{name}={env.get(name, '')!r} is not an integer") from None


def from_env(env: Mapping[str, str]) -> DistEnv | None:
    """Rank/world/master from whichever launcher started this process, first match wins: torch's
    variables (torchrun, DeepSpeed's runner), submitit's local executor, then srun's. None if none did.

    MASTER_ADDR, when set, wins; else rank 0 lives on the first host of the nodelist. MASTER_PORT, when set,
    wins; else it derives from the job id (the batch script exports the same value, see rendezvous_port).
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    job = env.get("SLURM_JOB_ID", "")
    if env.get("RANK", "").strip() and env.get("WORLD_SIZE", "").strip():
        rank, local, world, source = (_int(env, "RANK"), _int(env, "LOCAL_RANK", env.get("SLURM_LOCALID") or "0"),
                                      _int(env, "WORLD_SIZE"), "torch")
        node = _int(env, "GROUP_RANK", env.get("SLURM_NODEID") or "0")
        master = env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else "127.0.0.1")
        port = rendezvous_port(job) if job else 29500  # torch's own default outside a job
    elif "SUBMITIT_LOCAL_GLOBALID" in env:
        job = env.get("SUBMITIT_LOCAL_JOB_ID", "0")
        rank, local, world, source = (_int(env, "SUBMITIT_LOCAL_GLOBALID"), _int(env, "SUBMITIT_LOCAL_LOCALID", "0"),
                                      _int(env, "SUBMITIT_LOCAL_NTASKS"), "submitit-local")
        node, master, port = 0, "127.0.0.1", rendezvous_port(job)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, local, world, source = (_int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID", "0"),
                                      _int(env, "SLURM_NTASKS"), "slurm")
        node = _int(env, "SLURM_NODEID", "0")
        master, port = env.get("MASTER_ADDR") or first_host(nodelist or "localhost"), rendezvous_port(job or "0")
    else:
        return None
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world} ({source} launcher variables)")
    return DistEnv(rank, local, world, master, _int(env, "MASTER_PORT", str(port)), source, job, node)


def detect(env: Mapping[str, str] | None = None) -> DistEnv:
    """This process's place in the job (from_env), or a single process on this host."""
    env = os.environ if env is None else env
    found = from_env(env)
    if found is not None:
        return found
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT", "").strip() else free_port()
    return DistEnv(0, 0, 1, "127.0.0.1", port, "single")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare_process_env(d: DistEnv, use_gpu: bool, env: MutableMapping[str, str] | None = None,
                        cpus_per_task: int = 1, run_dir: str = "") -> None:
    """Everything that must be in os.environ before torch/deepspeed are imported or initialised.
    `run_dir`: the run folder, whose runs folder holds the per-node compile cache (`compile_cache_dir`)."""
    env = os.environ if env is None else env
    env.update(d.exports())
    env.setdefault("HF_HUB_OFFLINE", "1")  # compute nodes are offline: never reach for the hub
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # A hung peer should fail the job in minutes, not DeepSpeed's default 30.
    env.setdefault("DEEPSPEED_TIMEOUT", "10")
    fix_cuda_arch_list(env)
    if use_gpu:
        # Expandable segments: freed blocks are mapped back into one growing segment instead of staying
        # split. Near the planner's 90% limit, ZeRO-3's changing gather sizes otherwise strand memory as
        # reserved-but-unallocated (8B at 8 x 2 on one H200 died at step 2 with 9.9 GB of it).
        # torch reads PYTORCH_ALLOC_CONF and, older, PYTORCH_CUDA_ALLOC_CONF: a user's setting of either wins.
        if not env.get("PYTORCH_ALLOC_CONF") and not env.get("PYTORCH_CUDA_ALLOC_CONF"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        cache = compile_cache_dir(env, run_dir)
        if cache:
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
            env.setdefault("TRITON_CACHE_DIR", os.path.join(cache, "triton"))
    else:
        env["DS_ACCELERATOR"] = "cpu"
        # One rank per allocated core: torch would otherwise start a thread per core in every rank
        # and oversubscribe the node (submitit's local executor sets no limit).
        env.setdefault("OMP_NUM_THREADS", env.get("SLURM_CPUS_PER_TASK") or str(cpus_per_task))


def compile_cache_dir(env: Mapping[str, str], run_dir: str) -> str:
    """Where torch.compile's caches (inductor's FX graphs and autotuning, Triton's kernels) live on this node:
    HPCTRAIN_COMPILE_CACHE ("off": torch's defaults), else `<runs dir>/.compile-cache/<host>`.

    Why: FlexAttention (attention = "auto" on packed rows) is compiled in the first step, and torch's default
    cache is /tmp/torchinductor_<user>, which many sites empty per job (a private /tmp). One folder per host on
    the runs' shared filesystem lets a later start on the same node reuse it; per host, so nodes never race on
    one file (the keys hold torch's version and the GPU, so another image or GPU only adds entries)."""
    asked = env.get("HPCTRAIN_COMPILE_CACHE", "")
    if asked == "off":
        return ""
    if asked:
        return asked
    if not run_dir:
        return ""
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), ".compile-cache", socket.gethostname())


def fix_cuda_arch_list(env: MutableMapping[str, str]) -> None:
    """DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST with int(): "9.0a" (H200 images) -> "9.0"."""
    value = env.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return
    parts = value.replace(",", ";").replace(" ", ";").split(";")
    fixed: list[str] = []
    for part in filter(None, parts):
        suffix = "+PTX" if part.endswith("+PTX") else ""
        core = part.removesuffix("+PTX").rstrip("abf")  # "9.0a" -> "9.0", "10.0f" -> "10.0"
        if core and core + suffix not in fixed:
            fixed.append(core + suffix)
    env["TORCH_CUDA_ARCH_LIST"] = ";".join(fixed)


def init_process_group(d: DistEnv, use_gpu: bool, timeout_min: float) -> None:
    """deepspeed.init_distributed with the right backend; CPU skips the shm op (a 30 s g++ JIT build)."""
    import datetime

    import deepspeed
    import torch

    if use_gpu:
        torch.cuda.set_device(d.local_rank)
        backend = "nccl"
    else:
        import deepspeed.ops

        # Only used for inference all-reduce; building it needs g++ and ~30 s on every first start.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        backend = "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               timeout=datetime.timedelta(minutes=timeout_min), rank=d.rank,
                               world_size=d.world_size)


class OtherRankFailed(Exception):
    """Another rank hit an error; this rank stops without a message of its own."""


def comm_device() -> Any:
    """Where collective tensors must live: the GPU for NCCL, the host for gloo (init_process_group's choice)."""
    import torch
    import torch.distributed as tdist

    if tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(ok: bool) -> bool:
    """All ranks learn whether every rank succeeded (one all_reduce), so none waits in a collective."""
    import torch
    import torch.distributed as tdist

    flag = torch.tensor([0.0 if ok else 1.0], device=comm_device())
    tdist.all_reduce(flag)
    return bool(flag.item() == 0)
