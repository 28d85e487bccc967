"""The run registry: runs and their attempts in one SQLite file in the user's state dir.

Many `hpctrain` processes write at once (a sweep script, a team on one login node), so:
WAL journal (readers never block the writer), a busy timeout, short transactions, BEGIN IMMEDIATE
for every write (take the write lock up front instead of failing on lock upgrade mid-way), and ONE
bounded retry loop on "database is locked" for the cases busy_timeout does not cover.

Readers never take the write lock: a read opens the file, checks it, and SELECTs; it creates,
migrates and repairs nothing (`list` behind a long writer returns at once). The schema has a
version (`PRAGMA user_version`); the first write of a process migrates an older file in the same
transaction, and reads accept every older layout. The file is created whole (`_create`: temp file with
the schema, then linked into place) and never by a connection, so an empty, truncated or table-less
file is always damage: it is moved aside and rebuilt from the run folders on disk
(`hpctrain.runs.rebuild`), with a warning, never read as a new registry.

Nothing secret is stored here: callers pass a spec summary already stripped of secrets
(`hpctrain.slurm.dispatch.spec_summary`), and this module refuses well-known secret keys anyway.
"""

from __future__ import annotations

import contextlib
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

from hpctrain.runs.schema import SCHEMA_VERSION, damage, has_tables, migrate
from hpctrain.secret import is_secret_name
from hpctrain.states import JobState, is_final

T = TypeVar("T")

# A submission whose sbatch answer was lost: the job may be queued. `reconcile` turns it into the real
# job id and state (found by the attempt's tag), or into SUBMIT_FAILED after a grace period.
SUBMIT_UNKNOWN = JobState.SUBMIT_UNKNOWN
SUBMIT_FAILED = JobState.SUBMIT_FAILED
_ATTEMPT_FIELDS = frozenset({"job_id", "state", "nodes", "submitted", "started", "ended",
                             "exit_code", "failure_class", "note", "tag"})
