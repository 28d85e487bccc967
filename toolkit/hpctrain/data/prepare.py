"""`hpctrain data prepare`: tokenize a corpus once into the shards of data/format.py.

The work is a list of units (data/inputs.py); each becomes train/shard-N (+ val/shard-N) with N the
unit's number, written by one worker process with the fast tokenizer's own threads off (a process per
core beat one process with the tokenizer's threads: bench/data_prepare.py). A worker writes its shard
files itself (atomically), so no token crosses a pipe; the parent only records.

Recovery: each finished unit is appended (and fsynced) to `.prepare-progress.jsonl` with the key of the
prepare. A killed prepare leaves that file and no manifest; the next one with the same key keeps every
recorded unit whose files are whole and redoes the rest. The manifest is written last: a folder is
prepared exactly when it has one. A manifest whose key matches is a cache hit that reads no input (input
hashes come from the size+mtime memo of data/cache.py).

Validation split: a document goes to val when the first 8 bytes of blake2b(text) fall below
`val_fraction` of the range: deterministic, independent of order, workers and sharding, and duplicates of a
document always land in the same split (no train/val leak through repeated text).

SFT formats (`--format alpaca|chat`, data/sft.py): each record becomes ids + a loss mask (the shard's .mask
file), cut or dropped at `--seq-len` (`--overlong`); bad records are counted by reason into the manifest's
`records` and printed as a table, and an input none of whose records is usable is refused, naming its first
bad record. A text prepare's options, key and bytes are what they were before these formats existed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpctrain import __version__
from hpctrain.data import cache, inputs, sft
from hpctrain.data.format import (
    MANIFEST,
    MASKED_VERSION,
    VERSION,
    Manifest,
    Shard,
    Split,
    dtype_for,
    is_prepared,
    read_manifest,
    write_manifest,
    write_shard,
)
from hpctrain.data.tokenizer import Encoder, TokenizerInfo, describe
from hpctrain.errors import bad_value

PROGRESS = ".prepare-progress.jsonl"
LOCK = ".prepare.lock"
LOG = "prepare.log"
BATCH_DOCS = 512  # texts per tokenizer call: large enough to amortize the call, small enough for RAM


@dataclass(frozen=True)
class Options:
    """What changes the prepared bytes (all of it goes into the key); see `hpctrain data prepare --help`."""

    text_field: str = "text"
    val_fraction: float = 0.005
    append_eos: bool = True
    prepend_bos: bool = False
    shard_bytes: int = 64 << 20
    format: str = "text"  # "text", or an SFT format: "alpaca" | "chat" (data/sft.py)
    messages_field: str = "messages"  # chat: the field of the message list
    seq_len: int = 0  # SFT: the longest example kept (the run's [data] seq_len)
    overlong: str = "truncate"  # SFT: "truncate" | "drop" an example longer than seq_len

    @property
    def sft(self) -> bool:
        return self.format in sft.FORMATS

    def key_dict(self) -> dict[str, Any]:
        """What enters the key: a text prepare's options as they always were (its cache folders stay valid)."""
        d = asdict(self)
        if not self.sft:
            for k in ("format", "messages_field", "seq_len", "overlong"):
                del d[k]
        return d

    def __post_init__(self) -> None:
        if self.format not in ("text", *sft.FORMATS):
            raise bad_value("--format", self.format, "not a data format", "pass --format text, alpaca or chat")
        if self.sft and self.seq_len < 2:
            raise bad_value("--seq-len", self.seq_len, f"--format {self.format} cuts or drops examples longer than "
                            "the run's sequence length, so it must be known here", "pass --seq-len with the run's "
                            "[data] seq_len (e.g. --seq-len 2048)")
        if self.overlong not in sft.OVERLONG:
            raise bad_value("--overlong", self.overlong, "not a choice", "pass --overlong truncate or drop")
        if not 0.0 <= self.val_fraction < 1.0:
            raise bad_value("--val-fraction", self.val_fraction, "must be at least 0 and below 1",
                            "pass e.g. --val-fraction 0.005")
        if self.shard_bytes < 1:
            raise bad_value("--shard-size", self.shard_bytes, "must be positive", "pass e.g. --shard-size 64M")


