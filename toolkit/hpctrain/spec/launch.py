"""The user's own program (`submit --script/--module`): its command line, built in one place.

The batch script shows it (dry run) with the allocation's facts as shell variables; the node entry runs it
with their values. Both call `script_command`, so what `--dry-run` prints is what every node starts.
The command is an argv list: it reaches `subprocess` (and DeepSpeed's runner, torchrun and accelerate pass
the script's arguments on as a list too), so an argument holding spaces, quotes, `$(...)` or newlines stays
one argument, exactly. `shell_word` writes one for a person to read and paste into bash.

Stdlib only: the login side and every rank import it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from hpctrain.spec.model import Launch

PER_NODE_LAUNCHERS = ("torchrun", "deepspeed", "accelerate")  # one task per node starts the node's ranks


@dataclass(frozen=True)
class Where:
    """The allocation's facts a launcher needs (values on a node; shell variables in the dry run)."""

    python: str
    ds_config: str  # RUN/ds_config.json (or the effective one)
    hostfile: str
    nnodes: str
    ranks_per_node: str
    node_rank: str
    master_addr: str
    master_port: str
    gpu: bool = False


def per_node(launch: Launch) -> bool:
    """One task per node (a launcher starts the node's ranks), not one task per rank (srun)."""
    return launch.launcher in PER_NODE_LAUNCHERS


def user_args(launch: Launch, ds_config: str) -> list[str]:
    """The script's own arguments: the words after `--`, then `--deepspeed_config PATH` when asked for."""
    extra = ["--deepspeed_config", ds_config] if launch.pass_ds_config else []
    return [*launch.args, *extra]


def script_command(launch: Launch, at: Where) -> list[str]:
    """The argv that starts the user's program: every rank's (srun) or every node's (the other launchers)."""
    module = bool(launch.module)
    target = launch.module or launch.script
    args = user_args(launch, at.ds_config)
    if launch.launcher == "srun":
        return [at.python, "-u", *(["-m"] if module else []), target, *args]
    if launch.launcher == "torchrun":
        return [at.python, "-m", "torch.distributed.run", f"--nnodes={at.nnodes}",
                f"--nproc-per-node={at.ranks_per_node}", f"--node-rank={at.node_rank}",
                f"--master-addr={at.master_addr}", f"--master-port={at.master_port}",
                *(["--module"] if module else []), target, *args]
    if launch.launcher == "deepspeed":
        # --no_ssh: every node runs its own runner under srun (containers have no sshd). DeepSpeed's runner
        # passes --local_rank=N to the script, as DeepSpeed scripts expect.
        return [at.python, "-u", "-m", "deepspeed.launcher.runner", "--no_ssh", "--hostfile", at.hostfile,
                "--node_rank", at.node_rank, "--master_addr", at.master_addr, "--master_port", at.master_port,
                *(["--module"] if module else []), target, *args]
    if launch.launcher == "accelerate":
        # --multi_gpu on CPU ranks too: it is accelerate's torchrun underneath, which starts the node's ranks with
        # their rank variables. Its `--cpu` launcher starts ONE process per node (more need mpirun): a 2-rank node
        # ran one process without RANK, and DeepSpeed looked for MPI (seen on the cluster, 2026-12-03). On CPU
        # ranks the node sets ACCELERATE_USE_CPU (node/launch/script.child_env): Accelerator() then uses gloo.
        total = _times(at.nnodes, at.ranks_per_node)
        return [at.python, "-m", "accelerate.commands.launch", "--num_machines", at.nnodes, "--num_processes", total,
                "--machine_rank", at.node_rank, "--main_process_ip", at.master_addr, "--main_process_port",
                at.master_port, "--multi_gpu", *(["--module"] if module else []), target, *args]
    raise ValueError(f"launch.launcher = {launch.launcher!r}: no command for it")


def _times(a: str, b: str) -> str:
    """a*b for numbers, or the shell arithmetic for variables (the dry run)."""
    if a.isdigit() and b.isdigit():
        return str(int(a) * int(b))
    return f"$(({a.strip('${}')} * {b.strip('${}')}))"


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", "'": "\\'"}


def shell_word(arg: str) -> str:
    """One argument as bash reads it back, on one line: shlex.quote, or $'...' with escapes when the argument
    holds a control character (a newline would otherwise end the line it is shown on)."""
    if not any(ord(c) < 32 or ord(c) == 127 for c in arg):
        return shlex.quote(arg)
    body = "".join(_ESCAPES.get(c, f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c) for c in arg)
    return f"$'{body}'"


def shell_line(argv: list[str], keep: frozenset[str] = frozenset()) -> str:
    """The argv as one line of bash; words in `keep` (the dry run's "$MASTER_ADDR"...) are double-quoted, so that
    bash expands their variables."""
    return " ".join(f'"{w}"' if w in keep or _only_vars(w, keep) else shell_word(w) for w in argv)


def _only_vars(word: str, keep: frozenset[str]) -> bool:
    """`--master-addr=$MASTER_ADDR`: a flag whose value is a kept variable (quoted as a whole: "...")."""
    flag, sep, value = word.partition("=")
    return bool(sep) and value in keep and flag.startswith("-") and shlex.quote(flag) == flag


# Flags that reach a user's program only through RUN/ds_config.json, and flags only hpctrain's trainer reads.
DS_CONFIG_FLAGS = ("--zero", "--offload", "--offload-ratio", "--offload-device", "--nvme-path", "--precision",
                   "--micro-batch", "--grad-accum", "--global-batch")
TRAINER_FLAGS = ("--data", "--eval-every")  # (--steps stays: status and summary count progress against it)
DS_CONFIG_ENV = "HPCTRAIN_DS_CONFIG"


def unapplied_flags(launch: Launch, given: dict[str, object], script_text: str | None) -> list[str]:
    """Warnings (one line each, naming the flags) for flags given to `submit --script/--module` that the program
    may never see. `given` holds the option values by flag; `script_text` is the script's source (None when it
    cannot be read, e.g. a --module): a program given --pass-ds-config, or whose source reads HPCTRAIN_DS_CONFIG,
    uses hpctrain's ds_config.json; one that builds its own DeepSpeed config ignores --zero, --micro-batch ...."""
    if not (launch.script or launch.module):
        return []
    program = launch.script or f"-m {launch.module}"
    named = [f for f in (*DS_CONFIG_FLAGS, *TRAINER_FLAGS) if given.get(f) is not None]
    lines = []
    ds = [f"{f} {given[f]}" for f in named if f in DS_CONFIG_FLAGS]
    reads = launch.pass_ds_config or (script_text is not None and DS_CONFIG_ENV in script_text)
    if ds and not reads:
        seen = "its source never reads" if script_text is not None else "hpctrain cannot tell whether it reads"
        lines.append(f"warning: {', '.join(ds)} only set RUN/ds_config.json, and {program} is not given it "
                     f"(--pass-ds-config) and {seen} ${DS_CONFIG_ENV}: a script that builds its own DeepSpeed config "
                     "ignores them. Fix: add --pass-ds-config, or load the file named by "
                     f"${DS_CONFIG_ENV} in the script, or set these in the script and drop the flags.")
    trainer = [f for f in named if f in TRAINER_FLAGS]
    if trainer:
        lines.append(f"warning: {', '.join(trainer)} {'is' if len(trainer) == 1 else 'are'} read by hpctrain's "
                     f"trainer only; {program} does not get {'it' if len(trainer) == 1 else 'them'}. Fix: pass the "
                     "script's own argument after `--` and drop the flag.")
    return lines
