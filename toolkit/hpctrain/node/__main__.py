"""`python -m hpctrain.node RUN_DIR [--mode train|preflight|health] [--launcher srun|deepspeed]`.

With `--launcher deepspeed` (one task per node), this process starts DeepSpeed's runner without ssh on
its own node, which starts one `python -m hpctrain.node RUN_DIR` per slot with RANK/LOCAL_RANK/... set.
HPCTRAIN_NODE_MODE=health (the in-job driver's health step, one task per node, the same launch line as the
training's) runs this node's health check instead (hpctrain.node.launch.health), whatever the launcher.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpctrain.node", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--mode", choices=("train", "preflight", "health"), default="train")
    p.add_argument("--launcher", choices=("srun", "deepspeed"), default="srun",
                   help="srun: this process is one rank; deepspeed: start DeepSpeed's runner for this node")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # DeepSpeed passes it
    return p


def deepspeed_command(run_dir: str, mode: str, env: dict[str, str]) -> list[str]:
    """The per-node DeepSpeed runner command (no ssh: every node runs its own runner under srun)."""
    from hpctrain.node.dist import detect
    from hpctrain.runs.folder import RunFolder

    hostfile = RunFolder(run_dir).hostfile
    if not hostfile.is_file() or not hostfile.read_text().strip():
        # DeepSpeed's runner would only warn and train on the local devices: refuse instead.
        raise SystemExit(f"hpctrain: {hostfile} is missing or empty; it is written on the allocation by the sbatch "
                         "script (one `host slots=N` line per node).")
    d = detect({k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    runner = shutil.which("deepspeed", path=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    return [runner or "deepspeed", "--no_ssh", "--no_local_rank", "--hostfile", str(hostfile),
            "--node_rank", env.get("SLURM_NODEID", "0"), "--master_addr", d.master_addr,
            "--master_port", str(d.master_port), "--module", "hpctrain.node", run_dir, "--mode", mode]


def main(argv: list[str] | None = None) -> int:
    os.umask(0o077)  # rank logs, metrics, checkpoints: private to the user, whoever started this process
    args = _parser().parse_args(argv)
    from hpctrain.states import NODE_MODE_ENV

    if os.environ.get(NODE_MODE_ENV) == "health" or args.mode == "health":
        from hpctrain.node.launch import health

        return health.run(args.run_dir)
    if args.launcher == "deepspeed" and "HPCTRAIN_DS_CHILD" not in os.environ:
        cmd = deepspeed_command(args.run_dir, args.mode, dict(os.environ))
        os.environ["HPCTRAIN_DS_CHILD"] = "1"  # the children are ranks, not runners
        os.execvpe(cmd[0], cmd, os.environ)
    from hpctrain.node.launch.main import run

    return run(args.run_dir, args.mode)


if __name__ == "__main__":
    sys.exit(main())
