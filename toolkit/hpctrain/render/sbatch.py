"""Pure functions from (spec, plan) to the files a job runs: sbatch.sh, hostfile, ds_config.json.

Jinja2 lives here only. The environment uses StrictUndefined (a missing variable is an error, not an
empty string) and a `shquote` filter: every value that reaches the shell goes through shlex.quote,
so names, paths and env values holding quotes, `$()`, backticks, `;` or newlines stay data.
Templates ship inside the wheel as `hpctrain.templates`; a file of the same name in the spec's
`launch.template_dir` or in $HPCTRAIN_CONFIG_DIR/templates overrides the shipped one.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain import __version__
from hpctrain.errors import HpcUsageError, bad_value
from hpctrain.plan.memory import SUB_GROUP_SIZE
from hpctrain.render import containers
from hpctrain.spec.model import Spec
from hpctrain.spec.rules import secret_names

if TYPE_CHECKING:
    import jinja2

    from hpctrain.plan.planner import Plan

NODE_MODULE = "hpctrain.node"
PODMAN_PASSTHROUGH = containers.PODMAN_PASSTHROUGH


def shipped_templates() -> Path:
    """The templates folder inside the installed package (falls back to the source tree)."""
    try:
        from importlib.resources import files

        path = Path(str(files("hpctrain.templates")))
        if (path / "sbatch.sh.j2").is_file():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[3] / "templates"


def template_dirs(spec: Spec | None = None) -> list[Path]:
    """Search path, first match wins: spec/site template_dir, config dir templates/, shipped ones."""
    from hpctrain.spec.site import config_dir

    dirs = []
    if spec is not None and spec.launch.template_dir:
        dirs.append(Path(spec.launch.template_dir).expanduser())
    dirs += [config_dir() / "templates", shipped_templates()]
    return [d for d in dirs if d.is_dir()]


def environment(spec: Spec | None = None) -> jinja2.Environment:
    """The one Jinja2 environment: strict, newline-preserving, with `shquote`."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in template_dirs(spec)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    return env


# --------------------------------------------------------------------------------------------------
# Hostfile and submitit command

def render_hostfile(hosts: Sequence[str], slots: int) -> str:
    """DeepSpeed hostfile, one `host slots=N` line per host. Empty or duplicate hosts are errors:
    DeepSpeed would otherwise fall back to local devices or double-book a node."""
    if not hosts:
        raise HpcUsageError("hostfile hosts = []: no hosts. Fix: pass a nodelist such as 'node[1-4]'")
    seen: set[str] = set()
    for h in hosts:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", h):
            raise bad_value("hostfile host", h, "not a host name", "use plain names such as node1")
        if h in seen:
            raise bad_value("hostfile host", h, "listed twice", "list every host once")
        seen.add(h)
    if slots < 1:
        raise bad_value("hostfile slots", slots, "must be at least 1", "pass --slots with the ranks per node")
    return environment().get_template("hostfile.j2").render(hosts=list(hosts), slots=slots)


def submitit_command(python: str, folder: str) -> str:
    """The line submitit itself runs on each task: `PYTHON -u -m submitit.core._submit FOLDER`.

    `python` is used as given (submitit's convention: already a shell word, e.g. shlex.quote'd
    sys.executable, or a container wrapper); the folder is quoted here.
    """
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


# --------------------------------------------------------------------------------------------------
# Containers (kept separate so more runtimes can be added without touching the rest)

def _bind_root(run_dirs: Sequence[Path]) -> str:
    """One folder holding every run folder of the job. An array run_dir such as
    RUNS/.sweeps/ID/%a links to sibling run folders, so RUNS itself is bound."""
    root = Path(os.path.commonpath([str(d) for d in run_dirs]))
    if "%a" in str(root):
        root = Path(str(root).split("%a")[0].rstrip("/") or "/")
    if ".sweeps" in root.parts:
        root = Path(*root.parts[: root.parts.index(".sweeps")])
    return str(root)


def container_binds(spec: Spec, run_dirs: Sequence[Path]) -> list[tuple[str, str]]:
    """Host paths the ranks need inside a container, bound at the same path: the runs folder,
    model, data, tokenizer, NVMe folder, and the spec's extra mounts ("SRC[:DST]")."""
    paths: list[str] = [_bind_root(run_dirs)]
    m, d = spec.model, spec.data
    if m.path:
        paths.append(m.path)
    if m.config and "/" in m.config:
        paths.append(str(Path(m.config).parent))
    if d.source != "synthetic":
        paths.append(d.source)
    if d.tokenizer != "byte":
        paths.append(d.tokenizer)
    if spec.parallel.offload != "none" and spec.parallel.offload_device == "nvme":
        paths.append(spec.parallel.nvme_path)
    binds = [(p, p) for p in dict.fromkeys(paths)]
    for mount in spec.container.mounts:
        src, _, dst = mount.partition(":")
        binds.append((src, dst or src))
    for src, dst in binds:
        if spec.container.runtime in ("pyxis", "apptainer") and ("," in src + dst or ":" in src + dst):
            raise bad_value("container mount", src, f"{spec.container.runtime} splits mounts on ',' and ':'",
                            "move the folder to a path without ',' or ':'")
    return binds


