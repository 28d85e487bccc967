"""What `submit` does with `[data] source` on the login side, before any folder or job exists.

- A prepared folder: its manifest's vocabulary must fit the model's (`vocab_size` ids index the embedding;
  the rank checks it again on the node, where a mismatch would cost an allocation).
- Raw text already prepared in the data cache with this tokenizer and the default options (data/cache.py):
  the run reads that folder instead, so sweep points and retries share one prepared copy.
- Raw text on a multi-node run that is not prepared: refused, naming the exact `hpctrain data prepare`
  command. Every rank would otherwise read and tokenize the whole corpus (out of memory, or past the
  distributed timeout: issue #15). The command writes into the cache, so submitting again finds it.
  (A prepare job chained in front of the run with --dependency=afterok is not built: the refusal costs the
  user one command and never queues a run behind a prepare that might fail.)
- Raw text on one node stays the node's in-RAM path.
- SFT formats ([data] format = "alpaca" | "chat"): the cache is looked up, and the command named, with the
  format's options (--format, --seq-len, --overlong, --messages-field); chat with the byte tokenizer is
  refused here, before an allocation.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from hpctrain.data import cache, inputs
from hpctrain.data.format import PreparedFormatError, is_prepared, read_manifest
from hpctrain.errors import HpcUsageError, bad_value


def prepare_command(source: str, tokenizer: str, text_field: str, data: Any = None) -> str:
    """The `hpctrain data prepare` command that writes the cache folder `submit` looks for."""
    cmd = ["hpctrain", "data", "prepare", source, "--tokenizer", tokenizer]
    if text_field != "text":
        cmd += ["--text-field", text_field]
    opts = _options(text_field, data)
    if opts.sft:
        cmd += ["--format", opts.format, "--seq-len", str(opts.seq_len)]
        cmd += ["--overlong", opts.overlong] if opts.overlong != "truncate" else []
        cmd += ["--messages-field", opts.messages_field] if opts.messages_field != "messages" else []
    return " ".join(shlex.quote(c) for c in cmd)


def _options(text_field: str, data: Any) -> Any:
    """The prepare Options a run's [data] stands for: the defaults, or its SFT format's."""
    from hpctrain.data.prepare import Options
    from hpctrain.data.sft import FORMATS

    if data is None or data.format not in FORMATS:
        return Options(text_field=text_field)
    return Options(text_field=text_field, format=data.format, messages_field=data.messages_field,
                   seq_len=data.seq_len, overlong=data.overlong)


def _check_vocab(source: str, model_vocab: int) -> None:
    try:
        m = read_manifest(source)
    except PreparedFormatError as exc:
        raise bad_value("data.source", source, str(exc).rstrip("."), "prepare it again with `hpctrain data prepare`") \
            from None
    if model_vocab > 0 and m.vocab_size > model_vocab:  # 0: the model is unknown (a user script without [model])
        raise bad_value("data.source", source,
                        f"prepared with a tokenizer of {m.vocab_size} ids ({m.tokenizer or m.tokenizer_hash[:12]}), "
                        f"more than the model's vocab_size {model_vocab}: ids from {model_vocab} on have no embedding",
                        "prepare the data with the model's tokenizer, or use a model whose vocab_size is at least "
                        f"{m.vocab_size} (--set model.overrides.vocab_size=... for a model built from a config)")


def _check_sft(source: str, data: Any) -> None:
    """[data] format alpaca/chat on a prepared folder: it must hold that format's masks (the run reads the folder
    as "prepared", so this is where a text folder would otherwise train on every token)."""
    from hpctrain.data.sft import FORMATS

    if data is None or data.format not in FORMATS:
        return
    m = read_manifest(source)
    made = str(m.options.get("format") or "text")
    if not m.masked or made != data.format:
        raise bad_value("data.source", source, f"prepared as {made!r}{'' if m.masked else ', without loss masks'}, "
                        f"and [data] format = {data.format!r} trains on the responses only",
                        f"prepare it with `hpctrain data prepare INPUT --format {data.format} --seq-len {data.seq_len} "
                        "--tokenizer DIR`, or set [data] format = \"prepared\" to train on every token")


SAMPLE_RECORDS = 20  # the first records a raw file's shape is judged by: enough to skip a stray bad line


def _check_records(source: str, text_field: str, data: Any) -> None:
    """A raw jsonl file whose first records lack every field its format reads is refused here, naming the format
    the fields fit (a chat file under format = "jsonl" is the usual case): on the node the same mismatch fails
    every rank after the allocation. One bad record among good ones is the node's to count, not refused here."""
    path = Path(source)
    fmt = getattr(data, "format", "")
    if not path.is_file() or fmt not in ("jsonl", "alpaca", "chat", "auto") or \
            (fmt == "auto" and path.suffix not in (".jsonl", ".json")):
        return
    need = {"alpaca": ("instruction", "output"), "chat": (data.messages_field,)}.get(fmt, (text_field,))
    seen: list[set[str]] = []
    lines = 0
    with path.open("rb") as fh:
        for line in fh:
            if len(seen) >= SAMPLE_RECORDS:
                break
            if not line.strip().lstrip(b"\xef\xbb\xbf").strip():  # a BOM alone is no record either
                continue
            lines += 1
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the node counts (SFT) or names (text) a line that is not JSON
            if isinstance(rec, dict):
                seen.append(set(map(str, rec)))
    if not lines:  # every rank would read it and stop with "no records found"
        raise bad_value("data.source", source, "holds no records (it is empty or has blank lines only)",
                        "point [data] source (--data) at the file or folder of your records")
    if not seen or any(all(k in keys for k in need) for keys in seen):
        return
    keys = sorted(set().union(*seen))
    key, value = ("data.text_field", text_field) if fmt in ("jsonl", "auto") and not _fits(keys, data) else \
        ("data.format", fmt)
    raise bad_value(key, value, f"the first {len(seen)} records of {source} have the fields {', '.join(keys)}, and "
                    f"format {fmt!r} reads {' and '.join(repr(k) for k in need)}", _record_fix(keys, data))


