"""User-facing errors.

Every refusal of bad input is a `HpcUsageError`: a `click.UsageError`, so the CLI prints one message
and exits with status 2, without a traceback. Unexpected errors keep their traceback (flask's rule).
The message always names the field, the bad value and the fix, built by `bad_value`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import click


class HpcUsageError(click.UsageError):
    """Bad input from the user: the message says which field, which value, and how to fix it."""

    def show(self, file: Any = None) -> None:
        """One line, `Error: ...`, without click's usage banner: the message already says what to do.

        (The CLI redacts secret values from the message before it is shown: cli.main._RedactingGroup.)
        """
        click.echo(f"Error: {self.format_message()}", file=file, err=True)


def bad_value(field: str, value: object, why: str, fix: str) -> HpcUsageError:
    """Build the standard refusal: `FIELD = VALUE: WHY. Fix: FIX.`

    One shape for every message, so users (and tests) can find the field and the fix at a glance.
    """
    return HpcUsageError(f"{field} = {value!r}: {why}. Fix: {fix}")


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