_BUSY_TIMEOUT_MS = 5_000
_WRITE_BUDGET_S = 60.0  # every wait of a write, retries included; a read waits at most _READ_BUDGET_S
_READ_BUDGET_S = 15.0



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
    note: str | None = None  # why the state is what it is (e.g. SUBMIT_UNKNOWN: "sbatch timed out")
    tag: str | None = None  # the job's --comment: how an unknown submission is found again

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
        self._ready = False  # this process has checked (and migrated) the schema for writing
        self.warnings: list[str] = []  # rows skipped, repairs done: the CLI prints them

    # -- plumbing -----------------------------------------------------------------------------
    @contextmanager
    def _connect(self, budget_s: float) -> Iterator[sqlite3.Connection]:
        """A connection to the existing file: `mode=rw` never creates one (only `_create` does, whole), so a
        registry moved aside by a rebuild meanwhile is an error here, never a new empty file."""
        busy_ms = int(min(_BUSY_TIMEOUT_MS, budget_s * 1000))  # one wait never outlasts the call's budget
        old = os.umask(0o077)  # the -wal/-shm files are private to the user
        try:
            conn = sqlite3.connect(self.path.absolute().as_uri() + "?mode=rw", uri=True, timeout=busy_ms / 1000,
                                   isolation_level=None)
        finally:
            os.umask(old)
        try:
            conn.execute(f"PRAGMA busy_timeout={busy_ms}")
            conn.execute("PRAGMA foreign_keys=ON")
            # WAL + NORMAL: a crash never corrupts the db; only a power cut can lose the last commit.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.row_factory = sqlite3.Row
            yield conn
        finally:
            conn.close()

    def _prepare(self, conn: sqlite3.Connection) -> None:
        """Inside the write transaction: create or migrate the schema (once per process)."""
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version} was written by a newer hpctrain (this one "
                                        f"knows {SCHEMA_VERSION}); upgrade hpctrain")
        if version < SCHEMA_VERSION or not has_tables(conn):
            migrate(conn)

    def _guard(self, fn: Callable[[], T], budget_s: float) -> T:
        """Lock retries, then one clear error instead of a sqlite3 traceback."""
        try:
            return _retry_locked(fn, budget_s)
        except sqlite3.IntegrityError:
            raise  # a duplicate run id is a caller bug, not an unusable registry
        except (sqlite3.DatabaseError, OSError) as exc:
            raise RegistryUnavailable(self.path, exc) from exc

    def _write(self, fn: Callable[[sqlite3.Connection], T], budget_s: float | None = None) -> T:
        """Run `fn` in one BEGIN IMMEDIATE transaction, retried whole while the db stays locked
        (for `budget_s` seconds in all, default _WRITE_BUDGET_S)."""
        budget_s = _WRITE_BUDGET_S if budget_s is None else budget_s

        def once() -> T:
            self._repair_if_damaged()
            if not self.path.exists():
                _create(self.path)
            with self._connect(budget_s) as conn:
                if not self._ready:
                    # Persistent in the file; a no-op once set. Outside the transaction (SQLite's rule).
                    conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if not self._ready:
                        self._prepare(conn)
                    out = fn(conn)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            self._ready = True
            return out

        return self._guard(once, budget_s)

    def _read(self, fn: Callable[[sqlite3.Connection], T], empty: T) -> T:
        """SELECTs only: no write lock, no schema change. A missing file reads as `empty`."""

        def once() -> T:
            if not self.path.exists():
                return empty
            self._repair_if_damaged()
            with self._connect(_READ_BUDGET_S) as conn:
                conn.execute("BEGIN DEFERRED")  # one snapshot for every SELECT of `fn`
                try:
                    if not has_tables(conn):
                        return empty  # only while a rebuild elsewhere replaces a damaged file
                    return fn(conn)
                finally:
                    conn.execute("ROLLBACK")

        return self._guard(once, _READ_BUDGET_S)

    def _repair_if_damaged(self) -> None:
        """A file that is not a registry: move it aside and rebuild from the run folders."""
        problem = damage(self.path)
        if problem is None:
            return
        from hpctrain.runs import rebuild

        self.warnings += rebuild.rebuild_registry(self, reason=problem)

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

    def record_intent(self, items: list[tuple[dict[str, Any] | None, Attempt]]) -> None:
        """Before sbatch (hpctrain.slurm.transaction): each run (None: a new attempt of a known run) and its
        attempt, usually SUBMIT_UNKNOWN with its tag, in ONE transaction. Idempotent, so a registry rebuilt from
        the run folders meanwhile (which already hold the same record) is no error: rows present are kept."""

        def tx(c: sqlite3.Connection) -> None:
            for run, attempt in items:
                if run is not None:
                    c.execute(
                        "INSERT OR IGNORE INTO runs(run_id,name,folder,created,executor,spec,state) "
                        "VALUES (?,?,?,?,?,?,?)",
                        (run["run_id"], run["name"], run["folder"], run.get("created") or time.time(),
                         run["executor"], json.dumps(_strip_secrets(run.get("spec", {})), sort_keys=True,
                                                     default=str), attempt.state))
                _insert_attempt(c, attempt, replace=True)
                c.execute("UPDATE runs SET state=? WHERE run_id=?", (attempt.state, attempt.run_id))

        self._write(tx)

    def remove_runs(self, run_ids: list[str]) -> None:
        """Forget runs whose submission was withdrawn before sbatch ran (their folders are removed too)."""
        if run_ids:
            marks = ",".join("?" * len(run_ids))
            self._write(lambda c: (c.execute(f"DELETE FROM attempts WHERE run_id IN ({marks})", run_ids),
                                   c.execute(f"DELETE FROM runs WHERE run_id IN ({marks})", run_ids)))

    def import_runs(self, items: list[tuple[dict[str, Any], list[dict[str, Any]]]],
                    skipped: list[str] | None = None) -> int:
        """Add runs (and their attempts, as Attempt fields) this registry does not have yet; returns how
        many were new (what hpctrain.runs.rebuild reads from the run folders). A run SQLite refuses (a
        folder name that is no valid text, a number out of range) is left out, named in `skipped`."""

        def tx(c: sqlite3.Connection) -> int:
            added = 0
            for run, rows in items:
                c.execute("SAVEPOINT one_run")  # one run whole, or not at all
                try:
                    added += _import_one(c, run, rows)
                except (sqlite3.Error, OverflowError, ValueError, TypeError, UnicodeError) as exc:
                    c.execute("ROLLBACK TO one_run")
                    if skipped is not None:
                        skipped.append(f"skipped the run folder {run.get('folder')!r}: {type(exc).__name__}: {exc}")
                c.execute("RELEASE one_run")
            return added

        return self._write(tx)

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
        todo = _checked(updates)
        if todo:
            self._write(lambda c: _apply_updates(c, todo))

    def cache_updates(self, updates: list[tuple[str, int, dict[str, Any]]], wait_s: float = 2.0) -> list[str]:
        """`update_attempts` for a reader (`list`/`status` caching what sacct said): a busy registry
        costs at most `wait_s` and a warning, never the read itself."""
        try:
            self._write(lambda c: _apply_updates(c, _checked(updates)), budget_s=wait_s)
        except RegistryUnavailable as exc:
            return [f"states were not cached in the registry ({exc.__cause__}); the next list retries"]
        return []

    # -- reads --------------------------------------------------------------------------------
    def list_runs(self, limit: int | None = 20) -> list[Run]:
        """Newest first; `limit=None` lists every run. Rows that do not parse are skipped (warned)."""

        def q(c: sqlite3.Connection) -> list[Run]:
            sql = "SELECT * FROM runs ORDER BY created DESC, rowid DESC"  # a sweep: highest index first
            rows = c.execute(sql + (" LIMIT ?" if limit else ""), (limit,) if limit else ()).fetchall()
            return self._with_attempts(c, [r for r in map(self._run_or_skip, rows) if r is not None])

        return self._read(q, [])

    def newest(self, name: str | None = None) -> Run | None:
        """The run created last (of that name, when given); None if there is none."""

        def q(c: sqlite3.Connection) -> Run | None:
            where, args = (" WHERE name=?", (name,)) if name is not None else ("", ())
            row = c.execute(f"SELECT * FROM runs{where} ORDER BY created DESC, rowid DESC LIMIT 1", args).fetchone()
            run = self._run_or_skip(row) if row else None
            return self._with_attempts(c, [run])[0] if run is not None else None

        return self._read(q, None)

    def get_run(self, ref: str) -> Run:
        """A run by id or unique id prefix; RunNotFound (with close matches) otherwise."""

        def q(c: sqlite3.Connection) -> Run:
            row = c.execute("SELECT * FROM runs WHERE run_id=?", (ref,)).fetchone()
            if row is None:
                like = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                rows = c.execute("SELECT * FROM runs WHERE run_id LIKE ? ESCAPE '\\' LIMIT 11",
                                 (like,)).fetchall()
                if len(rows) != 1:
                    ids = [str(r["run_id"]) for r in rows]
                    if not ids:
                        all_ids = [str(r[0]) for r in c.execute("SELECT run_id FROM runs").fetchall()]
                        ids = _close_matches(ref, all_ids)
                    raise RunNotFound(ref, ids, ambiguous=len(rows) > 1)
                row = rows[0]
            run = self._run_or_skip(row)
            if run is None:
                raise sqlite3.DatabaseError(f"the row of run {ref!r} is damaged ({self.warnings[-1]}); "
                                            "`hpctrain registry rebuild` restores it from its run folder")
            return self._with_attempts(c, [run])[0]

        def missing() -> Run:
            raise RunNotFound(ref, [])

        if not self.path.exists():
            return missing()
        return self._read(q, None) or missing()

    def check(self) -> None:
        """Open, create or migrate the registry now: submit calls this BEFORE sbatch, so an unusable
        registry fails the submission instead of leaving a queued job nobody recorded."""
        self._write(lambda c: c.execute("SELECT 1 FROM runs LIMIT 1").fetchall())

    def integrity_check(self) -> str:
        return str(self._read(lambda c: c.execute("PRAGMA integrity_check").fetchone()[0], "ok"))

    def _run_or_skip(self, row: sqlite3.Row) -> Run | None:
        try:
            return _run(row)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            self.warnings.append(f"skipped a damaged registry row (run_id={_cell(row, 'run_id')!r}: {exc})")
            return None

    def _with_attempts(self, c: sqlite3.Connection, runs: list[Run]) -> list[Run]:
        if not runs:
            return runs
        by_id = {r.run_id: r for r in runs}
        marks = ",".join("?" * len(by_id))
        rows = c.execute(f"SELECT * FROM attempts WHERE run_id IN ({marks}) ORDER BY run_id, attempt",
                         list(by_id)).fetchall()
        for r in rows:
            try:
                by_id[r["run_id"]].attempts.append(_attempt(r))
            except (TypeError, ValueError, KeyError, IndexError) as exc:
                self.warnings.append(f"skipped a damaged attempt row of run {_cell(r, 'run_id')!r} ({exc})")
        return runs


