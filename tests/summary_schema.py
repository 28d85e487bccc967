"""Validate summary documents against the schema hpctrain ships (hpctrain/collect/summary_schema.json)
with `jsonschema` (the test extra), so that the package carries no validator of its own."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import jsonschema


def load_schema() -> dict[str, Any]:
    text = resources.files("hpctrain.collect").joinpath("summary_schema.json").read_text(encoding="utf-8")
    return dict(json.loads(text))


def summary_errors(doc: Any) -> list[str]:
    """Every violation as "path: message" (oneOf failures list their alternatives' errors); [] if valid."""
    schema = load_schema()
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=None)
    out: list[str] = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        out.append(f"{err.json_path}: {err.message}")
        out += [f"{sub.json_path}: {sub.message}" for sub in err.context or ()]
    return out
