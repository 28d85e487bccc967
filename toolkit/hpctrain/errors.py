"""User-facing errors.

Every refusal of bad input is a `HpcUsageError`: a `click.UsageError`, so the CLI prints one message
and exits with status 2, without a traceback. Unexpected errors keep their traceback (flask's rule).
The message always names the field, the bad value and the fix, built by `bad_value`.

Echoed values are bounded here, once for every message: `bad_value` shows at most MAX_SHOWN characters of
the value (head ... tail, and its length), and every HpcUsageError as shown (and, through the CLI, every
other click refusal: `bound_message`) cuts any run of more than MAX_WORD non-space characters the same way, so a
10 KB `--nodelist` or a 1,000-value `--sweep` is never echoed whole, whichever message quotes it.
Values shown as a fix are TOML (`toml_value`): `[]`, not Python's `()`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from typing import Any

import click

MAX_SHOWN = 160  # characters of a value a message echoes
MAX_WORD = 240  # characters of any one unbroken word of a message (a path, a hostlist, a joined list)
_LONG_WORD = re.compile(rf"\S{{{MAX_WORD + 1},}}")


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    """TEXT whole when it is at most LIMIT characters, else its head and tail around its length:
    `'node[0001-...]...,node9999]' (10,240 characters)`: enough to recognise it, never the whole."""
    if len(text) <= limit:
        return text
    tail = max(limit // 4, 1)
    head = max(limit - tail - 40, 1)
    return f"{text[:head]}...{text[-tail:]} ({len(text):,} characters)"


def bound_message(message: str) -> str:
    """MESSAGE with every over-long word shortened (what a message may echo, whoever built it)."""
    return _LONG_WORD.sub(lambda m: shorten(m.group(0), MAX_WORD), message)


def toml_value(value: object) -> str:
    """VALUE as a run file spells it, for the fix half of a message: [] and ["a"], true, "text", { k = 1 }."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes as JSON for what a message holds
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    return json.dumps(str(value))


class HpcUsageError(click.UsageError):
    """Bad input from the user: the message says which field, which value, and how to fix it."""

    def format_message(self) -> str:
        # Bounded when shown, not when built: the CLI redacts secret values first (cli.main._RedactingGroup),
        # and a long secret cut in two would no longer be found.
        return bound_message(super().format_message())

    def show(self, file: Any = None) -> None:
        """One line, `Error: ...`, without click's usage banner: the message already says what to do.

        (The CLI redacts secret values from the message before it is shown: cli.main._RedactingGroup.)
        """
        click.echo(f"Error: {self.format_message()}", file=file, err=True)


def bad_value(field: str, value: object, why: str, fix: str) -> HpcUsageError:
    """Build the standard refusal: `FIELD = VALUE: WHY. Fix: FIX.`

    One shape for every message, so users (and tests) can find the field and the fix at a glance.
    """
    return HpcUsageError(f"{field} = {shorten(repr(value))}: {why}. Fix: {fix}")


# Linux's limits (limits.h): one name of a path, and a whole path. A longer one makes every stat/open fail
# with ENAMETOOLONG, which pathlib's is_file()/is_dir() raise instead of answering False.
NAME_MAX, PATH_MAX = 255, 4096


def path_problem(text: str, room: int = 0) -> str | None:
    """Why TEXT can be no path on Linux (a name over NAME_MAX bytes, the whole over PATH_MAX less ROOM, the bytes
    kept free for what is added below it), else None."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) + room >= PATH_MAX:
        return (f"{len(data):,} bytes long, and a path has at most {PATH_MAX - 1 - room:,} here (PATH_MAX "
                f"{PATH_MAX}{f' less {room} for the files below it' if room else ''})")
    longest = max(data.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return f"one of its names is {len(longest):,} bytes long, and a file name has at most {NAME_MAX} (NAME_MAX)"
    return None


def check_path(field: str, text: str, fix: str = "give a shorter path", room: int = 0) -> None:
    """Refuse a path no file system can hold, before anything stats it (a traceback otherwise)."""
    problem = path_problem(text, room)
    if problem is not None:
        raise bad_value(field, text, problem, fix)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ' (did you mean X?)' hint for a misspelt key, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key(where: str, key: str, valid: Iterable[str]) -> HpcUsageError:
    """Refuse an unknown key, listing every valid one (submitit's rule: typos are errors)."""
    names = sorted(valid)
    listing = ", ".join(names)
    return HpcUsageError(
        f"{where}: unknown key {key!r}{did_you_mean(key, names)}. Fix: use one of: {listing}"
    )