@dataclass
class Result:
    folder: Path
    manifest: Manifest
    cache_hit: bool = False
    reused: int = 0  # units kept from a killed prepare
    done: int = 0  # units tokenized by this call
    seconds: float = 0.0


@dataclass(frozen=True)
class _Job:
    number: int
    inp: inputs.Input
    unit: inputs.Unit


@dataclass
class _Done:
    number: int
    train: Shard
    val: Shard | None
    unit: dict[str, Any] = field(default_factory=dict)
    tally: dict[str, Any] = field(default_factory=dict)  # SFT formats: data/sft.py's Tally of the unit


# ------------------------------------------------------------------------------------------------- workers

_ENCODER: Encoder | None = None
_RENDERER: sft.Renderer | None = None
_CONF: dict[str, Any] = {}


def _init(info: TokenizerInfo, dtype: str, opts: Options, folder: str, threads: bool) -> None:
    global _ENCODER, _RENDERER
    if not threads:  # one process per core: the tokenizer's own thread pool would only contend
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _ENCODER = Encoder(info, dtype, bos=opts.prepend_bos, eos=opts.append_eos)
    if opts.sft:
        _RENDERER = sft.Renderer(opts.format, _ENCODER.sft(opts.format == "chat"), opts.seq_len, opts.overlong,
                                 opts.messages_field)
    _CONF.update(opts=opts, folder=folder, dtype=dtype)


def is_val(text: str, fraction: float) -> bool:
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
    return h < fraction * (1 << 64)


