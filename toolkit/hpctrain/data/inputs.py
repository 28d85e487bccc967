"""What `data prepare` reads: input files found from the paths given, cut into units of work, read as texts.

A *unit* is the part of one input that becomes one shard: a byte range of a .jsonl/.txt file that starts
and ends at a line boundary, a run of row groups of a parquet file, a row range of an arrow file, or a
whole compressed file (.gz/.zst streams cannot be entered in the middle). Units are cut by input size
alone (`shard_bytes`), never by the number of workers, so the shards, and the folder's key, are the same
whatever `--workers` is, and a resumed prepare cuts the same units as the killed one.

Documents: a jsonl record's `text_field`, a text file's non-empty line (as the node's in-RAM reader and
`load_dataset("text")` read them), a parquet/arrow row's `text_field`. Blank documents are skipped.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.errors import bad_value

JSONL = (".jsonl", ".json", ".ndjson")
TEXT = (".txt", ".text", ".md")
COMPRESSED = (".gz", ".zst")
SAVED = ("state.json", "dataset_info.json", "dataset_dict.json")
FIX = ("pass .jsonl[.gz|.zst], .txt[.gz|.zst], .parquet or .arrow files, a datasets.save_to_disk folder, "
       "or folders of them")


@dataclass(frozen=True)
class Input:
    """One input file: `kind` is jsonl | json_array | text | parquet | arrow; `codec` is "", "gz" or "zst"."""

    path: str
    kind: str
    codec: str = ""


@dataclass(frozen=True)
class Unit:
    """Part of input `source` (its index): bytes or rows [start, end); `size` is bytes, for progress."""

    source: int
    start: int
    end: int
    size: int


def kind_of(path: Path) -> tuple[str, str] | None:
    """(kind, codec) from the file name, or None when prepare does not read such a file."""
    name = path.name.lower()
    codec = next((c[1:] for c in COMPRESSED if name.endswith(c)), "")
    base = name[: -len(codec) - 1] if codec else name
    for suffixes, kind in ((JSONL, "jsonl"), (TEXT, "text")):
        if base.endswith(suffixes):
            return kind, codec
    if not codec and base.endswith(".parquet"):
        return "parquet", ""
    if not codec and base.endswith(".arrow"):
        return "arrow", ""
    return None


def _saved_dataset_files(folder: Path) -> list[Path]:
    """The arrow files of a `save_to_disk` folder (a DatasetDict: its train split, else its first)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        split = "train" if "train" in splits else (splits[0] if splits else "")
        return _saved_dataset_files(folder / split)
    state = json.loads((folder / "state.json").read_text())
    return [folder / f["filename"] for f in state.get("_data_files", [])]


def _walk(folder: Path) -> list[Input]:
    """A folder's inputs in sorted order; a save_to_disk folder inside it counts once, through its state.json."""
    if any((folder / n).is_file() for n in SAVED):
        return [Input(str(f.absolute()), "arrow") for f in _saved_dataset_files(folder)]
    found: list[Input] = []
    for p in sorted(folder.iterdir()):
        if p.is_dir():
            found.extend(_walk(p))
        elif (kc := kind_of(p)) is not None:
            found.append(Input(str(p.absolute()), *kc))
    return found


def find_inputs(paths: list[str]) -> list[Input]:
    """Every input file under `paths`, in the order given (folders: sorted walk). Refuses what is not readable."""
    found: list[Input] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise bad_value("INPUT", raw, "no such file or folder", FIX)
        if p.is_dir():
            found.extend(_walk(p))
        else:
            kind, codec = kind_of(p) or ("text", "")  # a file named on the command line: text unless it says
            found.append(Input(str(p.absolute()), kind, codec))
    if not found:
        raise bad_value("INPUT", " ".join(paths), "no input files found", FIX)
    return [dataclasses.replace(i, kind=JSON_ARRAY) if is_json_array(i) else i for i in found]