def container_wrap(spec: Spec, run_dirs: Sequence[Path], workdir: str) -> tuple[list[str], list[str]]:
    """(extra srun flags, command prefix) for the container runtime; both are shell-safe words.

    none: nothing. pyxis: srun flags. apptainer/podman/charliecloud: a prefix before the command.
    The runtimes themselves live in hpctrain.render.containers.
    """
    return containers.wrap(spec, container_binds(spec, run_dirs), workdir)


# --------------------------------------------------------------------------------------------------
# sbatch.sh

def _job_name(name: str) -> str:
    """SLURM job name: the run name with anything but [A-Za-z0-9_.+-] replaced by '_'.

    #SBATCH lines are parsed by sbatch, not bash; keeping the name plain avoids relying on its
    quoting rules. The exact name stays in spec.toml.
    """
    return re.sub(r"[^A-Za-z0-9_.+\-]", "_", name)[:128] or "hpctrain"


def _directive(key: str, value: object = True) -> str:
    if value is True:
        return f"--{key}"
    text = str(value)
    if any(ord(c) < 32 for c in text):
        raise bad_value(f"#SBATCH --{key}", text, "contains a newline or control character",
                        "use a path/value without control characters")
    return f"--{key}={shlex.quote(text)}"


def _log_pattern(folder: Path, array: str | None, task: str) -> str:
    """submitit's log names (utils.JobPaths): %j_%t_log.out, or %A_%a_%t_log.out in an array."""
    job = "%A_%a" if array else "%j"
    return str(folder / f"{job}_{task}_log")


def sbatch_directives(spec: Spec, plan: Plan, folder: Path, array: str | None) -> list[str]:
    """#SBATCH flags, sorted by name like submitit so the script diff stays readable.

    `--no-requeue`: a job that loses a node must end (NODE_FAIL, or the watchdog's peer-lost cancel) so
    that the supervisor resubmits it without the dead host. SLURM's own requeue of such a job reran it on
    the returning node, where slurmctld's pending kill of the dead run often killed the rerun too (a second
    start-up). The time-limit/preemption self-requeue still works: rank 0 (or the container hand-off)
    turns requeue on just before `scontrol requeue`, and the rerun turns it off again."""
    r = spec.resources
    per_node_tasks = 1 if spec.launch.launcher == "deepspeed" else plan.ranks_per_node
    cpus = r.cpus_per_task * (plan.ranks_per_node if spec.launch.launcher == "deepspeed" else 1)
    log = _log_pattern(folder, array, "0")
    flags: dict[str, object] = {
        "job-name": _job_name(spec.name), "nodes": r.nodes, "ntasks-per-node": per_node_tasks,
        "cpus-per-task": cpus, "time": r.time, "output": log + ".out", "error": log + ".err",
        "no-requeue": True, "signal": f"USR2@{r.signal_seconds}", "open-mode": "append", "export": "ALL",
    }
    optional = {"gpus-per-node": r.gpus_per_node or None, "mem": r.mem, "partition": r.partition,
                "account": r.account, "qos": r.qos, "constraint": r.constraint,
                "exclude": ",".join(r.exclude), "array": array}
    flags.update({k: v for k, v in optional.items() if v})
    return [_directive(k, flags[k]) for k in sorted(flags)]


def _launch_line(spec: Spec, plan: Plan, folder: Path, array: str | None, command: str,
                 run_dirs: Sequence[Path], python: str | None, mode: str) -> tuple[str, str]:
    log = _log_pattern(folder, array, "%t")
    srun = ["srun", "--unbuffered", "--kill-on-bad-exit=1", "--output", shlex.quote(log + ".out"),
            "--error", shlex.quote(log + ".err")]
    flags, prefix = container_wrap(spec, run_dirs, _bind_root(run_dirs))
    if spec.launch.launcher == "deepspeed":
        py = python or (shlex.quote(shlex.split(command)[0]) if command.strip() else "python")
        cmd = f'{py} -u -m {NODE_MODULE} "$HPCTRAIN_RUN_DIR" --launcher deepspeed --mode {shlex.quote(mode)}'
        srun += ["--ntasks-per-node=1"]
        note = "one task per node; the node entry starts DeepSpeed's runner with the hostfile."
    else:
        cmd = command
        note = f"srun starts {plan.ranks_per_node} task(s) per node, one per rank, each running submitit's job."
    # In a container the login node's python means nothing: the image's python runs, behind a guard.
    cmd = containers.rank_command(spec, cmd)
    return " ".join([*srun, *flags, *prefix, cmd]), note


def _shell_path(path: Path) -> str:
    """A quoted shell word for a path; `%a` (array index, as in submitit's folders) expands at run time."""
    pieces = str(path).split("%a")
    return '"${SLURM_ARRAY_TASK_ID}"'.join(shlex.quote(p) if p else "" for p in pieces)


