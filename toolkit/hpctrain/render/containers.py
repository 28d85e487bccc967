"""Container runtimes: how each rank's command is wrapped, and the checks that fail before any rank trains.

Five runtimes (`--container RUNTIME:IMAGE`, or `[container]` in a run file / site profile):

| runtime        | what the srun line becomes                                                           |
| ---            | ---                                                                                  |
| `none`         | the command as is                                                                    |
| `pyxis`        | `srun --container-image=IMAGE --container-mounts=SRC:DST,... --container-workdir=DIR` |
| `apptainer`    | `apptainer exec [--nv] --bind SRC:DST ... --pwd DIR IMAGE CMD`                       |
| `podman`       | `podman --runtime runc run --rm --network host --ipc host ... -v SRC:DST IMAGE CMD`  |
| `charliecloud` | `ch-run --set-env -b SRC:DST ... -c DIR IMAGE -- CMD` (IMAGE: a directory image)     |

The shared filesystem (runs folder, model, data, tokenizer, NVMe folder, extra mounts) is bound at the same
path inside, so every path in spec.toml means the same thing on the login node and in a rank.

Inside the container the command runs with the image's python (`python3` on the image's PATH; the login
node's `sys.executable` means nothing there), behind a one-line guard that stops the rank with a message
naming the runtime when the image lacks hpctrain. The batch script first checks, on the node, that the
runtime is there and the image exists (`prelaunch_lines`); `check_submit` does what can be checked from the
submitting machine.

Pure functions except `check_submit` (which looks at the filesystem and PATH). Only render/sbatch.py and the CLI call
them; nothing heavy is imported.
"""

from __future__ import annotations

import io
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.errors import HpcUsageError, bad_value
from hpctrain.spec.flags import RUNTIMES

if TYPE_CHECKING:
    from hpctrain.spec.model import Spec

