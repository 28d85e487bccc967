"""Which environment variables and values are secrets, and how they are kept out of files and messages.

Stdlib only, below every stage: the spec's checks, the registry's key filter, the CLI's redaction and
dispatch's last look at the batch script all use these definitions.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

# These variables are secret whatever the site says: they reach ranks by name through --export=ALL.
ALWAYS_SECRET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")


_SECRET_NAME_PARTS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS"}
_SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{20,}|(sk|pk|ghp|gho|ghs|github_pat|xox[abpr])[-_][A-Za-z0-9_-]{16,}"
    r"|[0-9a-f]{40}|AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----.*)",
    re.DOTALL,
)


def is_secret_name(name: str) -> bool:
    """Whether a variable or key name says it holds a credential (HF_TOKEN, DB_PASSWORD, WANDB_API_KEY)."""
    return bool(set(name.upper().split("_")) & _SECRET_NAME_PARTS) or name.upper().endswith("API_KEY")


def looks_secret(name: str, value: str) -> bool:
    """Guess whether an [env] entry carries a credential, by its name or the shape of its value."""
    return is_secret_name(name) or bool(_SECRET_VALUE.fullmatch(value.strip()))


# Values shorter than this are not searched for or redacted: no credible credential is this short,
# and a short value ("1", "abc") occurs in any script by chance, so searching for it would block
# every submit. Real tokens (hf_..., 40-hex, AKIA..., sk-...) are 20 characters or more.
MIN_SECRET_LEN = 8


def secret_values(names: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """NAME -> value for every secret variable set in the submitting environment (credible lengths only)."""
    env = os.environ if environ is None else environ
    return {n: v for n in names if len(v := env.get(n, "")) >= MIN_SECRET_LEN}


def redact_environment(text: str, names: Iterable[str] = ()) -> str:
    """TEXT with the value of every secret variable of this environment replaced by <redacted:NAME>.

    Secret: ALWAYS_SECRET, NAMES (a spec's secret_env), and any variable whose name looks secret.
    """
    candidates = {*ALWAYS_SECRET, *names, *(n for n in os.environ if looks_secret(n, ""))}
    for name, value in sorted(secret_values(candidates).items(), key=lambda kv: -len(kv[1])):
        text = text.replace(value, f"<redacted:{name}>")
    return text


# --------------------------------------------------------------------------------------------------
# Files that hold credentials by their name: never copied into a run folder (`--snapshot`, repro/git.diff),
# whatever .gitignore says. Matched, case-insensitively, against every part of a path (a `.env/` folder too).
DENIED_FILES = (".env*", "*.pem", "*.key", "id_*", ".netrc", "credentials*", ".git-credentials", "*.p12")


def denied_file(path: str) -> str | None:
    """The DENIED_FILES pattern one part of PATH (relative, '/'-separated) matches, or None."""
    import fnmatch

    for part in path.lower().split("/"):
        for pattern in DENIED_FILES:
            if fnmatch.fnmatchcase(part, pattern):
                return pattern
    return None


def known_secret_values(names: Iterable[str] = ()) -> dict[str, bytes]:
    """NAME -> value (UTF-8) of every secret variable of this environment: ALWAYS_SECRET, NAMES (a spec's
    secret_env) and variables whose names look secret; what redact_environment hides from messages."""
    candidates = {*ALWAYS_SECRET, *names, *(n for n in os.environ if looks_secret(n, ""))}
    return {n: v.encode("utf-8", "surrogateescape") for n, v in secret_values(candidates).items()}


def secret_in(data: bytes, values: Mapping[str, bytes]) -> str | None:
    """The name of the first secret variable whose value DATA holds, or None."""
    return next((name for name, value in sorted(values.items()) if value in data), None)