def render_sbatch(spec: Spec, plan: Plan, run_dir: Path, command: str, *, array: str | None = None,
                  run_dirs: Sequence[Path] | None = None, submitit_folder: Path | None = None,
                  python: str | None = None, mode: str = "train") -> str:
    """The batch script for a run (or, with `array` and `run_dirs`, for a sweep's job array).

    `command` is what every srun task runs (submitit's `python -u -m submitit.core._submit FOLDER`).
    Logs go where submitit looks for them: SUBMITIT_FOLDER/%j_%t_log.{out,err}
    (default RUN_DIR/submitit). For an array, task i runs in run_dirs[i], or in run_dir with `%a`
    replaced by the array index. `mode` ("train"/"preflight") only matters for launcher deepspeed,
    where the node entry runs instead of submitit's pickled job.
    """
    run_dir = Path(run_dir)
    folder = Path(submitit_folder) if submitit_folder else run_dir / "submitit"
    dirs = [Path(d) for d in run_dirs] if run_dirs else [run_dir]
    if array and not run_dirs and "%a" not in str(run_dir):
        raise ValueError("render_sbatch: an array needs run_dirs, or a run_dir pattern holding %a")
    launch_line, note = _launch_line(spec, plan, folder, array, command, dirs, python, mode)
    secrets = secret_names(spec)
    env = [(k, v) for k, v in sorted(spec.env.items()) if k not in secrets]
    return environment(spec).get_template("sbatch.sh.j2").render(
        version=__version__, name=spec.name, directives=sbatch_directives(spec, plan, folder, array),
        modules=list(spec.launch.modules), env=env, secret_names=list(secrets), run_dir_expr=_shell_path(run_dir),
        run_dirs=[str(d) for d in dirs] if run_dirs else [], cpu=plan.device == "cpu",
        slots=plan.ranks_per_node, launch_line=launch_line, launcher_note=note,
        runtime=spec.container.runtime,
        container_check=containers.prelaunch_lines(spec, container_binds(spec, dirs)),
        watchdog=_watchdog_line(spec, plan, command, python), hang_timeout=spec.launch.hang_timeout_s,
    )


def _watchdog_line(spec: Spec, plan: Plan, command: str, python: str | None) -> str:
    """The hang watchdog the batch script runs in the background (hpctrain.fault.supervisor; stdlib only, on the
    host, with the submitting python). Empty when launch.hang_timeout_s is 0."""
    if not spec.launch.hang_timeout_s or not (python or command.strip()):
        return ""
    py = shlex.quote(shlex.split(command)[0]) if command.strip() else str(python)
    return (f'{py} -m hpctrain.fault.supervisor watch "$HPCTRAIN_RUN_DIR" --timeout {spec.launch.hang_timeout_s} '
            f"--world {plan.world_size}")


# --------------------------------------------------------------------------------------------------
# ds_config.json

def _offload_block(spec: Spec) -> dict[str, Any]:
    p = spec.parallel
    block: dict[str, Any] = {"device": p.offload_device, "pin_memory": True}
    if p.offload_device == "nvme":
        block["nvme_path"] = p.nvme_path
    return block


def _zero_block(spec: Spec, plan: Plan) -> dict[str, Any]:
    """zero_optimization with bucket sizes scaled to the hidden size (HF's "auto" rule, h*h)."""
    stage, h = plan.zero_stage, int(plan.model.get("hidden", 1024))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return zero
    zero.update({"overlap_comm": plan.device == "gpu", "contiguous_gradients": True,
                 "reduce_bucket_size": h * h})
    if stage in (1, 2):
        zero.update({"allgather_partitions": True, "allgather_bucket_size": h * h, "reduce_scatter": True})
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": int(0.9 * h * h), "stage3_param_persistence_threshold": 10 * h,
                     "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if plan.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = _offload_block(spec)
        if stage == 3 and plan.offload_ratio < 1:
            # Partial offload (ZeRO-3 only): DeepSpeed keeps the first int((1 - ratio) * n) of its n optimizer
            # sub-groups on the GPU. The plan's estimate counted whole sub-groups of this size: say it.
            zero["offload_optimizer"]["ratio"] = plan.offload_ratio
            zero["sub_group_size"] = SUB_GROUP_SIZE
    if plan.offload in ("param", "all"):
        zero["offload_param"] = _offload_block(spec)
    return zero


def render_ds_config(spec: Spec, plan: Plan) -> dict[str, Any]:
    """DeepSpeed config in DeepSpeed's own schema. The optimizer block stays minimal: the node
    builds the LR schedule itself. On CPU ranks without CPU offload, "torch_adam" avoids
    JIT-compiling FusedAdam (41 s and 2 GB on a CPU node)."""
    t = spec.train
    params: dict[str, Any] = {"lr": t.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": t.weight_decay}
    if plan.device == "cpu" and plan.offload == "none":
        params["torch_adam"] = True
    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": _zero_block(spec, plan),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    if plan.tp > 1:  # DeepSpeed AutoTP: shards Linear layers inside a node
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.pp > 1:
        cfg["pipeline"] = {"stages": plan.pp, "partition": "parameters", "seed_layers": False,
                           "activation_checkpoint_interval": 1 if plan.activation_checkpointing else 0}
    return cfg
