"""The run registry: runs and their attempts in one SQLite file in the user's state dir.

Many `hpctrain` processes write at once (a sweep script, a team on one login node), so:
WAL journal (readers never block the writer), a busy timeout, short transactions, BEGIN IMMEDIATE
for every write (take the write lock up front instead of failing on lock upgrade mid-way), and a
bounded retry loop on "database is locked" for the cases busy_timeout does not cover.

Nothing secret is stored here: callers pass a spec summary already stripped of secrets
(`hpctrain.slurm.dispatch.spec_summary`), and this module refuses well-known secret keys anyway.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click

from hpctrain.secret import is_secret_name
from hpctrain.states import JobState, is_final

T = TypeVar("T")
_ATTEMPT_FIELDS = frozenset({"job_id", "state", "nodes", "submitted", "started", "ended",
                             "exit_code", "failure_class"})
_BUSY_TIMEOUT_MS = 10_000
_RETRIES = 12

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
    PRIMARY KEY (run_id, attempt)
);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created);
"""


class RegistryUnavailable(click.ClickException):
    """The registry file cannot be opened or stays locked: say where it is and how to move it."""

    def __init__(self, path: Path, exc: BaseException) -> None:
        super().__init__(f"cannot use the run registry {path}: {exc}. Fix: make its folder writable, or set "
                         "HPCTRAIN_STATE_DIR to a writable local folder (not NFS: SQLite locking needs it)")


class RunNotFound(LookupError):
    """No run matches; `close` holds the run ids that look similar (for the CLI's message)."""

    def __init__(self, ref: str, close: list[str], ambiguous: bool = False) -> None:
        self.ref, self.close, self.ambiguous = ref, close, ambiguous
        super().__init__(ref)


@dataclass
class Attempt:
    run_id: str
    attempt: int
    job_id: str
    state: str = JobState.PENDING
    nodes: str = ""
    submitted: float | None = None
    started: float | None = None
    ended: float | None = None
    exit_code: str | None = None
    failure_class: str | None = None

    @property
    def final(self) -> bool:
        return is_final(self.state)  # SLURM will not change its mind: never re-queried