BINARY = {"apptainer": "apptainer", "pyxis": "srun", "podman": "podman", "charliecloud": "ch-run"}
# The python that runs a rank inside the image: first python3 on the image's PATH (/opt/venv/bin in
# hpctrain's Dockerfile). Podman and Apptainer use the image's PATH; pyxis gives the image's variables
# precedence; Charliecloud gets it from `--set-env` (the image's /ch/environment).
CONTAINER_PYTHON = "python3"
# Exit status of a rank whose image lacks hpctrain (distinct from training failures).
GUARD_EXIT = 97
# podman passes no host variable unless named (a trailing * matches a prefix). Everything a rank reads:
# SLURM's task layout, the rendezvous, NCCL/HF/torch/DeepSpeed settings, and hpctrain/submitit's own.
PODMAN_PASSTHROUGH = (
    "SLURM_*", "HPCTRAIN_*", "SUBMITIT_*", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "NCCL_*", "HF_*", "TRANSFORMERS_*", "TORCH_*", "DS_*", "DEEPSPEED_*", "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def container_python(spec: Spec) -> str:
    """The python executable inside the image (`container.python` when the spec has it, else python3)."""
    return str(getattr(spec.container, "python", "") or CONTAINER_PYTHON)


def _guard(spec: Spec) -> str:
    """The in-container check, run as `sh -c "$HPCTRAIN_GUARD" PYTHON ARGS...`: PYTHON must import hpctrain
    and submitit, then it is exec'd. A rank started from an image without hpctrain stops here, naming the fix."""
    rt = spec.container.runtime
    msg = (f"hpctrain: {rt} container check failed on $(uname -n): the image has no $0 with hpctrain inside. "
           f"Fix: build the image from hpctrain's Dockerfile (hpctrain image build) and pass --container {rt}:IMAGE")
    return (f'"$0" -c "import hpctrain, submitit" 2>/dev/null || {{ echo "{msg}" >&2; exit {GUARD_EXIT}; }}; '
            'exec "$0" "$@"')


def rank_command(spec: Spec, command: str) -> str:
    """The command a rank runs. In a container: the leading python word replaced by the image's python,
    behind the guard ($HPCTRAIN_GUARD, set by prelaunch_lines). `command` starts with a python word
    (submitit's `PY -u -m submitit.core._submit FOLDER`, or the node entry for launcher deepspeed)."""
    stream = io.StringIO(command)
    lexer = shlex.shlex(stream, posix=True)
    lexer.whitespace_split = True
    first = lexer.get_token() or ""
    if spec.container.runtime == "none" or not os.path.basename(first).startswith("python"):
        return command  # not a python command (a probe such as `bash -c ...`): run as given
    rest = command[stream.tell():].strip()  # the arguments exactly as the caller quoted them
    return " ".join(["sh", "-c", '"$HPCTRAIN_GUARD"', shlex.quote(container_python(spec)), rest]).rstrip()


def wrap(spec: Spec, binds: Sequence[tuple[str, str]], workdir: str) -> tuple[list[str], list[str]]:
    """(extra srun flags, command prefix) for the runtime; both are lists of shell-safe words."""
    c = spec.container
    q = shlex.quote
    gpu = spec.resources.gpus_per_node > 0
    if c.runtime == "none":
        return [], []
    if c.runtime == "pyxis":
        mounts = ",".join(f"{s}:{d}" for s, d in binds)
        flags = [q(f"--container-image={c.image}"), q(f"--container-mounts={mounts}"),
                 q(f"--container-workdir={workdir}")]
        if spec.env:  # the image's variables win over the job's unless named here (pyxis #26, #124)
            flags.append(q("--container-env=" + ",".join(sorted(spec.env))))
        return flags, []
    if c.runtime == "apptainer":
        words = ["apptainer", "exec"] + (["--nv"] if gpu else [])
        for s, d in binds:
            words += ["--bind", q(f"{s}:{d}")]
        return [], words + ["--pwd", q(workdir), q(c.image)]
    if c.runtime == "podman":
        return [], _podman(spec, binds, workdir, gpu)
    if c.runtime == "charliecloud":
        # --set-env: the image's variables (PATH to its python) from /ch/environment; the job's others pass.
        words = ["ch-run", "--set-env"]
        for s, d in binds:
            words += ["-b", q(f"{s}:{d}")]
        return [], words + ["-c", q(workdir), q(c.image), "--"]
    raise unknown_runtime(c.runtime)


def _podman(spec: Spec, binds: Sequence[tuple[str, str]], workdir: str, gpu: bool) -> list[str]:
    from hpctrain.spec.rules import secret_names

    q = shlex.quote
    # runc, a global option (`podman run` has none): crun fails on hybrid cgroup hosts. Limits podman may set
    # without CAP_SYS_RESOURCE (its defaults fail with "error setting rlimit"). Host network: NCCL/gloo talk to
    # the other nodes. Host IPC: ranks in separate containers on one node share memory (NCCL, CUDA IPC) and get
    # the node's /dev/shm (podman's own is 63 MB; --shm-size is refused together with --ipc host).
    words = ["podman", "--runtime", "runc", "run", "--rm", "--network", "host", "--ipc", "host",
             '--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)"', "--ulimit", "nproc=32768:32768"]
    if gpu:
        words += ["--device", "nvidia.com/gpu=all"]
    for s, d in binds:
        words += ["-v", q(f"{s}:{d}")]
    snapshot = ["PYTHONPATH"] if spec.code.dir else []  # the batch script puts the snapshot first on it
    names = [*PODMAN_PASSTHROUGH, *sorted(spec.env), *secret_names(spec), *snapshot]
    for name in dict.fromkeys(names):
        words += ["--env", q(name)]  # by name only: podman copies the value from the srun task
    return words + ["-w", q(workdir), q(spec.container.image)]


def unknown_runtime(runtime: str) -> HpcUsageError:
    return bad_value("container.runtime", runtime, "unknown runtime",
                     "use one of " + ", ".join(RUNTIMES) + " (e.g. --container podman:localhost/hpctrain:cpu)")


# --------------------------------------------------------------------------------------------------
# Checks on the node (rendered into sbatch.sh) and at submit time

def _is_uri(image: str) -> bool:
    return "://" in image


def prelaunch_lines(spec: Spec, binds: Sequence[tuple[str, str]]) -> list[str]:
    """Shell lines run once by the batch script before srun: the runtime is installed here and the image
    exists. Each failure prints `hpctrain: RUNTIME container check failed ...: WHAT. Fix: HOW` and exits 2."""
    c = spec.container
    rt, q = c.runtime, shlex.quote
    if rt == "none":
        return []
    img = q(c.image)
    lines = [f"HPCTRAIN_GUARD={q(_guard(spec))}  # run inside the image by each rank (exit {GUARD_EXIT})",
             "hpctrain_container_error() {",
             f'  echo "hpctrain: {rt} container check failed on $(uname -n): $1. Fix: $2" >&2',
             "  exit 2", "}"]
    binary = BINARY[rt]
    if rt == "pyxis":
        lines.append('case "$(srun --help 2>&1)" in *--container-image*) ;; *) hpctrain_container_error '
                     '"srun has no --container-image (the pyxis plugin is not loaded)" '
                     '"ask the admins for pyxis/enroot, or use --container apptainer:IMAGE" ;; esac')
        return lines
    lines.append(f"command -v {binary} >/dev/null || hpctrain_container_error \"{binary} is not on PATH\" "
                 f"\"install {rt} on the nodes or load its module (launch.modules in the site profile)\"")
    if rt == "apptainer" and not _is_uri(c.image):
        lines.append(f"[ -e {img} ] || hpctrain_container_error \"image $(printf %q {img}) does not exist\" "
                     "\"build the SIF (containers/README.md) on the shared filesystem\"")
    if rt == "podman":
        lines.append(f"podman image exists {img} || hpctrain_container_error "
                     f"\"image $(printf %q {img}) is not in podman's storage\" "
                     "\"build it (containers/build.sh build) or podman pull/load it on every node\"")
    if rt == "charliecloud":
        lines.append('export USER="${USER:-$(id -un)}"  # ch-run refuses to start without $USER')
        lines.append(f"[ -d {img}/bin ] || hpctrain_container_error \"$(printf %q {img}) is not a directory "
                     "image\" \"convert one with containers/build.sh charliecloud TAG DIR (or ch-convert)\"")
        # ch-run binds only onto folders that exist in the image: make the missing ones (once per image).
        targets = " ".join(q(d) for _, d in binds)
        lines.append(f"for d in {targets}; do [ -e {img}\"$d\" ] || mkdir -p {img}\"$d\" || "
                     "hpctrain_container_error \"bind target $d is missing in the image and cannot be "
                     "created\" \"create it in the image folder, or make the image writable\"; done")
    return lines


def check_submit(spec: Spec, executor: str | None = None,
                 which: Callable[[str], str | None] = shutil.which) -> None:
    """What can be checked before submitting: the runtime is known, the executor runs containers, and a
    path-like image exists. `executor` is the resolved one ("slurm"/"local"; default spec.launch.executor).

    The runtime binary lives on the compute nodes, which the submitting machine may not match, so its
    absence is checked there (prelaunch_lines). Set HPCTRAIN_SKIP_IMAGE_CHECK=1 to skip the image checks
    (an image that exists only on the compute nodes)."""
    c = spec.container
    if c.runtime not in RUNTIMES:
        raise unknown_runtime(c.runtime)
    if c.runtime == "none":
        return
    if (executor or spec.launch.executor) == "local":  # it runs NodeJob in-process: the image would be ignored
        raise bad_value("--container", f"{c.runtime}:{c.image}", "the local executor runs the ranks on this "
                        "machine without a container", "use --executor slurm, or drop --container")
    if os.environ.get("HPCTRAIN_SKIP_IMAGE_CHECK") == "1":
        return
    skip = " (or set HPCTRAIN_SKIP_IMAGE_CHECK=1 if it exists only on the compute nodes)"
    if c.runtime == "charliecloud" and not Path(c.image, "bin").is_dir():
        raise bad_value("container.image", c.image, "charliecloud needs a directory image and this is not one",
                        "convert the built image: containers/build.sh charliecloud TAG DIR" + skip)
    if c.runtime == "apptainer" and not _is_uri(c.image) and not Path(c.image).exists():
        raise bad_value("container.image", c.image, "apptainer image file does not exist",
                        "build the SIF (containers/README.md) or use docker://REF" + skip)
    if c.runtime == "podman" and which("podman"):
        try:
            proc = subprocess.run(["podman", "image", "exists", c.image], check=False, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return
        if proc.returncode == 1:
            raise bad_value("container.image", c.image, "podman has no such image on this machine",
                            "build it with `hpctrain image build` (or podman pull/load it on every node)" + skip)


def image_identity(spec: Spec) -> dict[str, object]:
    """What can be known at submit of the image a run uses, for its repro bundle (runs.repro): podman's image
    id and repo digests; for an image file (apptainer SIF, enroot squashfs) its size and mtime (a SIF of several
    GB is not hashed at submit); for a directory image (charliecloud) its mtime; a registry reference as given.
    Nothing is pulled or started."""
    c = spec.container
    info: dict[str, object] = {"runtime": c.runtime, "image": c.image}
    if c.runtime == "none":
        return info
    if c.runtime == "podman" and shutil.which("podman"):
        try:
            proc = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}} {{json .RepoDigests}}", c.image],
                                  check=False, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc = None
        if proc is not None and proc.returncode == 0 and proc.stdout.strip():
            image_id, _, digests = proc.stdout.strip().partition(" ")
            info.update({"id": image_id, "repo_digests": digests, "how": "podman image inspect"})
            return info
    path = Path(c.image.removeprefix("docker://") if _is_uri(c.image) else c.image)
    if not _is_uri(c.image) and path.exists():
        st = path.stat()
        info.update({"size": st.st_size if path.is_file() else None, "mtime": st.st_mtime,
                     "how": "file size and mtime (not hashed)" if path.is_file() else "directory mtime"})
    else:
        info["how"] = "a registry reference: the digest is resolved when the node pulls it"
    return info


PROBE = ("import sys, hpctrain, deepspeed, torch; "
         "print(f'hpctrain {hpctrain.__version__}, deepspeed {deepspeed.__version__}, torch {torch.__version__}, "
         "{sys.executable}')")


def probe_line(spec: Spec) -> str:
    """A bash line that starts the image the way a rank would (same wrapping, same guard; no binds) and
    prints what it holds. Needs $HPCTRAIN_GUARD set to `guard(spec)` in its environment."""
    flags, prefix = wrap(spec, [], "/")
    cmd = " ".join(["sh", "-c", '"$HPCTRAIN_GUARD"', shlex.quote(container_python(spec)), "-c", shlex.quote(PROBE)])
    if spec.container.runtime == "pyxis":
        return " ".join(["srun", "--nodes=1", "--ntasks=1", *flags, cmd])
    return " ".join([*prefix, cmd])


def guard(spec: Spec) -> str:
    """The in-container check that every rank runs (see _guard)."""
    return _guard(spec)

