"""Per-rank logs of a run across its attempts: find them, tag them, merge them by time, tail them.

Line timestamps the node writes (node/monitor/metrics.py `setup_logging`): `2026-11-29T16:53:03 rank0 INFO ...`.
Also understood: `[2026-11-29 16:53:03,123]` (DeepSpeed, torch) and submitit's
`submitit INFO (2026-11-29 16:52:58,133) - ...`. A line without a timestamp (a traceback frame, a
print) keeps the time of the line before it, so multi-line messages stay together; a file without any
timestamp sorts after the timed lines of its attempt, in file order.

Stdlib only.
"""

from __future__ import annotations

import heapq
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

_TS = re.compile(r"^(?:submitit \w+ \(|\[)?(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:[.,](\d{1,6}))?")
_RANK_LOG = re.compile(r"attempt-(\d+)\.rank-(\d+)\.log")
_SUBMITIT_LOG = re.compile(r"(\d+(?:_\d+)?)_(\d+)_log\.(out|err)")
_INF = float("inf")
JOURNAL = "journal"  # the host of a line that is the run's journal speaking, not a rank (hpctrain.collect.losses)
_CTRL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def clean_text(data: bytes | str) -> str:
    """Decode bytes leniently and drop control characters (binary junk, NULs from a torn write)."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return _CTRL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


@dataclass(frozen=True)
class LogFile:
    path: Path
    attempt: int
    rank: int | None
    kind: str = "rank"  # "rank" (logs/attempt-K.rank-R.log) | "submitit" (stdout/stderr of a task)


@dataclass(frozen=True)
class Line:
    time: float  # seconds since the epoch; inf when the file had no timestamp before this line
    attempt: int
    rank: int | None
    host: str
    text: str
    note: str = ""  # hpctrain's word on the line (a surviving rank's peer error after a node loss)

    def tagged(self) -> str:
        if self.host == JOURNAL and self.rank is None:  # a line of the run's journal, not of a rank's log
            return f"a{self.attempt} -- {JOURNAL} | {self.text}"
        rank = "?" if self.rank is None else str(self.rank)
        return f"a{self.attempt} r{rank} {self.host or '?'} | {self.text}" + (f"  <- {self.note}" if self.note else "")


def parse_time(line: str) -> float | None:
    """Seconds since the epoch from a line's leading timestamp (local time, as logging writes it)."""
    m = _TS.match(line)
    if not m:
        return None
    try:
        t = datetime.strptime(f"{m.group(1)} {m.group(2)}", "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        return None
    frac = m.group(3)
    return t + (int(frac) / 10 ** len(frac) if frac else 0.0)


# torch/glog lines: "[W1129 17:06:47.629292543 socket.cpp:207] ..." (no year: taken from `year_of`).
_GLOG = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d)")