@dataclass
class Run:
    run_id: str
    name: str
    folder: str
    created: float
    executor: str
    spec: dict[str, Any]
    state: str
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def latest(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_dir() -> Path:
    """$HPCTRAIN_STATE_DIR, else $XDG_STATE_HOME/hpctrain, else ~/.local/state/hpctrain."""
    if os.environ.get("HPCTRAIN_STATE_DIR"):
        return Path(os.environ["HPCTRAIN_STATE_DIR"])
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "hpctrain"


def default_db_path() -> Path:
    return state_dir() / "registry.sqlite3"


class Registry:
    """Open per call: each method takes its own short connection so nothing is held between calls."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        self._ready = False

    # -- plumbing -----------------------------------------------------------------------------
    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        old = os.umask(0o077)  # the db and its -wal/-shm files are private to the user
        try:
            conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        finally:
            os.umask(old)
        try:
            conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA foreign_keys=ON")
            # WAL + NORMAL: a crash never corrupts the db; only a power cut can lose the last commit.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.row_factory = sqlite3.Row
            if not self._ready:
                self._init(conn)
            yield conn
        finally:
            conn.close()

    def _init(self, conn: sqlite3.Connection) -> None:
        def init() -> None:
            # journal_mode=WAL is persistent in the file; setting it again is a cheap no-op.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")
            try:
                # executescript() would COMMIT our transaction first; run statements one by one.
                for stmt in filter(str.strip, _SCHEMA.split(";")):
                    conn.execute(stmt)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        _retry_locked(init)
        self._ready = True

    def _guard(self, fn: Callable[[], T]) -> T:
        """Lock retries, then one clear error instead of a sqlite3 traceback."""
        try:
            return _retry_locked(fn)
        except sqlite3.IntegrityError:
            raise  # a duplicate run id is a caller bug, not an unusable registry
        except (sqlite3.DatabaseError, OSError) as exc:
            raise RegistryUnavailable(self.path, exc) from exc

    def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` in one BEGIN IMMEDIATE transaction, retried whole if the db stays locked."""

        def once() -> T:
            with self._connect() as conn:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(conn)
                    conn.execute("COMMIT")
                    return out
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise

        return self._guard(once)

    def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def once() -> T:
            with self._connect() as conn:
                return fn(conn)

        return self._guard(once)

    # -- writes -------------------------------------------------------------------------------
    def add_run(self, run_id: str, name: str, folder: str, executor: str, spec: dict[str, Any],
                created: float | None = None, state: str = JobState.PENDING) -> None:
        spec_text = json.dumps(_strip_secrets(spec), sort_keys=True, default=str)
        when = time.time() if created is None else created
        self._write(lambda c: c.execute(
            "INSERT INTO runs(run_id,name,folder,created,executor,spec,state) VALUES (?,?,?,?,?,?,?)",
            (run_id, name, folder, when, executor, spec_text, state)))

    def add_submitted(self, run: dict[str, Any], attempt: Attempt) -> None:
        """Add a run and its first attempt in ONE transaction: never a run without its job id."""
        self.add_submitted_many([(run, attempt)])

    def add_submitted_many(self, items: list[tuple[dict[str, Any], Attempt]]) -> None:
        """A whole sweep's runs + attempts in one transaction: all recorded, or none."""

        def tx(c: sqlite3.Connection) -> None:
            for run, attempt in items:
                c.execute(
                    "INSERT INTO runs(run_id,name,folder,created,executor,spec,state) VALUES (?,?,?,?,?,?,?)",
                    (run["run_id"], run["name"], run["folder"], run.get("created") or time.time(),
                     run["executor"], json.dumps(_strip_secrets(run.get("spec", {})), sort_keys=True,
                                                 default=str), attempt.state))
                _insert_attempt(c, attempt)

        self._write(tx)

    def add_attempt(self, attempt: Attempt) -> None:
        def tx(c: sqlite3.Connection) -> None:
            _insert_attempt(c, attempt)
            c.execute("UPDATE runs SET state=? WHERE run_id=?", (attempt.state, attempt.run_id))

        self._write(tx)

    def update_attempt(self, run_id: str, attempt: int, **fields: Any) -> None:
        """Update columns of one attempt; the run's state follows its latest attempt."""
        self.update_attempts([(run_id, attempt, fields)])

    def update_attempts(self, updates: list[tuple[str, int, dict[str, Any]]]) -> None:
        """Many attempt updates in ONE transaction (what a `status`/`list` refresh writes)."""
        for _, _, fields in updates:
            bad = sorted(set(fields) - _ATTEMPT_FIELDS)
            if bad:
                raise ValueError(f"unknown attempt field(s) {bad}; valid: {sorted(_ATTEMPT_FIELDS)}")
        todo = [u for u in updates if u[2]]
        if not todo:
            return

        def tx(c: sqlite3.Connection) -> None:
            for run_id, attempt, fields in todo:
                cols = ", ".join(f"{k}=?" for k in sorted(fields))
                vals = [fields[k] for k in sorted(fields)]
                c.execute(f"UPDATE attempts SET {cols} WHERE run_id=? AND attempt=?",
                          (*vals, run_id, attempt))
                c.execute("UPDATE runs SET state=(SELECT state FROM attempts WHERE run_id=? "
                          "ORDER BY attempt DESC LIMIT 1) WHERE run_id=?", (run_id, run_id))

        self._write(tx)

    # -- reads --------------------------------------------------------------------------------
    def list_runs(self, limit: int | None = 20) -> list[Run]:
        """Newest first; `limit=None` lists every run."""

        def q(c: sqlite3.Connection) -> list[Run]:
            sql = "SELECT * FROM runs ORDER BY created DESC, rowid DESC"  # a sweep: highest index first
            rows = c.execute(sql + (" LIMIT ?" if limit else ""), (limit,) if limit else ()).fetchall()
            return _with_attempts(c, [_run(r) for r in rows])

        return self._read(q)

    def newest(self, name: str | None = None) -> Run | None:
        """The run created last (of that name, when given); None if there is none."""

        def q(c: sqlite3.Connection) -> Run | None:
            where, args = (" WHERE name=?", (name,)) if name is not None else ("", ())
            row = c.execute(f"SELECT * FROM runs{where} ORDER BY created DESC, rowid DESC LIMIT 1", args).fetchone()
            return _with_attempts(c, [_run(row)])[0] if row else None

        return self._read(q)

    def get_run(self, ref: str) -> Run:
        """A run by id or unique id prefix; RunNotFound (with close matches) otherwise."""

        def q(c: sqlite3.Connection) -> Run:
            row = c.execute("SELECT * FROM runs WHERE run_id=?", (ref,)).fetchone()
            if row is None:
                like = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                rows = c.execute("SELECT * FROM runs WHERE run_id LIKE ? ESCAPE '\\' LIMIT 11",
                                 (like,)).fetchall()
                if len(rows) != 1:
                    ids = [r["run_id"] for r in rows]
                    if not ids:
                        all_ids = [r[0] for r in c.execute("SELECT run_id FROM runs").fetchall()]
                        ids = _close_matches(ref, all_ids)
                    raise RunNotFound(ref, ids, ambiguous=len(rows) > 1)
                row = rows[0]
            return _with_attempts(c, [_run(row)])[0]

        return self._read(q)

    def check(self) -> None:
        """Open (and create) the registry now: submit calls this BEFORE sbatch, so an unusable
        registry fails the submission instead of leaving a queued job nobody recorded."""
        self._read(lambda c: c.execute("SELECT 1 FROM runs LIMIT 1").fetchall())

    def integrity_check(self) -> str:
        return str(self._read(lambda c: c.execute("PRAGMA integrity_check").fetchone()[0]))


def _insert_attempt(c: sqlite3.Connection, a: Attempt) -> None:
    c.execute(
        "INSERT INTO attempts(run_id,attempt,job_id,state,nodes,submitted,started,ended,exit_code,"
        "failure_class) VALUES (?,?,?,?,?,?,?,?,?,?)",
        (a.run_id, a.attempt, a.job_id, a.state, a.nodes, a.submitted or time.time(), a.started,
         a.ended, a.exit_code, a.failure_class))


def _run(row: sqlite3.Row) -> Run:
    return Run(run_id=row["run_id"], name=row["name"], folder=row["folder"], created=row["created"],
               executor=row["executor"], spec=json.loads(row["spec"] or "{}"), state=row["state"])


def _with_attempts(c: sqlite3.Connection, runs: list[Run]) -> list[Run]:
    if not runs:
        return runs
    by_id = {r.run_id: r for r in runs}
    marks = ",".join("?" * len(by_id))
    rows = c.execute(f"SELECT * FROM attempts WHERE run_id IN ({marks}) ORDER BY run_id, attempt",
                     list(by_id)).fetchall()
    for r in rows:
        by_id[r["run_id"]].attempts.append(Attempt(**dict(r)))
    return runs


def _close_matches(ref: str, ids: list[str]) -> list[str]:
    import difflib  # only on the error path

    near = difflib.get_close_matches(ref, ids, n=5, cutoff=0.5)
    # Also match on the name part, so "tiny" suggests "tiny-20261129-...".
    near += [i for i in ids if ref and ref in i and i not in near]
    return near[:5]


def _strip_secrets(obj: Any) -> Any:
    """Drop any key that looks secret, at any depth: belt and braces behind dispatch's own filter."""
    if isinstance(obj, dict):
        return {k: _strip_secrets(v) for k, v in obj.items()
                if not is_secret_name(str(k))}
    if isinstance(obj, (list, tuple)):
        return [_strip_secrets(v) for v in obj]
    return obj


def _retry_locked(fn: Callable[[], T]) -> T:
    """Retry `fn` on SQLITE_BUSY/LOCKED with jittered backoff; busy_timeout covers most waits,
    but a WAL-mode switch or a checkpoint can still surface "database is locked" at once."""
    delay = 0.02
    for attempt in range(_RETRIES):
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            msg = str(exc).lower()
            if ("locked" not in msg and "busy" not in msg) or attempt == _RETRIES - 1:
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
    raise AssertionError("unreachable")
