"""Escape hatches to sbatch: `[slurm] extra = [...]`, `--sbatch-arg`, `--mail-type/--mail-user`.

Every entry of `slurm.extra` is ONE sbatch option in its long form, `--name` or `--name=value`, and reaches the
batch script as its own `#SBATCH --name='value'` line (the value shell-quoted, which sbatch's #SBATCH parser
reads as one word). What is refused, and why:

- anything but `--name[=value]`: a short option (`-p gpu`), a bare word, `--name value` with a space (two
  words), a value holding a second option (`--reservation=R --nodes=9`), control characters;
- an option hpctrain sets itself (OWNED): the allocation shape, logs, signal, requeue and array come from the
  spec and the plan, where every count is decided once; the refusal names the flag or key that sets it. An
  abbreviation of such an option (`--node=9`: sbatch's getopt would read `--nodes`) is refused as well.

The one override rule: `--gres=gpu[:TYPE]:N` (a typed GPU request, e.g. `gpu:a100:8`) replaces hpctrain's own
`--gpus-per-node`, and N must equal `resources.gpus_per_node` (the plan starts one rank per GPU).

What sbatch itself thinks of an option (unknown name, bad reservation, ...) is asked with `sbatch --test-only`
at submit (hpctrain.slurm.sbatch_check). Stdlib only, no imports from the rest of spec (rules.py calls in).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from hpctrain.errors import bad_value

KEY = "slurm.extra"
_NAME = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_FIX_FORM = "give each option as its own entry in its long form, --name or --name=value (e.g. --reservation=R)"

# Options hpctrain sets from the spec or for itself -> what to do instead.
_SHAPE = "the plan derives every count from the spec once"
OWNED: dict[str, str] = {
    "nodes": f"{_SHAPE}; pass --nodes N",
    "ntasks": f"{_SHAPE}: one task per rank; pass --nodes and --gpus-per-node",
    "ntasks-per-node": f"{_SHAPE}: one task per rank; pass --gpus-per-node (or set [resources] tasks_per_node)",
    "ntasks-per-core": f"{_SHAPE}: one task per rank", "ntasks-per-socket": f"{_SHAPE}: one task per rank",
    "ntasks-per-gpu": f"{_SHAPE}: one task per rank",
    "cpus-per-task": f"{_SHAPE}; pass --cpus-per-task N", "cpus-per-gpu": f"{_SHAPE}; pass --cpus-per-task N",
    "gpus": f"{_SHAPE}; pass --gpus-per-node N (a typed request: --gres=gpu:TYPE:N)",
    "gpus-per-node": "pass --gpus-per-node N (a typed request: --gres=gpu:TYPE:N)",
    "gpus-per-task": f"{_SHAPE}: one GPU per rank; pass --gpus-per-node N",
    "time": "pass --time", "partition": "pass --partition", "account": "pass --account", "qos": "pass --qos",
    "constraint": "set [resources] constraint", "exclude": "set [resources] exclude",
    "mem": "pass --mem", "job-name": "pass --job-name",
    "output": "hpctrain writes the logs where submitit and `hpctrain logs` read them",
    "error": "hpctrain writes the logs where submitit and `hpctrain logs` read them",
    "open-mode": "hpctrain appends one log per attempt",
    "signal": "set [resources] signal_seconds (hpctrain checkpoints on USR2 before the time limit)",
    "requeue": "hpctrain decides requeueing (a lost node goes to the supervisor); set --retries",
    "no-requeue": "hpctrain decides requeueing (a lost node goes to the supervisor); set --retries",
    "export": "the ranks need the submitting environment (secrets travel that way); set [env]",
    "export-file": "the ranks need the submitting environment; set [env]",
    "array": "a sweep is hpctrain's job array; pass --sweep KEY=V1,V2",
    "comment": "hpctrain tags the submission with --comment to find the job if sbatch's answer is lost",
    "dependency": "pass --after RUN[:ok|any] on submit (a dependency holds for one submission, not for retries)",
    "mail-type": "pass --mail-type (or set [slurm] mail_type)", "mail-user": "pass --mail-user",
    "parsable": "not a job option", "test-only": "not a job option", "wrap": "hpctrain writes the batch script",
    "wait": "it would block hpctrain submit until the job ends; use `hpctrain status`",
    "help": "not a job option", "usage": "not a job option", "version": "not a job option",
    "input": "the batch script's stdin is not the training's", "chdir": "the batch script sets its own folder",
}

# SLURM's --mail-type values (sbatch(1), 22.05).
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")
_MAIL_USER = re.compile(r"[A-Za-z0-9_.+%=~][A-Za-z0-9_.+%=~@-]*")


def parse_option(text: str) -> tuple[str, str | None]:
    """`--name=value` -> ("name", "value"); `--name` -> ("name", None). Refuses everything else."""
    if not isinstance(text, str) or not text:
        raise bad_value(KEY, text, "an empty entry", _FIX_FORM)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise bad_value(KEY, repr(text), "contains a newline or control character, which ends an #SBATCH line",
                        _FIX_FORM)
    if not text.startswith("--"):
        why = "a short option (sbatch reads the rest as its value)" if text.startswith("-") else "not an option"
        raise bad_value(KEY, text, why, _FIX_FORM)
    name, sep, value = text[2:].partition("=")
    if any(c.isspace() for c in name):
        raise bad_value(KEY, text, "a space before any '=': sbatch would read two words (a second option, or a "
                        "value it takes for one)", _FIX_FORM)
    if not _NAME.fullmatch(name):
        raise bad_value(KEY, text, "not one option named in sbatch's style (lower-case words joined by '-')",
                        _FIX_FORM)
    if sep and re.search(r"\s-", value):
        raise bad_value(KEY, text, "its value holds what looks like a second option", _FIX_FORM)
    if "\\" in text:  # sbatch's #SBATCH parser takes a backslash as an escape and drops it, without a word
        raise bad_value(KEY, text, "holds a backslash, which sbatch silently drops from an #SBATCH line",
                        "write the value without '\\' (sbatch would read a different value than the one given)")
    return name, (value if sep else None)


def owner(name: str) -> tuple[str, str] | None:
    """(the option hpctrain owns, what to do instead) when `name` is it, or sbatch would read it as it."""
    if name in OWNED:
        return name, OWNED[name]
    # sbatch (getopt_long) accepts any unambiguous abbreviation: --node=9 is --nodes=9.
    hits = sorted(o for o in OWNED if o.startswith(name))
    return (hits[0], OWNED[hits[0]]) if hits else None


def check_extra(extra: Sequence[str]) -> list[tuple[str, str | None]]:
    """Validate every entry; the parsed (name, value) pairs in order. An option given twice is refused."""
    seen: dict[str, str] = {}
    out = []
    for text in extra:
        name, value = parse_option(text)
        owned = owner(name)
        if owned is not None:
            read = "" if owned[0] == name else f"sbatch reads --{name} as --{owned[0]}, and "
            raise bad_value(KEY, text, f"{read}hpctrain sets --{owned[0]} itself", owned[1])
        if name in seen:
            raise bad_value(KEY, text, f"--{name} is given twice (also {seen[name]!r})", "keep one of them")
        seen[name] = text
        out.append((name, value))
    return out


def merge_extra(lower: Iterable[str], upper: Iterable[str]) -> tuple[str, ...]:
    """Layers of extras (site < run file < flags): the union, where an option named again in a later layer
    replaces the earlier one (the site's --reservation=A, the flag's --reservation=B: B)."""
    merged: dict[object, str] = {}
    for i, text in enumerate([*lower, *upper]):
        # Not text (`extra = [{}]`, a list in the list): kept as it is, for the type check to refuse by its place.
        name: object = (text[2:].partition("=")[0] if text.startswith("--") else text) if isinstance(text, str) \
            else ("entry", i)
        merged.pop(name, None)
        merged[name] = text
    return tuple(merged.values())


def gres_gpus(extra: Sequence[str]) -> int | None:
    """The GPU count of a `--gres=gpu[:TYPE]:N` entry, None when no --gres asks for GPUs."""
    for text in extra:
        if not text.startswith("--gres="):
            continue
        for item in text.removeprefix("--gres=").split(","):
            parts = item.split(":")
            if parts[0] == "gpu":
                last = parts[-1].split("(")[0]
                return int(last) if len(parts) > 1 and last.isdigit() else 1
    return None


def check_gres(extra: Sequence[str], gpus_per_node: int) -> None:
    """The override rule: a typed GPU request stands in for --gpus-per-node, with the same count."""
    n = gres_gpus(extra)
    if n is not None and n != gpus_per_node:
        raise bad_value(KEY, next(t for t in extra if t.startswith("--gres=")),
                        f"asks for {n} GPU(s) per node but resources.gpus_per_node is {gpus_per_node} (one rank "
                        "per GPU); --gres=gpu:TYPE:N replaces hpctrain's --gpus-per-node",
                        f"pass --gpus-per-node {n}, or write the same count in --gres")


def check_mail(mail_type: str, mail_user: str) -> None:
    """`slurm.mail_type`: SLURM's comma-separated types; `slurm.mail_user`: an address or user name."""
    if mail_type:
        for item in mail_type.split(","):
            if item.strip().upper() not in MAIL_TYPES:
                raise bad_value("slurm.mail_type", mail_type, f"{item!r} is not a SLURM mail type",
                                "pass --mail-type with a comma-separated list of " + ", ".join(MAIL_TYPES))
    if mail_user:
        if not _MAIL_USER.fullmatch(mail_user):
            raise bad_value("slurm.mail_user", mail_user, "not a mail address or user name",
                            "pass --mail-user you@example.org")
        if not mail_type:
            raise bad_value("slurm.mail_user", mail_user, "without --mail-type SLURM sends no mail",
                            "add --mail-type END,FAIL (or ALL)")


def normal_mail_type(mail_type: str) -> str:
    return ",".join(i.strip().upper() for i in mail_type.split(",") if i.strip())



def own_directives(slurm: object) -> dict[str, object]:
    """The directives the [slurm] section adds beside hpctrain's own: mail, and None for --gpus-per-node when a
    typed `--gres=gpu:...` stands in for it."""
    out: dict[str, object] = {"mail-type": getattr(slurm, "mail_type", ""),
                              "mail-user": getattr(slurm, "mail_user", "")}
    if gres_gpus(getattr(slurm, "extra", ())) is not None:
        out["gpus-per-node"] = None
    return out
