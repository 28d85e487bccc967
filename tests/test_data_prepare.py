"""`hpctrain data prepare` with a real BPE tokenizer on real text (the standard library's sources).

Every input format gives the tokens that transformers' own tokenizer gives; the manifest says what was made
and from what; an unchanged prepare is a cache hit that rewrites nothing; a killed prepare resumes; hostile
paths work; submit reads a prepared folder (vocabulary checked) and refuses raw text on several nodes with
the command that prepares it. The SLURM test runs prepare as a job on the real cluster.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from datakit import build_tokenizer, stdlib_texts, write_jsonl
from hpctrain.cli.main import cli
from hpctrain.data import format as fmt
from hpctrain.data.prepare import is_val

REPO = Path(__file__).resolve().parent.parent
HOSTILE = "dir with 'quotes' $HOME; & \"x\""


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # vocab 300 < llama-tiny's 320, so the submit tests can use the preset
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "bpe tok", vocab_size=300,
                           texts=stdlib_texts(40, max_bytes=6000))


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return stdlib_texts(30, max_bytes=6000)


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HPCTRAIN_DATA_CACHE", str(tmp_path / "cache"))


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def prepare(*args: str) -> Any:
    res = invoke("data", "prepare", *args, "--no-progress")
    assert res.exit_code == 0, res.output
    return res


@functools.cache
def _auto(tok: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok))


def expected(tok: Path, texts: list[str]) -> list[list[int]]:
    t = _auto(tok)
    return [list(t(x, add_special_tokens=False)["input_ids"]) + [t.eos_token_id] for x in texts]


def all_docs(folder: Path) -> list[list[int]]:
    out = []
    for split in ("train", "val"):
        if getattr(fmt.read_manifest(folder), split).shards:
            s = fmt.PreparedSplit(folder, split)
            out += [s.doc(i).tolist() for i in range(len(s))]
    return out


def write_inputs(root: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents in every format prepare reads."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    src = write_jsonl(root / "c.jsonl", docs)
    raw = src.read_bytes()
    (root / "c.jsonl.gz").write_bytes(gzip.compress(raw))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": docs}), root / "c.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "saved"))
    return {"jsonl": src, "gz": root / "c.jsonl.gz", "zst": root / "c.jsonl.zst", "parquet": root / "c.parquet",
            "saved": root / "saved"}


def test_every_input_format_gives_transformers_tokens(tmp_path: Path, tok: Path, docs: list[str]) -> None:
    want = expected(tok, docs)
    for name, path in write_inputs(tmp_path / "in", docs).items():
        out = tmp_path / f"out-{name}"
        prepare(str(path), "--tokenizer", str(tok), "--out", str(out), "--val-fraction", "0", "--shard-size", "8K")
        assert all_docs(out) == want, name
    lines = [ln for d in docs[:5] for ln in d.splitlines() if ln.strip()]
    (tmp_path / "in" / "t.txt").write_text("\n".join(lines) + "\n")
    prepare(str(tmp_path / "in" / "t.txt"), "--tokenizer", str(tok), "--out", str(tmp_path / "txt"),
            "--val-fraction", "0")
    assert all_docs(tmp_path / "txt") == expected(tok, lines)  # a text file: one document per line
    # a folder of inputs: each file once, in sorted order (c.jsonl, c.jsonl.gz, ... then saved/)
    prepare(str(tmp_path / "in"), "--tokenizer", str(tok), "--out", str(tmp_path / "all"), "--val-fraction", "0")
    m = fmt.read_manifest(tmp_path / "all")
    assert [Path(i["path"]).name for i in m.inputs] == ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet",
                                                        "data-00000-of-00001.arrow", "t.txt"]
    assert m.documents == 5 * len(docs) + len(lines)


def test_manifest_says_what_was_made_and_from_what(tmp_path: Path, tok: Path, docs: list[str]) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "out"
    prepare(str(src), "--tokenizer", str(tok), "--out", str(out), "--val-fraction", "0.2", "--shard-size", "16K")
    m = fmt.read_manifest(out)
    raw = json.loads((out / fmt.MANIFEST).read_text())
    assert raw["tokens"] == m.train.tokens and raw["documents"] == m.train.documents
    assert m.vocab_size == 300 and m.dtype == "uint16" and (m.bos_id, m.eos_id) == (1, 2)
    assert len(m.train.shards) > 1 and m.val.documents > 0
    want = expected(tok, docs)
    val = [w for d, w in zip(docs, want, strict=True) if is_val(d, 0.2)]
    assert m.val.documents == len(val) and m.val.tokens == sum(map(len, val))
    assert m.train.tokens + m.val.tokens == sum(map(len, want))
    assert m.inputs[0]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert m.inputs[0]["tokens"] == m.train.tokens + m.val.tokens
    assert m.options["val_fraction"] == 0.2 and m.options["text_field"] == "text" and len(m.key) == 32
    assert m.tokenizer_hash and m.tokenizer == str(tok)
    assert sum(" shard " in ln for ln in (out / "prepare.log").read_text().splitlines()) == len(m.train.shards)


def test_unchanged_prepare_is_a_cache_hit(tmp_path: Path, tok: Path, docs: list[str]) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    args = (str(src), "--tokenizer", str(tok), "--shard-size", "16K")
    first = prepare(*args)  # no --out: the data cache, named by the key
    folder = Path(re.search(r"prepared (.+?): ", first.output).group(1))  # type: ignore[union-attr]
    assert folder.parent == tmp_path / "cache" and folder.name == fmt.read_manifest(folder).key
    stamps = {p: p.stat().st_mtime_ns for p in folder.rglob("*.bin")}
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, same content: hashed again, same key
    again = prepare(*args)
    assert again.output.startswith("cache hit") and str(folder) in again.output
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*.bin")} == stamps
    assert "cache hit" in (folder / "prepare.log").read_text().splitlines()[-1]
    other = prepare(*args, "--no-append-eos")  # another option: another folder
    assert "cache hit" not in other.output and str(folder) not in other.output


def test_killed_prepare_resumes(tmp_path: Path, tok: Path, docs: list[str]) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", docs * 8)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "hpctrain", "data", "prepare", str(src), "--tokenizer", str(tok), "--out",
            str(out), "--shard-size", "4K", "--workers", "1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'toolkit'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log, deadline = out / "prepare.log", time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and log.read_text().count(" shard ") >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "prepare ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert not fmt.is_prepared(out)
    finished = log.read_text().count(" shard ")
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=True)
    kept = int(re.search(r"resuming: (\d+) of (\d+) shards kept", res.stdout).group(1))  # type: ignore[union-attr]
    assert kept >= 3 and kept <= finished + 1
    pairs = list(zip(expected(tok, docs * 8), docs * 8, strict=True))
    assert all_docs(out) == [d for d, t in pairs if not is_val(t, 0.005)] + [d for d, t in pairs if is_val(t, 0.005)]
    assert not list(out.rglob("*.tmp")) and not (out / ".prepare-progress.jsonl").exists()


def test_hostile_paths(tmp_path: Path, tok: Path, docs: list[str]) -> None:
    root = tmp_path / HOSTILE
    src = write_jsonl(root / "in put.jsonl", docs[:5])
    out = root / "out 'dir'"
    prepare(str(src), "--tokenizer", str(tok), "--out", str(out))
    assert fmt.read_manifest(out).inputs[0]["path"] == str(src)
    assert len(all_docs(out)) == 5
    res = invoke("data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(root / "o2"),
                 "--text-field", "body")
    assert res.exit_code == 2 and "--text-field = 'body'" in res.output and "(it has: id, text)" in res.output
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("not a prepared corpus")
    res = invoke("data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(root / "mine"))
    assert res.exit_code == 2 and "holds files that are not a prepared corpus (notes.txt)" in res.output
    assert sorted(p.name for p in (root / "mine").iterdir()) == ["notes.txt"]


def test_submit_reads_prepared_data_and_refuses_raw_text_on_several_nodes(tmp_path: Path, tok: Path,
                                                                          docs: list[str]) -> None:
    src = write_jsonl(tmp_path / HOSTILE / "c.jsonl", docs[:8])
    run = ("submit", "--model", "llama-tiny", "--nodes", "2", "--data", str(src), "--set", f"data.tokenizer={tok}",
           "--dry-run")
    res = invoke(*run)
    assert res.exit_code == 2 and "raw text on a 2-node run" in res.output
    cmd = re.search(r"`(hpctrain data prepare [^`]+)`", res.output).group(1)  # type: ignore[union-attr]
    prepare(*shlex.split(cmd)[3:])  # the exact command the refusal names
    res = invoke(*run, "--out", str(tmp_path / "dry"))
    assert res.exit_code == 0, res.output
    import tomllib

    source = tomllib.loads((tmp_path / "dry" / "spec.toml").read_text())["data"]["source"]
    assert fmt.is_prepared(source) and Path(source).parent == tmp_path / "cache"
    # a prepared folder whose vocabulary the model cannot embed is refused at submit
    res = invoke("submit", "--model", "llama-tiny", "--data", source, "--set", "model.overrides.vocab_size=280",
                 "--dry-run")
    assert res.exit_code == 2 and "more than the model's vocab_size 280" in res.output


@pytest.mark.slurm
def test_prepare_as_a_slurm_job(tmp_path: Path, tok: Path, docs: list[str]) -> None:
    from conftest import wait_job_state

    root = tmp_path / HOSTILE
    src = write_jsonl(root / "c.jsonl", docs)
    out = root / "prepared 'x'"
    res = invoke("data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(out), "--shard-size", "16K",
                 "--workers", "2", "--time", "00:10:00", "--submit")
    assert res.exit_code == 0, res.output
    job = re.search(r"submitted prepare job (\d+)", res.output).group(1)  # type: ignore[union-attr]
    try:
        wait_job_state(job, "COMPLETED", timeout=240)
    finally:
        subprocess.run(["scancel", job], check=False, capture_output=True)
    assert "prepared " in (out / f"prepare-{job}.out").read_text()
    m = fmt.read_manifest(out)
    assert m.inputs[0]["path"] == str(src) and m.documents + m.val.documents == len(docs)
    assert all_docs(out) == [d for d, t in zip(expected(tok, docs), docs, strict=True) if not is_val(t, 0.005)] + \
        [d for d, t in zip(expected(tok, docs), docs, strict=True) if is_val(t, 0.005)]


def test_the_nodes_in_ram_reader_reads_what_prepare_reads(tmp_path: Path) -> None:
    """One raw-text reader (issue 28 item 4): the node's in-RAM path takes `data prepare`'s documents."""
    pytest.importorskip("torch")
    from hpctrain.data import inputs
    from hpctrain.node.data.loader import read_texts
    from hpctrain.node.runconf import NodeInputError

    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "one"}\r\n\n{"text": "  "}\n{"text": "two"}\n')
    (d / "b.txt").write_bytes(b"\xef\xbb\xbfthree\r\nfour\n\n")
    with gzip.open(d / "c.txt.gz", "wt") as fh:
        fh.write("five\n")
    found = inputs.find_inputs([str(d)])
    prepared = [t for n, i in enumerate(found) for u in inputs.units_of(i, n, 1 << 20)
                for t in inputs.read_texts(i, u, "text")]
    assert read_texts(str(d), "auto", "text") == prepared == ["one", "two", "three", "four", "five"]
    assert read_texts(str(d / "a.jsonl"), "text", "text")[0] == '{"text": "one"}'  # [data] format names the kind
    with pytest.raises(NodeInputError, match=r"\[data\] source = .*\[data\] text_field = 'body'"):
        read_texts(str(d), "jsonl", "body")
