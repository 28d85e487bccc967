"""Lint is enforced: the suite goes red on a ruff finding (pyproject's selection) or a mypy error.

`make lint` runs the same checks (and lint-imports, which tests/test_layers.py runs) in a venv without torch. Both
run from this interpreter's venv, whose pinned linters come with the test extra. Cost: ruff about 1 CPU-second,
mypy about 6 from a cold cache.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    # Bounded: a wedged linter fails this test instead of hanging CI.
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=600,
                          check=False)


def test_ruff_finds_nothing() -> None:
    res = _run("ruff", "check", "--no-cache", "toolkit", "tests", "bench")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    # Its own cache: a cold one costs seconds, and a shared one could be half written by a mypy run beside it.
    res = _run("mypy", "--cache-dir", str(tmp_path / "mypy"))
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
