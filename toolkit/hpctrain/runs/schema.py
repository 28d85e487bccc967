"""The registry's schema: its text, its version (`PRAGMA user_version`), migration from every older
layout, and telling a damaged file from a fresh one. Used by hpctrain.runs.registry only."""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_VERSION = 1  # 0: the unversioned layout of _SCHEMA without attempts.note/tag
_BUSY_TIMEOUT_S = 5.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id   TEXT PRIMARY KEY,
    name     TEXT NOT NULL,
    folder   TEXT NOT NULL,
    created  REAL NOT NULL,
    executor TEXT NOT NULL,
    spec     TEXT NOT NULL DEFAULT '{}',
    state    TEXT NOT NULL DEFAULT 'PENDING'
);
CREATE TABLE IF NOT EXISTS attempts (
    run_id        TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
    attempt       INTEGER NOT NULL,
    job_id        TEXT NOT NULL,
    state         TEXT NOT NULL DEFAULT 'PENDING',
    nodes         TEXT NOT NULL DEFAULT '',
    submitted     REAL,
    started       REAL,
    ended         REAL,
    exit_code     TEXT,
    failure_class TEXT,
    note          TEXT,
    tag           TEXT,
    PRIMARY KEY (run_id, attempt)
);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created);
"""


def has_tables(conn: sqlite3.Connection) -> bool:
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()}
    return {"runs", "attempts"} <= names


def migrate(conn: sqlite3.Connection) -> None:
    """Bring any older layout to SCHEMA_VERSION inside the caller's write transaction: create what
    is missing, then add every column the file lacks (version 0 had no attempts.note/tag; a file
    from an early build may lack more). Additive only, so an older hpctrain still reads the file."""
    for stmt in filter(str.strip, _SCHEMA.split(";")):
        conn.execute(stmt)  # CREATE ... IF NOT EXISTS: executescript() would COMMIT our transaction
    for table, columns in _expected_columns().items():
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})").fetchall()}
        for name, decl in columns.items():
            if name not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {_addable(decl)}")
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def _expected_columns() -> dict[str, dict[str, str]]:
    """{table: {column: declaration}} parsed from _SCHEMA (one column per line)."""
    out: dict[str, dict[str, str]] = {}
    table = ""
    for line in _SCHEMA.splitlines():
        line = line.strip().rstrip(",")
        if line.startswith("CREATE TABLE"):
            table = line.split()[5]
            out[table] = {}
        elif table and line and not line.startswith((")", "PRIMARY", "CREATE")):
            name, _, decl = line.partition(" ")
            out[table][name] = decl.strip()
    return out


def _addable(decl: str) -> str:
    """ALTER TABLE ADD COLUMN refuses PRIMARY KEY and NOT NULL without a default: keep the type and
    the default (an old row gets the default, or NULL)."""
    decl = decl.replace("PRIMARY KEY", "").replace(" REFERENCES runs(run_id) ON DELETE CASCADE", "")
    if "NOT NULL" in decl and "DEFAULT" not in decl:
        decl = decl.replace("NOT NULL", "")
    return " ".join(decl.split())


_HEADER = b"SQLite format 3\x00"


def damage(path: Path) -> str | None:
    """Why the file at `path` is no registry (empty, truncated, not SQLite, no tables), else None.

    hpctrain creates a registry whole (registry._create: schema written into a temp file, then linked into
    place), so a file that is empty or has no tables is damage however young it is: a 0-byte registry
    taken for a fresh one would hide every run (`list` empty, the next submit the only row)."""
    try:
        st = path.stat()
        with path.open("rb") as fh:
            head = fh.read(len(_HEADER))
    except FileNotFoundError:
        return None
    except OSError:
        return None  # unreadable: the connection reports it (RegistryUnavailable names the fix)
    if st.st_size == 0:
        return "the file is empty"
    if head != _HEADER:
        return "the file is truncated or not a SQLite database"
    try:
        conn = sqlite3.connect(path.absolute().as_uri() + "?mode=ro", uri=True, timeout=_BUSY_TIMEOUT_S)
        try:
            tables = has_tables(conn)
            if tables:
                conn.execute("SELECT count(*) FROM runs").fetchone()
                conn.execute("SELECT count(*) FROM attempts").fetchone()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return None  # locked or similar: not damage; the caller's own connection waits for it
    except sqlite3.DatabaseError as exc:
        return f"the file is damaged ({exc})"
    if not tables:
        return "the file has no registry tables"
    return None
