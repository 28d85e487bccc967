"""Ask sbatch itself about the escape hatches before a job is queued: `sbatch --test-only` on the script.

hpctrain checks the form of `[slurm] extra` / `--sbatch-arg` (hpctrain.spec.sbatch_args); whether the cluster
knows the option, the reservation, the licence or the dependency only sbatch can say. A refusal is reported
in sbatch's own words, naming the option: when sbatch's message does not name it, the script is tried again
without the extras, then with each one alone (a few more --test-only calls, on a refusal only). A script refused
without its extras too is left to the submission, whose refusal names the resource to change.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import click

from hpctrain import slurmcommands as commands
from hpctrain.errors import HpcUsageError

EXTRA_KEY = "slurm.extra"


def needed(extra: Sequence[str], mail_type: str, dependency: str) -> bool:
    """Only a script with something hpctrain cannot check itself is tested (one RPC to slurmctld less)."""
    return bool(extra or mail_type or dependency)


def test_script(script: str, extra: Sequence[str], dependency: str = "") -> None:
    """`sbatch --test-only` the script; HpcUsageError in sbatch's words when it refuses. A SLURM that does not
    answer is not a refusal: the real sbatch will say the same thing a moment later."""
    words = _refusal(script)
    if words is None:
        return
    culprit = _named(words, extra, dependency) or _bisect(script, extra)
    if culprit is None:
        return  # refused without the hatches too: the submission's own refusal names the resource to change
    if culprit == "--dependency":
        raise HpcUsageError(f"--after = {dependency!r}: sbatch --test-only refused the dependency: {words}. Fix: "
                            "check the run's job with `hpctrain status RUN` (a job SLURM has forgotten cannot be "
                            "waited on), or submit without --after")
    raise HpcUsageError(f"{EXTRA_KEY} = {culprit!r}: sbatch --test-only refused it: {words}. Fix: correct or "
                        "remove it (--sbatch-arg / [slurm] extra); `sbatch --help` lists the options")


def _refusal(script: str) -> str | None:
    try:
        commands.test_only(script)
    except commands.SbatchRejected as exc:
        return _clean(str(getattr(exc.__cause__, "stderr", "") or exc.reason))
    except click.ClickException:
        return None  # unavailable or odd: let the submission itself decide
    return None


def _clean(text: str) -> str:
    """sbatch's message without its prefixes and its "Try sbatch --help" line."""
    lines = [re.sub(r"^sbatch: (error: )?(Batch job submission failed: )?", "", ln.strip())
             for ln in text.splitlines() if ln.strip() and not ln.startswith("Try ")]
    return " | ".join(lines) or "(no message)"


def _named(words: str, extra: Sequence[str], dependency: str) -> str | None:
    low = words.lower()
    for text in extra:
        name = text.partition("=")[0].lstrip("-").lower()
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", low):
            return text
    if dependency and "depend" in low:
        return "--dependency"
    if "reservation" in low:
        return next((t for t in extra if t.startswith("--reservation")), None)
    return None


def _bisect(script: str, extra: Sequence[str]) -> str | None:
    """The one extra that makes sbatch refuse, or None when the script is refused without them too."""
    lines = script.split("\n")
    own = [ln for ln in lines if not _is_extra_line(ln, extra)]
    if not extra or _refusal("\n".join(own)) is not None:
        return None
    header_end = max(i for i, ln in enumerate(own) if ln.startswith("#SBATCH")) + 1
    for text in extra:
        line = next(ln for ln in lines if _is_extra_line(ln, [text]))
        if _refusal("\n".join([*own[:header_end], line, *own[header_end:]])) is not None:
            return text
    return None


def _is_extra_line(line: str, extra: Sequence[str]) -> bool:
    if not line.startswith("#SBATCH --"):
        return False
    name = line.removeprefix("#SBATCH ").partition("=")[0]
    return any(t.partition("=")[0] == name for t in extra)