def _batches(it: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in it:
        batch.append(t)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _work(job: _Job) -> _Done:
    """Tokenize one unit and write its shards (runs in a worker, or in-process with --workers 1)."""
    assert _ENCODER is not None
    opts: Options = _CONF["opts"]
    if opts.sft:
        return _work_sft(job)
    train: list[Any] = []
    val: list[Any] = []
    for batch in _batches(inputs.read_texts(job.inp, job.unit, opts.text_field), BATCH_DOCS):
        for text, ids in zip(batch, _ENCODER.encode(batch), strict=True):
            (val if is_val(text, opts.val_fraction) else train).append(ids)
    folder, dtype = _CONF["folder"], _CONF["dtype"]
    tr = write_shard(folder, "train", job.number, train, dtype)
    va = write_shard(folder, "val", job.number, val, dtype) if val else None
    return _Done(job.number, tr, va, asdict(job.unit))


def _work_sft(job: _Job) -> _Done:
    """Render one unit's records (ids + mask), counting the bad ones, and write its shards with masks."""
    assert _RENDERER is not None
    opts: Options = _CONF["opts"]
    tally = sft.Tally()
    parts: dict[str, tuple[list[Any], list[Any]]] = {"train": ([], []), "val": ([], [])}
    for where, rec, text in inputs.read_records(job.inp, job.unit):
        got = sft.render_into(_RENDERER, rec, where, tally)
        if got is not None:
            ids, mask = parts["val" if is_val(text, opts.val_fraction) else "train"]
            ids.append(got[0])
            mask.append(got[1])
    folder, dtype = _CONF["folder"], _CONF["dtype"]
    tr = write_shard(folder, "train", job.number, parts["train"][0], dtype, masks=parts["train"][1])
    va = write_shard(folder, "val", job.number, parts["val"][0], dtype, masks=parts["val"][1]) \
        if parts["val"][0] else None
    return _Done(job.number, tr, va, asdict(job.unit), tally.to_json())


# ------------------------------------------------------------------------------------------------- folder

def _read_progress(folder: Path, key: str, itemsize: int) -> dict[int, _Done]:
    """Units a killed prepare with the same key finished, whose shard files are whole."""
    done: dict[int, _Done] = {}
    try:
        lines = (folder / PROGRESS).read_text().splitlines()
    except OSError:
        return done
    for line in lines:
        try:
            rec = json.loads(line)
            if rec.get("key") != key:
                return {}  # another prepare's progress: start over
            train = Shard(**rec["train"])
            val = Shard(**rec["val"]) if rec.get("val") else None
            tally = dict(rec.get("tally") or {})
        except (ValueError, TypeError, KeyError):
            continue  # a line torn by the kill
        if all(_whole(folder, s, itemsize) for s in (train, val) if s):
            done[int(rec["number"])] = _Done(int(rec["number"]), train, val, rec.get("unit", {}), tally)
    return done


def _whole(folder: Path, s: Shard, itemsize: int) -> bool:
    try:
        return ((folder / s.path).stat().st_size == s.tokens * itemsize
                and (folder / s.index).stat().st_size == (s.documents + 1) * 8
                and (not s.mask or (folder / s.mask).stat().st_size == s.tokens))
    except OSError:
        return False


def _record(folder: Path, key: str, d: _Done) -> None:
    rec = {"key": key, "number": d.number, "unit": d.unit, "train": asdict(d.train),
           "val": asdict(d.val) if d.val else None, **({"tally": d.tally} if d.tally else {})}
    with open(folder / PROGRESS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _log(folder: Path, line: str) -> None:
    with open(folder / LOG, "a", encoding="utf-8") as fh:
        fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")


def _claim(folder: Path) -> None:
    """Refuse to write into a folder that holds something other than a prepare's files."""
    ours = {MANIFEST, PROGRESS, LOG, "train", "val", "prepare.sbatch"}
    if folder.is_dir():
        other = sorted(p.name for p in folder.iterdir()
                       if p.name not in ours and not p.name.startswith(("prepare-", ".")))
        if other:
            raise bad_value("--out", str(folder),
                            f"holds files that are not a prepared corpus ({', '.join(other[:3])})",
                            "pass --out with a new or empty folder, or one an earlier prepare wrote")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise bad_value("--out", str(folder), f"cannot create it ({exc.strerror or exc})",
                        "pass --out with a writable folder (or set HPCTRAIN_DATA_CACHE)") from None


def _clean(folder: Path, keep: set[str]) -> None:
    """Drop shard files not listed in `keep` (a previous prepare's, or temporaries left by a kill)."""
    for split in ("train", "val"):
        d = folder / split
        if d.is_dir():
            for f in d.iterdir():
                if f"{split}/{f.name}" not in keep:
                    f.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------- prepare

@dataclass(frozen=True)
class Request:
    """Inputs found and hashed, tokenizer described, the key computed: what decides the folder."""

    found: list[inputs.Input]
    tokenizer: TokenizerInfo
    records: list[dict[str, Any]]
    options: Options
    key: str


def resolve(paths: list[str], tokenizer: str, opts: Options) -> Request:
    """Find and hash the inputs (memoized by size+mtime), describe the tokenizer, compute the key."""
    found = inputs.find_inputs(paths)
    info = describe(tokenizer)
    if opts.sft:
        _check_sft(found, info, opts)
    records = []
    for inp in found:
        ident = cache.identity(inp.path)
        records.append({"path": inp.path, "kind": inp.kind + (f".{inp.codec}" if inp.codec else ""),
                        "bytes": ident["bytes"], "mtime_ns": ident["mtime_ns"], "sha256": cache.content_hash(inp.path)})
    key = cache.cache_key([r["sha256"] for r in records], info.hash, opts.key_dict())
    return Request(found, info, records, opts, key)


def _check_sft(found: list[inputs.Input], info: TokenizerInfo, opts: Options) -> None:
    """Before any work: records to read, and for chat a tokenizer that can render conversations."""
    from hpctrain.data.tokenizer import chat_tokenizer

    text = [i.path for i in found if i.kind == "text"]
    if text:
        raise bad_value("INPUT", text[0], f"a text file, and --format {opts.format} reads records",
                        "pass .jsonl, .parquet or .arrow files of records (docs/data.md)")
    if opts.format == "chat":
        try:
            sft.check_chat_tokenizer(chat_tokenizer(info.path), info.path)
        except sft.SftInputError as exc:
            raise bad_value("--tokenizer", info.path, str(exc).split(": ", 1)[1].split(". Fix: ")[0],
                            str(exc).split(". Fix: ")[1]) from None


def default_workers() -> int:
    """The CPUs this process may use (a SLURM job's allocation, a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _hit(folder: Path, key: str) -> Manifest | None:
    """The folder's manifest when it is this prepare's, whole; else None."""
    if not is_prepared(folder):
        return None
    try:
        m = read_manifest(folder)
    except ValueError:
        return None
    itemsize = 2 if m.dtype == "uint16" else 4
    if m.key != key or not all(_whole(folder, s, itemsize) for s in (*m.train.shards, *m.val.shards)):
        return None
    return m


def prepare(paths: list[str], tokenizer: str, out: str | os.PathLike[str] | None = None,
            opts: Options | None = None, workers: int = 0, progress: bool | None = None,
            echo: Callable[[str], None] = print) -> Result:
    """Prepare `paths` with `tokenizer` into `out` (default: the cache folder of the key); see the module docstring."""
    started = time.monotonic()
    req = resolve(paths, tokenizer, opts or Options())
    folder = Path(out).absolute() if out else cache.cache_folder(req.key)
    _claim(folder)  # before the lock file: nothing is written into a folder that is not a prepare's
    with _locked(folder):  # a second prepare of the same folder waits, then finds the first one's cache hit
        return _prepare(req, folder, workers, progress, echo, started)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    import fcntl

    with open(folder / LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prepare(req: Request, folder: Path, workers: int, progress: bool | None, echo: Callable[[str], None],
             started: float) -> Result:
    hit = _hit(folder, req.key)
    if hit is not None:
        _log(folder, f"cache hit {req.key}: inputs, tokenizer and options unchanged, nothing rewritten")
        echo(f"cache hit: {folder} ({hit.tokens:,} tokens, key {req.key})")
        return Result(folder, hit, cache_hit=True, seconds=time.monotonic() - started)
    (folder / MANIFEST).unlink(missing_ok=True)  # replaced below: never a half-valid prepared folder
    dtype = dtype_for(req.tokenizer.vocab_size)
    jobs = [_Job(0, inp, u) for i, inp in enumerate(req.found)
            for u in inputs.units_of(inp, i, req.options.shard_bytes)]
    jobs = [_Job(n, j.inp, j.unit) for n, j in enumerate(jobs)]
    done = _read_progress(folder, req.key, 2 if dtype == "uint16" else 4)
    if not done:
        (folder / PROGRESS).unlink(missing_ok=True)
    _clean(folder, {p for d in done.values() for s in (d.train, d.val) if s for p in (s.path, s.index, s.mask) if p})
    todo = sorted((j for j in jobs if j.number not in done), key=lambda j: -j.unit.size)
    n = max(1, min(workers or default_workers(), len(todo) or 1))
    _log(folder, f"prepare {req.key}: {len(jobs)} shards, {len(done)} kept from an earlier run, {len(todo)} to "
                 f"tokenize with {n} worker(s); tokenizer {req.tokenizer.path}")
    if done:
        echo(f"resuming: {len(done)} of {len(jobs)} shards kept from an earlier run")

    def finished(d: _Done) -> None:
        done[d.number] = d
        _record(folder, req.key, d)
        val = f", val {d.val.documents} documents {d.val.tokens} tokens" if d.val else ""
        _log(folder, f"shard {d.number + 1}/{len(jobs)} {d.train.path}: {req.found[d.unit['source']].path} "
                     f"[{d.unit['start']}, {d.unit['end']}): "
                     f"{d.train.documents} documents {d.train.tokens} tokens{val}")

    show = sys.stderr.isatty() if progress is None else progress
    _execute(todo, (req.tokenizer, dtype, req.options, str(folder), False), n, show, finished)
    manifest = _manifest(req, dtype, [done[j.number] for j in jobs])
    write_manifest(folder, manifest)
    (folder / PROGRESS).unlink(missing_ok=True)
    seconds = time.monotonic() - started
    _log(folder, f"done {req.key}: {manifest.tokens} train tokens, {manifest.val.tokens} val tokens in {seconds:.1f}s")
    echo(f"prepared {folder}: {manifest.documents:,} documents, {manifest.tokens:,} tokens "
         f"(+{manifest.val.tokens:,} validation) in {seconds:.1f}s")
    if req.options.sft:
        for line in sft.Tally.from_json(manifest.records).table(req.options.seq_len):
            echo(line)
            _log(folder, line)
    return Result(folder, manifest, reused=len(jobs) - len(todo), done=len(todo), seconds=seconds)


def _execute(todo: list[_Job], init: tuple[Any, ...], workers: int, show: bool,
             finished: Callable[[_Done], None]) -> None:
    """Run the jobs in `workers` processes (in this one for 1); the pool starts before the progress bar's
    thread, so no process is forked while another thread holds a lock."""
    if not todo:
        return
    import multiprocessing

    pool = multiprocessing.get_context("fork").Pool(workers, _init, init) if workers > 1 else None
    try:
        if pool is None:
            _init(*init)
            results: Iterator[_Done] = (_work(j) for j in todo)
        else:
            results = pool.imap_unordered(_work, todo)
        with _progress(show, sum(j.unit.size for j in todo)) as advance:
            for d in results:
                finished(d)
                advance(int(d.unit.get("size", 0)))
        if pool is not None:
            pool.close()
            pool.join()
    finally:
        if pool is not None:
            pool.terminate()


class _progress:
    """A rich progress bar over input bytes on a terminal (rich imported only then); a no-op otherwise."""

    def __init__(self, show: bool, total: int) -> None:
        self.show, self.total = show, total
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> Callable[[int], None]:
        if self.show:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task("tokenizing", total=self.total)
        return self.advance

    def advance(self, n: int) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _split(shards: list[Shard]) -> Split:
    kept = tuple(s for s in shards if s.documents)
    return Split(tokens=sum(s.tokens for s in kept), documents=sum(s.documents for s in kept), shards=kept)


def _tallies(req: Request, done: list[_Done]) -> tuple[sft.Tally, list[sft.Tally]]:
    """The whole prepare's tally and each input's (units in input order); refuses an input of bad records only."""
    total, per = sft.Tally(), [sft.Tally() for _ in req.records]
    for d in done:
        t = sft.Tally.from_json(d.tally)
        per[int(d.unit["source"])].merge(t)
        total.merge(t)
    for rec, t in zip(req.records, per, strict=True):
        if t.all_bad():
            raise bad_value("INPUT", rec["path"], f"none of its {t.records:,} records can be trained on as "
                            f"--format {req.options.format}; the first bad one: {t.earliest}",
                            "fix the records (docs/data.md), or pass the --format / --messages-field / --seq-len "
                            "they were written for")
    return total, per


def _manifest(req: Request, dtype: str, done: list[_Done]) -> Manifest:
    train, val = _split([d.train for d in done]), _split([d.val for d in done if d.val])
    total, per = _tallies(req, done) if req.options.sft else (None, [])
    if not train.documents:
        what = "no records" if req.options.sft else "no non-blank documents"
        check = f"--format {req.options.format}" if req.options.sft else f"--text-field {req.options.text_field!r}"
        raise bad_value("INPUT", " ".join(r["path"] for r in req.records), f"{what} (for the training split)",
                        f"check {check} and the inputs")
    records = [dict(r, tokens=0, documents=0) for r in req.records]
    for i, tally in enumerate(per):  # SFT formats: each input's records read and bad
        records[i].update(records=tally.records, bad=tally.bad_total)
    for d in done:
        rec = records[int(d.unit["source"])]
        for s in (d.train, d.val):
            if s:
                rec["tokens"] += s.tokens
                rec["documents"] += s.documents
    t = req.tokenizer
    return Manifest(vocab_size=t.vocab_size, dtype=dtype, train=train, val=val, tokenizer_hash=t.hash,
                    inputs=tuple(records), options=asdict(req.options), key=req.key, bos_id=t.bos_id,
                    eos_id=t.eos_id, hpctrain_version=__version__, tokenizer=t.path,
                    records=total.to_json() if total is not None else {},
                    version=MASKED_VERSION if total is not None else VERSION)