# A .json file holding one JSON array of records (Stanford Alpaca's alpaca_data.json, most datasets' .json
# exports) rather than JSON Lines: read whole, as one unit, each item a record.
JSON_ARRAY = "json_array"


def is_json_array(inp: Input) -> bool:
    """An uncompressed .json input whose first character (after a BOM and whitespace) opens an array."""
    if inp.kind != "jsonl" or inp.codec or not inp.path.lower().endswith(".json"):
        return False
    try:
        with open(inp.path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"["


def json_items(path: str) -> list[Any]:
    """The items of a JSON-array file; a file that is not one valid JSON array is refused, naming why."""
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_value("INPUT", path, f"not a valid JSON array ({exc})",
                        "fix the file, or write one JSON object per line (.jsonl)") from None
    if not isinstance(items, list):
        raise bad_value("INPUT", path, "not a JSON array", "write one JSON object per line (.jsonl)")
    return items


# -------------------------------------------------------------------------------------------------- units

def _line_bounds(path: str, size: int, step: int) -> list[int]:
    """Offsets 0 < ... < size, each the start of a line, about `step` bytes apart."""
    bounds = [0]
    with open(path, "rb") as fh:
        pos = step
        while pos < size:
            fh.seek(pos)
            fh.readline()  # to the end of the line that `pos` fell into
            nxt = fh.tell()
            if nxt >= size:
                break
            bounds.append(nxt)
            pos = nxt + step
    return [*bounds, size]


def _arrow_table(path: str) -> Any:
    """An arrow file as a zero-copy table over its memory map (IPC stream, as datasets writes, or file)."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).read_all()


def units_of(inp: Input, index: int, shard_bytes: int) -> list[Unit]:
    """Cut one input into units of about `shard_bytes` of input (see the module docstring)."""
    size = os.path.getsize(inp.path)
    if inp.codec or inp.kind == JSON_ARRAY or inp.kind in ("jsonl", "text") and size <= shard_bytes:
        return [Unit(index, 0, size, size)]
    if inp.kind in ("jsonl", "text"):
        b = _line_bounds(inp.path, size, shard_bytes)
        return [Unit(index, lo, hi, hi - lo) for lo, hi in itertools.pairwise(b)]
    if inp.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(inp.path).metadata
        groups = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
        out, first, acc = [], 0, 0
        for i, g in enumerate(groups):
            acc += g
            if acc >= shard_bytes or i == len(groups) - 1:
                out.append(Unit(index, first, i + 1, acc))
                first, acc = i + 1, 0
        return out or [Unit(index, 0, 0, 0)]
    rows = _arrow_table(inp.path).num_rows
    per = max(1, rows * shard_bytes // max(size, 1))
    return [Unit(index, a, min(a + per, rows), size * (min(a + per, rows) - a) // max(rows, 1))
            for a in range(0, rows, per)] or [Unit(index, 0, 0, 0)]


# -------------------------------------------------------------------------------------------------- reading

def _open(inp: Input) -> Any:
    if inp.codec == "gz":
        import gzip

        return gzip.open(inp.path, "rb")
    if inp.codec == "zst":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(inp.path, "rb"), closefd=True)
    return open(inp.path, "rb")


def _lines(inp: Input, unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(offset in the decompressed stream, line) for the lines of the unit."""
    with _open(inp) as raw:
        fh = io.BufferedReader(raw) if inp.codec == "zst" else raw  # zstandard's reader has no readline
        pos = unit.start
        if pos:
            fh.seek(pos)
        for line in fh:
            if not inp.codec and pos >= unit.end:
                break
            yield pos, line
            pos += len(line)


def _jsonl(inp: Input, unit: Unit, field: str) -> Iterator[str]:
    for pos, line in _lines(inp, unit):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise bad_value("INPUT", inp.path, f"the line at byte {pos} is not valid JSON ({exc})",
                            "fix or drop that line (jsonl: one JSON object per line)") from None
        if not isinstance(rec, dict) or field not in rec:
            keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
            raise bad_value("--text-field", field, f"the record at byte {pos} of {inp.path} has no such field "
                            f"(it has: {keys})", "pass --text-field with the field that holds the text")
        yield str(rec[field])


def _column(table: Any, path: str, field: str) -> list[Any]:
    if field not in table.column_names:
        raise bad_value("--text-field", field, f"{path} has no such column (columns: {', '.join(table.column_names)})",
                        "pass --text-field with the column that holds the text")
    return list(table.column(field).to_pylist())


def _array_texts(path: str, field: str) -> list[Any]:
    items = json_items(path)
    for i, rec in enumerate(items):
        if not isinstance(rec, dict) or field not in rec:
            keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
            raise bad_value("--text-field", field, f"item {i} of {path} has no such field (it has: {keys})",
                            "pass --text-field with the field that holds the text")
    return [rec[field] for rec in items]


def read_texts(inp: Input, unit: Unit, field: str) -> Iterator[str]:
    """The non-blank documents of one unit, in input order."""
    if inp.kind == "jsonl":
        texts: Iterator[Any] = _jsonl(inp, unit, field)
    elif inp.kind == JSON_ARRAY:
        texts = iter(_array_texts(inp.path, field))
    elif inp.kind == "text":
        # utf-8-sig at the top of the file: a BOM (Windows editors, Excel exports) is not part of the first line
        texts = (line.decode("utf-8-sig" if pos == 0 else "utf-8", errors="replace").rstrip("\r\n")
                 for pos, line in _lines(inp, unit))
    elif inp.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(inp.path)
        names = pf.schema_arrow.names
        groups = list(range(unit.start, unit.end))
        table = pf.read_row_groups(groups, columns=[field] if field in names else None) if groups else None
        texts = iter(_column(table, inp.path, field) if table is not None else [])
    else:
        texts = iter(_column(_arrow_table(inp.path).slice(unit.start, unit.end - unit.start), inp.path, field))
    for t in texts:
        if t is not None and str(t).strip():
            yield str(t)


def read_records(inp: Input, unit: Unit) -> Iterator[tuple[str, Any, str]]:
    """The records of one unit for an SFT format: (where, record or sft.Bad, the text its split hash reads).

    `where` is FILE:LINE for a unit that starts at the top of its file (the only unit of a small or compressed
    file, and the first of any), else FILE (the line at byte N): counting the lines before a unit in the middle
    of a large file would read all of it again. Parquet/arrow rows are FILE row N.
    """
    from hpctrain.data import sft

    if inp.kind == "jsonl":
        for n, (pos, line) in enumerate(_lines(inp, unit), 1):
            if not line.strip():
                continue
            where = f"{inp.path}:{n}" if unit.start == 0 else f"{inp.path} (the line at byte {pos})"
            try:
                rec: Any = sft.parse_line(line)
            except sft.Bad as bad:
                rec = bad
            yield where, rec, line.decode("utf-8", "replace").strip()
        return
    if inp.kind == JSON_ARRAY:
        for i, rec in enumerate(json_items(inp.path)):
            yield f"{inp.path} item {i}", rec, json.dumps(rec, sort_keys=True, default=str)
        return
    if inp.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(inp.path)
        first = sum(pf.metadata.row_group(i).num_rows for i in range(unit.start))
        groups = list(range(unit.start, unit.end))
        rows = pf.read_row_groups(groups).to_pylist() if groups else []
    elif inp.kind == "arrow":
        first = unit.start
        rows = _arrow_table(inp.path).slice(unit.start, unit.end - unit.start).to_pylist()
    else:
        raise bad_value("INPUT", inp.path, "a text file holds no records",
                        "pass .jsonl, .parquet or .arrow files of records for --format alpaca/chat")
    for i, row in enumerate(rows):
        yield f"{inp.path} row {first + i}", row, json.dumps(row, sort_keys=True, default=str)
