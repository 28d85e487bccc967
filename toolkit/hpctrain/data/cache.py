"""Where prepared folders live and what identifies one: the content-hashed cache shared by runs.

The key of a prepared folder is one function of what decides its bytes (`cache_key`): the sha256 of
every input's content in order, the tokenizer folder's hash, and the options that change tokens or
layout (text field, bos/eos, validation fraction, shard size; not the number of workers, which changes
nothing). Paths are not part of it: the same corpus copied elsewhere is the same prepared data.

Input identity: the content hash is what counts and what the manifest records. Hashing a 100 GB corpus
takes minutes, so each file's hash is remembered under `cache_root()/.hashes`, named by (real path, size,
mtime_ns, inode): a file whose size and modification time are unchanged is not read again (the fast path
make, rsync and ccache's direct mode use). Touching or rewriting a file costs one new hash; if its
content is unchanged the key, and so the cache hit, is the same.

The cache root is $HPCTRAIN_DATA_CACHE, else `<runs dir>/.prepared` (the runs dir is on the shared
filesystem, so every node and every later run sees the same folders). `submit` looks a raw source up here
(`lookup`): sweep points and retries then all read one prepared folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hpctrain.data.format import FORMAT, VERSION, is_prepared, read_manifest
from hpctrain.runs.folder import runs_dir_default

HASHES = ".hashes"
BLOCK = 8 << 20


def cache_root() -> Path:
    """$HPCTRAIN_DATA_CACHE, else <runs dir>/.prepared."""
    env = os.environ.get("HPCTRAIN_DATA_CACHE")
    return (Path(env) if env else runs_dir_default() / ".prepared").absolute()


def cache_key(input_hashes: list[str], tokenizer_hash: str, options: dict[str, Any]) -> str:
    """THE key of a prepared folder (see the module docstring); 32 hex digits."""
    doc = {"format": FORMAT, "version": VERSION, "inputs": input_hashes, "tokenizer": tokenizer_hash,
           "options": options}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def cache_folder(key: str) -> Path:
    return cache_root() / key


def identity(path: str) -> dict[str, Any]:
    """What the fast path compares: the file's real path, size and modification time (and inode)."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _memo(ident: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:40]
    return cache_root() / HASHES / name


def known_hash(path: str) -> str | None:
    """The remembered content hash of an unchanged file, or None (never reads the file itself)."""
    try:
        text = _memo(identity(path)).read_text().strip()
    except OSError:
        return None
    return text if len(text) == 64 else None


def content_hash(path: str) -> str:
    """sha256 of the file's bytes, from the memo when size and mtime are unchanged (else read, then remembered)."""
    ident = identity(path)
    memo = _memo(ident)
    try:
        text = memo.read_text().strip()
        if len(text) == 64:
            return text
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(BLOCK):
            h.update(block)
    digest = h.hexdigest()
    try:  # best effort: an unwritable cache only costs a hash next time
        from hpctrain.data.format import atomic_write_bytes

        atomic_write_bytes(memo, digest.encode())
    except OSError:
        pass
    return digest


def lookup(input_paths: list[str], tokenizer_hash: str, options: dict[str, Any]) -> Path | None:
    """The cached prepared folder for these inputs, or None; reads no input (only remembered hashes)."""
    hashes = [known_hash(p) for p in input_paths]
    if any(h is None for h in hashes):
        return None  # a file never hashed (or changed since) was never prepared as it is now
    folder = cache_folder(cache_key([h for h in hashes if h], tokenizer_hash, options))
    if not is_prepared(folder):
        return None
    try:
        return folder if read_manifest(folder).key == folder.name else None
    except ValueError:
        return None