def _fits(keys: list[str], data: Any) -> str:
    """The SFT format whose fields the records have, or ""."""
    if data.messages_field in keys or "messages" in keys:
        return "chat"
    return "alpaca" if "instruction" in keys and "output" in keys else ""


def _record_fix(keys: list[str], data: Any) -> str:
    fits = _fits(keys, data)
    if fits == "chat":
        field = data.messages_field if data.messages_field in keys else "messages"
        extra = "" if field == data.messages_field else f" and [data] messages_field = {field!r}"
        return f"set [data] format = \"chat\"{extra} (the loss on the assistant turns only; docs/data.md)"
    if fits == "alpaca":
        return "set [data] format = \"alpaca\" (instruction/input/output; the loss on the output only)"
    return (f"set [data] text_field to the field that holds the text (one of: {', '.join(keys)}), or [data] format "
            "to the records' format (\"chat\": messages, \"alpaca\": instruction/output); docs/data.md")


def _cached(source: str, tokenizer: str, text_field: str, data: Any = None) -> Path | None:
    """The cache folder of `source` prepared with the default options, or None (reads no input file)."""
    from hpctrain.data.tokenizer import BYTE, folder_hash

    tok = Path(tokenizer)
    if tokenizer != BYTE and not (tok / "tokenizer.json").is_file():
        return None
    try:
        found = inputs.find_inputs([source])
    except HpcUsageError:
        return None
    return cache.lookup([i.path for i in found], BYTE if tokenizer == BYTE else folder_hash(tok),
                        _options(text_field, data).key_dict())


def _check_chat_template(tokenizer: str) -> None:
    """Raw chat records are rendered by the tokenizer's chat_template on the node: a folder that surely has none
    is refused here, before the job waits in the queue for the node to refuse it (data/sft.check_chat_tokenizer)."""
    from hpctrain.data.tokenizer import has_chat_template

    if has_chat_template(Path(tokenizer)) is False:
        raise bad_value("data.tokenizer", tokenizer, "has no chat_template (tokenizer_config.json \"chat_template\" "
                        "or chat_template.jinja), and format \"chat\" renders conversations with it",
                        "set [data] tokenizer to the instruct model's tokenizer folder, add a chat_template to this "
                        "one, or use format \"alpaca\"")