def parse_any_time(line: str, year: int) -> float | None:
    """parse_time, plus glog-style stamps (torch's C++ warnings) in the given year."""
    t = parse_time(line)
    if t is not None:
        return t
    m = _GLOG.match(line)
    if not m:
        return None
    try:
        return datetime.strptime(f"{year}-{m.group(1)}-{m.group(2)} {m.group(3)}", "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        return None


def text_since(text: str, start: float, slack_s: float = 2.0) -> str:
    """The part of an appended-to log written from `start` on (a requeued job's submitit logs hold
    every run of the job): from the first line stamped at or after start - slack. A file with stamps
    but none that late is all older output (""); a file with no stamps at all is kept whole."""
    year = datetime.fromtimestamp(start).year
    lines = text.split("\n")
    seen = False
    for i, line in enumerate(lines):
        t = parse_any_time(line, year)
        if t is None:
            continue
        seen = True
        if t >= start - slack_s:
            return "\n".join(lines[i:])
    return "" if seen else text


def last_timestamp(text: str) -> float | None:
    for line in reversed(text.splitlines()):
        t = parse_time(line)
        if t is not None:
            return t
    return None


def rank_log_files(logs_dir: Path) -> list[LogFile]:
    """logs/attempt-K.rank-R.log, sorted by (attempt, rank)."""
    out = []
    try:
        entries = list(logs_dir.iterdir())
    except OSError:
        return []
    for p in entries:
        m = _RANK_LOG.fullmatch(p.name)
        if m:
            out.append(LogFile(p, int(m.group(1)), int(m.group(2))))
    return sorted(out, key=lambda f: (f.attempt, f.rank or 0))


def submitit_log_files(submitit_dir: Path, job_ids: dict[str, int]) -> list[LogFile]:
    """submitit/<job>_<task>_log.{out,err} of the given jobs (job id -> attempt). The task index is
    the rank under srun (one task per rank), the node index under the deepspeed launcher."""
    out = []
    try:
        entries = list(submitit_dir.iterdir())
    except OSError:
        return []
    for p in entries:
        m = _SUBMITIT_LOG.fullmatch(p.name)
        if not m:
            continue
        job = m.group(1)
        attempt = job_ids.get(job, job_ids.get(job.split("_")[0]))
        if attempt is not None:
            out.append(LogFile(p, attempt, int(m.group(2)), "submitit"))
    return sorted(out, key=lambda f: (f.attempt, f.rank or 0, f.path.name))


def read_text(path: Path, limit: int = 64 << 20) -> str:
    """A log's text, decoded leniently; the LAST `limit` bytes of a huge file (where errors are)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return clean_text(fh.read())
    except OSError:
        return ""


def timed_lines(text: str, attempt: int, rank: int | None, host: str) -> list[Line]:
    """Every line of one file with its time (inherited by untimestamped lines)."""
    out: list[Line] = []
    current = _INF
    for raw in text.split("\n"):
        if not raw.strip():
            continue
        t = parse_time(raw)
        if t is not None:
            current = t
        out.append(Line(current, attempt, rank, host, raw.rstrip()))
    return _fill_leading(out)


def _fill_leading(lines: list[Line]) -> list[Line]:
    """Lines before a file's first timestamp take that timestamp, not inf."""
    first = next((ln.time for ln in lines if ln.time != _INF), None)
    if first is None:
        return lines
    out = []
    for ln in lines:
        if ln.time != _INF:
            break
        out.append(Line(first, ln.attempt, ln.rank, ln.host, ln.text))
    return out + lines[len(out):]


def merge(streams: Iterable[list[Line]]) -> Iterator[Line]:
    """Merge per-file line lists by (attempt, time); each file keeps its own order (heapq.merge is
    stable per input), so a torn, non-monotonic file never reorders itself."""
    return heapq.merge(*streams, key=lambda ln: (ln.attempt, ln.time))


@dataclass(frozen=True)
class LogFilter:
    attempt: int | None = None
    rank: int | None = None
    host: str | None = None
    grep: re.Pattern[str] | None = None

    def file_ok(self, f: LogFile, host: str) -> bool:
        return ((self.attempt is None or f.attempt == self.attempt) and
                (self.rank is None or f.rank == self.rank) and
                (self.host is None or host == self.host or host.split(".")[0] == self.host))

    def line_ok(self, line: Line) -> bool:
        return self.grep is None or bool(self.grep.search(line.text))


class Notes(Protocol):
    """hpctrain's word among the log lines (hpctrain.collect.losses.LossNotes: the journal's node losses)."""

    def lines(self, ln: Line) -> list[Line]:
        """`ln` (noted or not) after the lines due before it."""
        ...

    def rest(self) -> list[Line]:
        """What is still due after the last line."""
        ...

    def refresh(self) -> None:
        """Read the journal again (a followed run goes on)."""
        ...


def merged_lines(files: list[LogFile], hosts: Callable[[LogFile], str], flt: LogFilter,
                 notes: Notes | None = None) -> Iterator[Line]:
    """All lines of the chosen files, merged by time, filtered; with hpctrain's `notes` among them."""
    streams = []
    for f in files:
        host = hosts(f)
        if flt.file_ok(f, host):
            streams.append(timed_lines(read_text(f.path), f.attempt, f.rank, host))
    for ln in merge(streams):
        yield from (x for x in (notes.lines(ln) if notes is not None else [ln]) if flt.line_ok(x))
    yield from (x for x in (notes.rest() if notes is not None else []) if flt.line_ok(x))


def follow(list_files: Callable[[], list[LogFile]], hosts: Callable[[LogFile], str], flt: LogFilter,
           finished: Callable[[], bool], emit: Callable[[Line], None], *, poll_s: float = 1.0,
           idle_checks: int = 2, max_s: float | None = None, notes: Notes | None = None) -> None:
    """Print what is there, then new lines as ranks write them, until the job has finished and the
    files stayed quiet for `idle_checks` polls (or Ctrl-C, which the caller turns into a clean exit).
    New files (a requeued attempt, a late rank) are picked up on every poll; `notes` as in merged_lines, read
    again on every poll that has lines."""
    offsets: dict[Path, int] = {}
    partial: dict[Path, str] = {}
    last_time: dict[Path, float] = {}
    quiet = 0
    started = time.monotonic()
    while True:
        batch: list[list[Line]] = []
        for f in list_files():
            host = hosts(f)
            if not flt.file_ok(f, host):
                continue
            chunk = _read_from(f.path, offsets)
            if not chunk:
                continue
            text = partial.pop(f.path, "") + chunk
            text, _, rest = text.rpartition("\n") if not text.endswith("\n") else (text, "", "")
            if rest:
                partial[f.path] = rest  # a line still being written: print it once it is whole
            lines = timed_lines(text, f.attempt, f.rank, host)
            prev = last_time.get(f.path, _INF)
            lines = [ln if ln.time != _INF else Line(prev, ln.attempt, ln.rank, ln.host, ln.text) for ln in lines]
            if lines:
                last_time[f.path] = lines[-1].time
            batch.append(lines)
        printed = False
        if batch and notes is not None:
            notes.refresh()
        for ln in merge(batch):
            for x in notes.lines(ln) if notes is not None else [ln]:
                if flt.line_ok(x):
                    emit(x)
            printed = True
        if printed:
            quiet = 0
        elif finished():
            quiet += 1
            if quiet >= idle_checks:
                return
        if max_s is not None and time.monotonic() - started > max_s:
            return
        time.sleep(poll_s)


def _read_from(path: Path, offsets: dict[Path, int]) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            start = offsets.get(path, 0)
            if size < start:  # truncated/rotated: start over
                start = 0
            fh.seek(start)
            data = fh.read()
    except OSError:
        return ""
    offsets[path] = start + len(data)
    return clean_text(data)
