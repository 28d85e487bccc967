"""Pure functions from (spec, plan) to the job's scripts: sbatch.sh and the hostfile (ds_config.json: deepspeed.py).

Jinja2 lives here only. The environment uses StrictUndefined (a missing variable is an error, not an
empty string) and a `shquote` filter: every value that reaches the shell goes through shlex.quote,
so names, paths and env values holding quotes, `$()`, backticks, `;` or newlines stay data.
Templates ship inside the wheel as `hpctrain.templates`; a file of the same name in the spec's
`launch.template_dir` (which must exist) or in $HPCTRAIN_CONFIG_DIR/templates overrides the shipped one; an
error in such a template reads as a usage error naming its file and line.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain import __version__
from hpctrain.errors import HpcUsageError, bad_value
from hpctrain.nodelist import rendezvous_port_shell
from hpctrain.render import containers
from hpctrain.runs.folder import RunFolder
from hpctrain.spec import launch as user_launch
from hpctrain.spec import sbatch_args
from hpctrain.spec.model import Spec, user_script
from hpctrain.spec.rules import secret_names

if TYPE_CHECKING:
    import jinja2

    from hpctrain.plan.model import Plan

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
        chosen = Path(spec.launch.template_dir).expanduser()
        if not chosen.is_dir():  # a typo would otherwise render the shipped templates without a word
            raise bad_value("launch.template_dir", spec.launch.template_dir, "not a folder",
                            "set template_dir (run file [launch], or the site profile) to an existing folder of "
                            "*.j2 overrides, or remove it to use the shipped templates")
        dirs.append(chosen)
    dirs += [config_dir() / "templates", shipped_templates()]
    return [d for d in dirs if d.is_dir()]


def environment(spec: Spec | None = None) -> jinja2.Environment:
    """The one Jinja2 environment: strict, newline-preserving, with `shquote`."""
    return _environment(tuple(str(d) for d in template_dirs(spec)))


@functools.lru_cache(maxsize=16)
def _environment(dirs: tuple[str, ...]) -> jinja2.Environment:
    """One environment per search path, so templates compile once (Jinja still reloads a template whose file
    changed: auto_reload)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(list(dirs)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    return env


def render_template(env: jinja2.Environment, template: str, /, **context: Any) -> str:
    """Render `template`; a broken template (often a user's override) is a usage error naming its file
    and line, not a Jinja traceback."""
    import jinja2

    try:
        return env.get_template(template).render(**context)
    except jinja2.TemplateSyntaxError as exc:
        raise HpcUsageError(f"template {exc.filename or template}, line {exc.lineno}: {exc.message}. Fix: correct "
                            "the template, or remove it to use the shipped one") from None
    except jinja2.TemplateError as exc:
        path, line = _template_frame(exc, env, template)
        known = ", ".join(sorted(context))
        raise HpcUsageError(f"template {path}, line {line}: {exc.message or type(exc).__name__}. Fix: use only "
                            f"the variables hpctrain passes ({known}), or remove the template to use the shipped "
                            "one") from None


def _template_frame(exc: BaseException, env: jinja2.Environment, name: str) -> tuple[str, int | str]:
    """(file, line) of the template frame that raised: Jinja maps its frames back to the template source."""
    found: tuple[str, int | str] = ("", "?")
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename.endswith(".j2"):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    if not found[0]:
        try:
            found = (env.get_template(name).filename or name, "?")
        except Exception:  # noqa: BLE001 - the error message still names the template
            found = (name, "?")
    return found


# --------------------------------------------------------------------------------------------------
# Hostfile and submitit command

def render_hostfile(hosts: Sequence[str], slots: int, spec: Spec | None = None) -> str:
    """DeepSpeed hostfile, one `host slots=N` line per host (hostfile.j2, the format's one definition).
    Empty or duplicate hosts are errors: DeepSpeed would otherwise fall back to local devices or
    double-book a node."""
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
    return render_template(environment(spec), "hostfile.j2", hosts=list(hosts), slots=slots)


_HOST_MARK = "hpctrain-host-mark"


def hostfile_awk(slots: int, spec: Spec | None = None) -> str:
    """The awk program (one quoted shell word) with which the batch script turns `scontrol show hostnames`
    into the hostfile: hostfile.j2 rendered for a marker host, so the job writes exactly what
    render_hostfile writes. A host listed twice stops the job, as render_hostfile refuses it."""
    text = render_hostfile([_HOST_MARK], slots, spec)
    line = text.removesuffix("\n")
    before, mark, after = line.partition(_HOST_MARK)
    if not mark or "\n" in line or _HOST_MARK in after or any(c in line for c in '"\\'):
        raise bad_value("hostfile.j2", text, "must render one line per host, without quotes or backslashes",
                        "write it like `{% for host in hosts %}{{ host }} slots={{ slots }}` + a newline per host")
    program = ('NF == 0 { next } seen[$1]++ { print "hpctrain: host " $1 " is listed twice in the allocation; '
               f'refusing to start" > "/dev/stderr"; exit 1 }} {{ print "{before}" $1 "{after}" }}')
    return shlex.quote(program)


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
    if spec.launch.script:  # the user's script and the files beside it (its modules, configs)
        paths.append(str(Path(spec.launch.script).parent))
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
    """submitit's log names (utils.JobPaths): %j_%t_log.out, or %A_%a_%t_log.out in an array; the folder's own
    '%' escaped for SLURM (see slurm_filename)."""
    job = "%A_%a" if array else "%j"
    return slurm_filename(folder) + f"/{job}_{task}_log"


# submitit replaces these in its folder (JobPaths._format_id), and hpctrain's sweep folders use %a for the
# array index: in a runs dir or an --out folder they would point submitit and the ranks elsewhere.
SUBMITIT_TAGS = ("%j", "%t", "%A", "%a")


def check_job_path(key: str, path: Path | str, *, array_pattern: bool = False) -> None:
    """Refuse a folder that sbatch, SLURM or submitit would read as something else than the path itself.

    Spaces, quotes, `$`, `;`, `#` and non-ASCII are fine (the #SBATCH value is shell-quoted, which sbatch
    parses, and srun gets it as one word); another '%' is escaped as '%%' (slurm_filename). `array_pattern`:
    the path is a sweep's own `.../%a` pattern."""
    text = str(path)
    tags = [t for t in SUBMITIT_TAGS if t in text and not (array_pattern and t == "%a")]
    if tags:
        raise bad_value(key, text, f"holds {' and '.join(tags)}, which submitit replaces with a job, task or array "
                        "id in its folder (and SLURM in #SBATCH --output)",
                        "choose a folder without %j, %t, %A or %a (another '%' is fine), e.g. rename it")
    if "\\" in text:
        raise bad_value(key, text, "holds a backslash: sbatch removes it from #SBATCH lines, and in a log name it "
                        "stops SLURM from expanding %j", "choose a folder without '\\'")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise bad_value(key, text, "contains a newline or control character, which ends an #SBATCH line",
                        "choose a folder without control characters")


def slurm_filename(path: Path | str) -> str:
    """A path as SLURM's --output/--error read it: SLURM expands %j, %x, %N, ... and '%%' is a plain '%'.
    A sweep's %a (the array index) stays a pattern; check_job_path refuses a literal one."""
    return "%a".join(piece.replace("%", "%%") for piece in str(path).split("%a"))


def sbatch_directives(spec: Spec, plan: Plan, folder: Path, array: str | None, dependency: str = "") -> list[str]:
    """#SBATCH flags, sorted by name like submitit so the script diff stays readable; then `[slurm] extra` in its
    own order, each option one line with its value quoted (hpctrain.spec.sbatch_args). `dependency`: sbatch's
    --dependency for this submission only (`submit --after`; a retry has none).

    `--no-requeue`: a job that loses a node must end (NODE_FAIL, or the watchdog's peer-lost cancel) so
    that the supervisor resubmits it without the dead host. SLURM's own requeue of such a job reran it on
    the returning node, where slurmctld's pending kill of the dead run often killed the rerun too (a second
    start-up). The time-limit/preemption self-requeue still works: rank 0 (or the container hand-off)
    turns requeue on just before `scontrol requeue`, and the rerun turns it off again."""
    r = spec.resources
    per_node = user_launch.per_node(spec.launch)
    per_node_tasks = 1 if per_node else plan.ranks_per_node
    cpus = r.cpus_per_task * (plan.ranks_per_node if per_node else 1)
    log = _log_pattern(folder, array, "0")
    flags: dict[str, object] = {
        "job-name": _job_name(spec.name), "nodes": r.nodes + r.spare_nodes, "ntasks-per-node": per_node_tasks,
        "cpus-per-task": cpus, "time": r.time, "output": log + ".out", "error": log + ".err",
        "no-requeue": True, "signal": f"USR2@{r.signal_seconds}", "open-mode": "append", "export": "ALL",
    }
    optional: dict[str, object] = {"gpus-per-node": r.gpus_per_node or None, "mem": r.mem, "partition": r.partition,
                                   "account": r.account, "qos": r.qos, "constraint": r.constraint,
                                   "exclude": ",".join(r.exclude), "array": array, "dependency": dependency,
                                   # A lost node must not end the allocation: its spare takes over in a new step
                                   # (fault.injob).
                                   "no-kill": bool(r.spare_nodes)}
    optional.update(sbatch_args.own_directives(spec.slurm))  # mail; a typed --gres replaces --gpus-per-node
    flags.update({k: v for k, v in optional.items() if v})
    extra = [_directive(k, True if v is None else v) for k, v in sbatch_args.check_extra(spec.slurm.extra)]
    return [*(_directive(k, flags[k]) for k in sorted(flags)), *extra]


def _launch_line(spec: Spec, plan: Plan, folder: Path, array: str | None, command: str,
                 run_dirs: Sequence[Path], python: str | None, mode: str) -> tuple[str, str]:
    """The batch script's one srun line (and the comment above it): what every task of the job step runs."""
    log = _log_pattern(folder, array, "%t")
    srun = ["srun", "--unbuffered", "--kill-on-bad-exit=1", "--output", shlex.quote(log + ".out"),
            "--error", shlex.quote(log + ".err")]
    # In a container the runtime sets the folder (-w, --pwd, ...): the snapshot's, when the job runs one.
    flags, prefix = container_wrap(spec, run_dirs, spec.code.dir or _bind_root(run_dirs))
    if user_script(spec):
        # submitit's runner on every task, as for the trainer (requeue, result files); the node entry
        # starts the user's program after the pre-flight.
        cmd = command
        if user_launch.per_node(spec.launch):
            srun += ["--ntasks-per-node=1"]
        note = _user_script_note(spec, plan, command, python)
    elif spec.launch.launcher == "deepspeed":
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


# The allocation's facts, as the dry run shows them (the node fills in their values).
_SHOWN = user_launch.Where(python="python", ds_config="$HPCTRAIN_RUN_DIR/ds_config.json",
                           hostfile="$HPCTRAIN_RUN_DIR/hostfile", nnodes="$SLURM_JOB_NUM_NODES",
                           ranks_per_node="$HPCTRAIN_RANKS_PER_NODE", node_rank="$SLURM_NODEID",
                           master_addr="$MASTER_ADDR", master_port="$MASTER_PORT")


def _user_script_note(spec: Spec, plan: Plan, command: str, python: str | None) -> str:
    """The comment above the srun line of a user-script run: the program every rank (or node) starts."""
    import dataclasses

    if spec.container.runtime != "none":
        py = containers.container_python(spec)
    else:
        py = python or (shlex.split(command)[0] if command.strip() else "python")
    at = dataclasses.replace(_SHOWN, python=py, ranks_per_node=str(plan.ranks_per_node), nnodes=str(plan.nodes),
                             gpu=plan.device == "gpu")
    argv = user_launch.script_command(spec.launch, at)
    keep = frozenset(v for v in (at.ds_config, at.hostfile, at.node_rank, at.master_addr, at.master_port))
    who = (f"one task per node; after the pre-flight its node entry runs {spec.launch.launcher}, which starts "
           f"{plan.ranks_per_node} rank(s)") if user_launch.per_node(spec.launch) else (
           f"{plan.ranks_per_node} task(s) per node, one per rank; after the pre-flight each rank's node entry runs")
    env = "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT HPCTRAIN_RUN_DIR HPCTRAIN_DS_CONFIG"
    return f"{who} (with {env} set):\n#   {user_launch.shell_line(argv, keep)}"


def _shell_path(path: Path) -> str:
    """A quoted shell word for a path; `%a` (array index, as in submitit's folders) expands at run time."""
    pieces = str(path).split("%a")
    return '"${SLURM_ARRAY_TASK_ID}"'.join(shlex.quote(p) if p else "" for p in pieces)


def render_sbatch(spec: Spec, plan: Plan, run_dir: Path, command: str, *, array: str | None = None,
                  run_dirs: Sequence[Path] | None = None, submitit_folder: Path | None = None,
                  python: str | None = None, mode: str = "train", dependency: str = "") -> str:
    """The batch script for a run (or, with `array` and `run_dirs`, for a sweep's job array).

    `command` is what every srun task runs (submitit's `python -u -m submitit.core._submit FOLDER`).
    Logs go where submitit looks for them: SUBMITIT_FOLDER/%j_%t_log.{out,err}
    (default RUN_DIR/submitit). For an array, task i runs in run_dirs[i], or in run_dir with `%a`
    replaced by the array index. `mode` ("train"/"preflight") only matters for launcher deepspeed,
    where the node entry runs instead of submitit's pickled job.
    """
    run_dir = Path(run_dir)
    folder = Path(submitit_folder) if submitit_folder else RunFolder(run_dir).submitit_dir
    dirs = [Path(d) for d in run_dirs] if run_dirs else [run_dir]
    if array and not run_dirs and "%a" not in str(run_dir):
        raise ValueError("render_sbatch: an array needs run_dirs, or a run_dir pattern holding %a")
    checks = [("run folder", run_dir, bool(array) and not run_dirs), ("submitit folder", folder, bool(array)),
              *(("run folder", d, False) for d in run_dirs or ())]
    for key, path, pattern in checks:
        check_job_path(key, path, array_pattern=pattern)
    if array and spec.resources.spare_nodes:
        raise bad_value("resources.spare_nodes", spec.resources.spare_nodes, "a sweep is one job array, and its "
                        "tasks have no in-job driver to hand a spare to", "drop --spare-nodes for a sweep, or "
                        "submit each point as a run of its own")
    if array and spec.fault.health_check:
        raise bad_value("fault.health_check", True, "a sweep is one job array, and its tasks have no in-job driver "
                        "to run the health check", "drop --health-check for a sweep, or submit each point as a "
                        "run of its own")
    launch_line, note = _launch_line(spec, plan, folder, array, command, dirs, python, mode)
    injob = "" if array else _injob_line(spec, plan, command, python, launch_line)
    secrets = secret_names(spec)
    env = [(k, v) for k, v in sorted(spec.env.items()) if k not in secrets]
    return render_template(
        environment(spec), "sbatch.sh.j2", version=__version__, name=spec.name,
        directives=sbatch_directives(spec, plan, folder, array, dependency),
        modules=list(spec.launch.modules), env=env, secret_names=list(secrets), run_dir_expr=_shell_path(run_dir),
        run_dirs=[str(d) for d in dirs] if run_dirs else [], cpu=plan.device == "cpu",
        slots=plan.ranks_per_node, master_port=rendezvous_port_shell(),
        hostfile_awk=hostfile_awk(plan.ranks_per_node, spec), launch_line=launch_line, launcher_note=note,
        runtime=spec.container.runtime,
        container_check=containers.prelaunch_lines(spec, container_binds(spec, dirs)),
        watchdog="" if injob else _watchdog_line(spec, plan, command, python),
        hang_timeout=spec.launch.hang_timeout_s, injob=injob, spare_nodes=plan.spare_nodes,
        in_job_restarts=plan.in_job_restarts, code_dir=spec.code.dir, health=spec.fault.health_check,
    )


def _watchdog_line(spec: Spec, plan: Plan, command: str, python: str | None) -> str:
    """The hang watchdog the batch script runs in the background (hpctrain.fault.supervisor; stdlib only, on the
    host, with the submitting python). Empty when launch.hang_timeout_s is 0."""
    if not spec.launch.hang_timeout_s or not (python or command.strip()):
        return ""
    py = shlex.quote(shlex.split(command)[0]) if command.strip() else str(python)
    # A user script beats only through hpctrain.runtime.report: one that never does is not a hang.
    armed = " --after-first-beat" if user_script(spec) else ""
    return (f'{py} -m hpctrain.fault.supervisor watch "$HPCTRAIN_RUN_DIR" --timeout {spec.launch.hang_timeout_s} '
            f"--world {plan.world_size}{armed}")


def _injob_line(spec: Spec, plan: Plan, command: str, python: str | None, launch_line: str) -> str:
    """The in-job restart driver (hpctrain.fault.injob) wrapping the srun line, when the run has spare nodes,
    in-job restarts or a health check; it also does the watchdog's checks, on each step. Empty otherwise (the
    bare srun line)."""
    f = spec.fault
    if not (plan.in_job_restarts or f.health_check) or not (python or command.strip()):
        return ""
    py = shlex.quote(shlex.split(command)[0]) if command.strip() else str(python)
    own = user_script(spec)
    per_node = 1 if (user_launch.per_node(spec.launch) if own else spec.launch.launcher == "deepspeed") \
        else plan.ranks_per_node
    # A user script beats only through hpctrain.runtime.report: the driver's hang check would take silence for
    # a hang, so it is off for scripts (lost peers and crashes still restart them).
    hang = 0 if own else spec.launch.hang_timeout_s
    # Warm ranks (hpctrain.fault.warm) for the trainer on CPU ranks: a fork after the imports is safe there; a
    # user's script starts its own interpreter anyway, and a GPU rank forked after CUDA's driver was touched is not.
    warm = not own and not spec.resources.gpus_per_node and spec.launch.launcher != "deepspeed"
    return (f'{py} -m hpctrain.fault.injob "$HPCTRAIN_RUN_DIR" --nodes {plan.nodes} --tasks-per-node {per_node} '
            f"--restarts {plan.in_job_restarts} --world {plan.world_size} "
            f"--hang-timeout {hang}" + (" --warm" if warm else "")
            + (f" --straggler-patience {f.straggler_patience_s} --straggler-ratio {f.straggler_ratio:g}"
               if f.straggler_patience_s else "")
            + (f" --health --health-timeout {f.health_timeout_s} --health-matmul-ratio {f.health_matmul_ratio:g} "
               f"--health-net-ratio {f.health_net_ratio:g} --health-min-busbw {f.health_min_busbw_gbps:g}"
               if f.health_check else "")
            + f" -- {launch_line}")