def _check_tokenizer(source: str, tokenizer: str) -> str:
    """A fine-tune's prepared folder against its [data] tokenizer (the model's own by default): ids of the byte
    tokenizer for a model with its own tokenizer, or the other way round, are refused (the pretrained model would
    train on ids it never learned, silently: the vocabulary check passes when the folder's ids are fewer); other
    tokenizer files than prepare read get a warning (returned; "" when they agree or the folder does not say)."""
    from hpctrain.data.tokenizer import BYTE, folder_hash

    m = read_manifest(source)
    if not m.tokenizer_hash:  # written by hand or by an older prepare: it does not say
        return ""
    made_byte, run_byte = m.tokenizer_hash == BYTE, tokenizer in ("", BYTE)
    made = BYTE if made_byte else (m.tokenizer or m.tokenizer_hash[:12])
    if made_byte != run_byte:
        inputs = " ".join(shlex.quote(str(i.get("path", ""))) for i in m.inputs) or "INPUT"
        raise bad_value("data.source", source, f"prepared with the tokenizer {made!r}, and this fine-tune's [data] "
                        f"tokenizer is {tokenizer or BYTE!r}: the pretrained model would train on another "
                        "tokenizer's ids", f"prepare it again with `hpctrain data prepare {inputs} --tokenizer "
                        f"{shlex.quote(tokenizer or BYTE)} ...` (the options it was prepared with), or set [data] "
                        "tokenizer to the one it was prepared with if that is the model's")
    # The same folder is not compared: a folder prepared before the hash left weights out would always differ.
    if run_byte or not Path(tokenizer).is_dir() or _same_path(tokenizer, m.tokenizer) or \
            folder_hash(Path(tokenizer)) == m.tokenizer_hash:
        return ""
    return (f"WARNING: data.source {source} was prepared with the tokenizer {made}, whose files differ from [data] "
            f"tokenizer {tokenizer}: if the ids differ, prepare it again with --tokenizer {shlex.quote(tokenizer)}")


def _same_path(a: str, b: str) -> bool:
    try:
        return bool(b) and Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError):
        return False


def submit_source(source: str, tokenizer: str, text_field: str, model_vocab: int, nodes: int,
                  data: Any = None, *, finetune: bool = False) -> tuple[str, str]:
    """The source the run should read, and a note for the user ("" when unchanged); refuses as above.
    `data`: the spec's [data] (its format and SFT options), when the caller has it; `finetune`: the run starts
    from a pretrained [model] path (its prepared data must come from its tokenizer)."""
    if source == "synthetic":
        return source, ""
    if data is not None and data.format == "chat" and tokenizer in ("", "byte"):
        raise bad_value("data.tokenizer", tokenizer, "format \"chat\" renders conversations with the tokenizer's "
                        "chat_template, and the byte tokenizer has none", "set [data] tokenizer to a local "
                        "tokenizer folder with a chat_template (the model's), or use format \"alpaca\"")
    if is_prepared(source):
        _check_vocab(source, model_vocab)
        _check_sft(source, data)
        return source, _check_tokenizer(source, tokenizer) if finetune else ""
    if data is not None and data.format == "chat":
        _check_chat_template(tokenizer)
    found = _cached(source, tokenizer, text_field, data)
    if found is not None:
        _check_vocab(str(found), model_vocab)
        return str(found), f"data.source: {source} is prepared in the data cache; the run reads {found}"
    _check_records(source, text_field, data)
    if nodes > 1:
        cmd = prepare_command(source, tokenizer, text_field, data)
        raise bad_value("data.source", source,
                        f"raw text on a {nodes}-node run: every rank would read and tokenize the whole corpus",
                        f"prepare it once with `{cmd}` (add --submit to run it on a CPU node), then submit again: "
                        "the run reads the prepared folder from the data cache. Or pass --data with a prepared folder")
    return source, ""
