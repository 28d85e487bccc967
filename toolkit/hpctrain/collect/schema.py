"""summary_schema.json and a small validator for the part of JSON Schema it uses.

The base install stays free of a `jsonschema` dependency: the schema uses only type, enum, const,
required, properties, additionalProperties (false), items, minimum, oneOf and local $ref, and this
validator covers exactly those (tests cross-check with `jsonschema` when it is installed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("summary_schema.json")
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


def load_schema() -> dict[str, Any]:
    return dict(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))


def validate(doc: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Every violation as "path: problem"; [] when `doc` is valid."""
    root = schema if schema is not None else load_schema()
    errors: list[str] = []
    _check(doc, root, root, "$", errors)
    return errors


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False  # JSON booleans are not numbers, although Python's bool is an int
    return isinstance(value, _TYPES[name])


def _check(v: Any, s: dict[str, Any], root: dict[str, Any], path: str, errors: list[str]) -> None:
    if "$ref" in s:
        ref = s["$ref"]
        target: Any = root
        for part in ref.lstrip("#/").split("/"):
            target = target[part]
        _check(v, target, root, path, errors)
        return
    if "oneOf" in s:
        ok = [sub for sub in s["oneOf"] if not _sub_errors(v, sub, root, path)]
        if len(ok) != 1:
            errors.append(f"{path}: matches {len(ok)} of the oneOf alternatives, needs exactly 1")
        return
    if "const" in s and v != s["const"]:
        errors.append(f"{path}: {v!r} is not {s['const']!r}")
    if "enum" in s and v not in s["enum"]:
        errors.append(f"{path}: {v!r} is not one of {s['enum']}")
    if "type" in s:
        names = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is_type(v, n) for n in names):
            errors.append(f"{path}: {type(v).__name__} {v!r:.60} is not {'/'.join(names)}")
            return
    if "minimum" in s and _is_type(v, "number") and v < s["minimum"]:
        errors.append(f"{path}: {v} < minimum {s['minimum']}")
    if isinstance(v, dict):
        _check_object(v, s, root, path, errors)
    if isinstance(v, list) and "items" in s:
        for i, item in enumerate(v):
            _check(item, s["items"], root, f"{path}[{i}]", errors)


def _check_object(v: dict[str, Any], s: dict[str, Any], root: dict[str, Any], path: str, errors: list[str]) -> None:
    props = s.get("properties", {})
    for key in s.get("required", []):
        if key not in v:
            errors.append(f"{path}: missing {key!r}")
    for key, value in v.items():
        if key in props:
            _check(value, props[key], root, f"{path}.{key}", errors)
        elif s.get("additionalProperties") is False:
            errors.append(f"{path}: unexpected key {key!r} (valid: {', '.join(sorted(props))})")


def _sub_errors(v: Any, s: dict[str, Any], root: dict[str, Any], path: str) -> list[str]:
    errs: list[str] = []
    _check(v, s, root, path, errs)
    return errs
