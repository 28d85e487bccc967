"""Every HPCTRAIN_* variable the package, its templates or its container files name is listed in hpctrain.envvars
with its meaning, and docs/env.md is that list."""

from __future__ import annotations

import re
from pathlib import Path

from hpctrain import envvars

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bHPCTRAIN_[A-Z0-9_]*[A-Z0-9]\b")


def _named() -> set[str]:
    found: set[str] = set()
    for top in ("toolkit/hpctrain", "templates", "containers"):
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and p.suffix in (".py", ".j2", ".sh", ".def", "") and "__pycache__" not in p.parts:
                found |= set(NAME.findall(p.read_text(encoding="utf-8", errors="replace")))
    return found


def test_every_variable_is_listed_with_a_meaning() -> None:
    named = _named()
    assert sorted(named - set(envvars.HPCTRAIN)) == [], "add these to hpctrain/envvars.py with their meaning"
    assert sorted(set(envvars.HPCTRAIN) - named) == [], "no longer used: remove them from hpctrain/envvars.py"
    assert all(v.strip() for v in [*envvars.HPCTRAIN.values(), *envvars.SET_FOR_RANKS.values()])


def test_docs_page_is_the_module() -> None:
    page = (ROOT / "docs" / "env.md").read_text(encoding="utf-8")
    assert page == envvars.markdown(), "regenerate: python -c 'from hpctrain import envvars; " \
                                       "print(envvars.markdown(), end=\"\")' > docs/env.md"
