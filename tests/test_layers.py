"""The layer order of the stages (import-linter contracts in pyproject.toml) and the light CLI import path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "deepspeed", "transformers", "submitit", "datasets")


def _env() -> dict[str, str]:
    # This checkout's package first, whatever else PYTHONPATH holds.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "toolkit"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore"}


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports not found: pip install -e '.[test]' (import-linter)"
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, f"lint-imports failed (contracts: pyproject.toml [tool.importlinter]):\n" \
                                f"{out.stdout}\n{out.stderr}"
    assert re.search(r"Contracts: \d+ kept, 0 broken", out.stdout), out.stdout


def test_cli_path_imports_no_heavy_module() -> None:
    """`hpctrain --help` (every command registered) imports none of them, directly or through a dependency."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "hpctrain", "--help"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "hpctrain.cli.main" in loaded, out.stderr[-2000:]
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert heavy == [], f"the CLI path imports {heavy}: import them inside the function that needs them"