def _import_one(c: sqlite3.Connection, run: dict[str, Any], rows: list[dict[str, Any]]) -> int:
    attempts = [Attempt(**row) for row in rows]
    cur = c.execute(
        "INSERT OR IGNORE INTO runs(run_id,name,folder,created,executor,spec,state) VALUES (?,?,?,?,?,?,?)",
        (run["run_id"], run["name"], run["folder"], run["created"], run["executor"],
         json.dumps(_strip_secrets(run.get("spec", {})), sort_keys=True, default=str),
         attempts[-1].state if attempts else "PENDING"))
    if not cur.rowcount:
        return 0
    for a in attempts:
        _insert_attempt(c, a)
    return 1


def _create(path: Path) -> None:
    """Create the registry whole: schema and WAL mode written into a temp file beside `path`, then linked
    into place (never replacing a file another process created meanwhile). So no process ever sees a
    registry being born: an empty or table-less `path` is always damage (schema.damage), never "new"."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{random.randrange(16**8):08x}")
    old = os.umask(0o077)  # the db is private to the user
    try:
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")
            migrate(conn)
            conn.execute("COMMIT")
        finally:
            conn.close()  # the last connection: SQLite folds the WAL into the file and removes it
        _fsync(tmp)  # the whole file is on disk before its name is
        with contextlib.suppress(FileExistsError):  # another process created it first: theirs is as good as ours
            os.link(tmp, path)
    finally:
        os.umask(old)
        for suffix in ("", "-wal", "-shm", "-journal"):
            tmp.with_name(tmp.name + suffix).unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _insert_attempt(c: sqlite3.Connection, a: Attempt, replace: bool = False) -> None:
    c.execute(
        f"INSERT {'OR REPLACE ' if replace else ''}INTO attempts("
        "run_id,attempt,job_id,state,nodes,submitted,started,ended,exit_code,failure_class,note,tag) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (a.run_id, a.attempt, a.job_id, a.state, a.nodes, a.submitted or time.time(), a.started,
         a.ended, a.exit_code, a.failure_class, a.note, a.tag))


def _checked(updates: list[tuple[str, int, dict[str, Any]]]) -> list[tuple[str, int, dict[str, Any]]]:
    for _, _, fields in updates:
        bad = sorted(set(fields) - _ATTEMPT_FIELDS)
        if bad:
            raise ValueError(f"unknown attempt field(s) {bad}; valid: {sorted(_ATTEMPT_FIELDS)}")
    return [u for u in updates if u[2]]


def _apply_updates(c: sqlite3.Connection, todo: list[tuple[str, int, dict[str, Any]]]) -> None:
    for run_id, attempt, fields in todo:
        cols = ", ".join(f"{k}=?" for k in sorted(fields))
        vals = [fields[k] for k in sorted(fields)]
        c.execute(f"UPDATE attempts SET {cols} WHERE run_id=? AND attempt=?", (*vals, run_id, attempt))
        c.execute("UPDATE runs SET state=(SELECT state FROM attempts WHERE run_id=? "
                  "ORDER BY attempt DESC LIMIT 1) WHERE run_id=?", (run_id, run_id))


def _cell(row: sqlite3.Row, key: str) -> Any:
    return row[key] if key in row.keys() else None  # noqa: SIM118 - `in row` tests values, not names


def _text(row: sqlite3.Row, key: str, default: str | None = None) -> str:
    value = _cell(row, key)
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise TypeError(f"{key} is {value!r}, not text")
    return value


def _number(row: sqlite3.Row, key: str) -> float | None:
    value = _cell(row, key)
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise TypeError(f"{key} is {value!r}, not a number")


def _run(row: sqlite3.Row) -> Run:
    """A runs row -> Run; TypeError/ValueError when a cell is not what the schema says (a hand edit,
    a damaged page). Columns an older schema lacks read as their defaults."""
    spec = json.loads(_text(row, "spec", "{}") or "{}")
    if not isinstance(spec, dict):
        raise TypeError(f"spec is {type(spec).__name__}, not an object")
    created = _number(row, "created")
    if created is None:
        raise TypeError("created is empty")
    return Run(run_id=_text(row, "run_id"), name=_text(row, "name", ""), folder=_text(row, "folder"),
               created=float(created), executor=_text(row, "executor", "slurm"), spec=spec,
               state=_text(row, "state", "PENDING"))


def _attempt(row: sqlite3.Row) -> Attempt:
    attempt = _cell(row, "attempt")
    if not isinstance(attempt, int):
        raise TypeError(f"attempt is {attempt!r}, not an integer")
    opt = {k: _cell(row, k) for k in ("exit_code", "failure_class", "note", "tag")}
    for k, v in opt.items():
        if v is not None and not isinstance(v, str):
            opt[k] = str(v)
    return Attempt(run_id=_text(row, "run_id"), attempt=attempt, job_id=str(_cell(row, "job_id") or ""),
                   state=_text(row, "state", "PENDING"), nodes=_text(row, "nodes", ""),
                   submitted=_number(row, "submitted"), started=_number(row, "started"),
                   ended=_number(row, "ended"), **opt)


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


def _retry_locked(fn: Callable[[], T], budget_s: float) -> T:
    """Retry `fn` on SQLITE_BUSY/LOCKED with jittered backoff until `budget_s` is spent: busy_timeout
    covers most waits, but a WAL-mode switch or a checkpoint can still surface "database is locked"
    at once. The ONLY retry loop: nothing below it retries, so `budget_s` (+ one busy_timeout) is
    the longest any call waits."""
    deadline = time.monotonic() + budget_s
    delay = 0.02
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            msg = str(exc).lower()
            if ("locked" not in msg and "busy" not in msg) or time.monotonic() + delay >= deadline:
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
