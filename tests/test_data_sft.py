"""SFT data: alpaca and chat records -> ids + loss mask (data/sft.py), through the node's raw reader, the
batcher's three modes, `hpctrain data prepare` and back, and two short DeepSpeed runs on CPU.

The chat tokenizer is built here: a byte-level BPE (datakit) with <|im_start|>/<|im_end|> and a ChatML
chat_template written in this file (one variant with {% generation %} blocks), saved with save_pretrained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from datakit import build_tokenizer, stdlib_texts
from hpctrain.data import format as fmt
from hpctrain.data import sft
from hpctrain.errors import HpcUsageError
from hpctrain.node.data.loader import IGNORE, DataSource, build_source, sft_docs
from hpctrain.node.data.tokenize import ByteTokenizer, load_tokenizer
from hpctrain.node.runconf import NodeInputError, read_spec
from hpctrain.runs.folder import RunFolder
from runkit import events, make_run, metrics, torchrun

CHATML = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('this template has no tool role') }}"
          "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same text, with the assistant turns marked for transformers' return_assistant_tokens_mask.
CHATML_GENERATION = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{{ '\\n' }}{% if m['role'] == 'assistant' %}"
                     "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
                     "{% else %}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "Bye now."}]


def _chat_tokenizer(out: Path, template: str | None) -> Path:
    from transformers import AutoTokenizer

    build_tokenizer(out, vocab_size=300, texts=stdlib_texts(20))
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft-tok")
    return {"chat": _chat_tokenizer(root / "chat", CHATML), "plain": _chat_tokenizer(root / "plain", None)}


def _hf(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _renderer(fmt_: str, tok: Any = None, seq_len: int = 512, overlong: str = "truncate") -> sft.Renderer:
    if tok is None:
        b = ByteTokenizer()
        return sft.Renderer(fmt_, sft.Encoding(b.encode, b.bos_id, b.eos_id), seq_len, overlong)
    enc = sft.Encoding(lambda t: tok.encode(t, add_special_tokens=False), tok.bos_token_id, tok.eos_token_id, tok)
    return sft.Renderer(fmt_, enc, seq_len, overlong)


def _jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _spec(tmp_path: Path, data: dict[str, Any], **sections: Any) -> Any:
    return read_spec(RunFolder(make_run(tmp_path / "run", data=data, **sections)))


# ------------------------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("extra", ["", "the context"])
def test_alpaca_prompt_is_masked_and_the_response_with_eos_is_trained(extra: str) -> None:
    rec = {"instruction": "Add the numbers.", "input": extra, "output": "42"}
    ids, mask, cut = _renderer("alpaca").render(rec)
    prompt = (sft.PROMPT if extra else sft.PROMPT_NO_INPUT).format(instruction=rec["instruction"], input=extra)
    want = [257, *prompt.encode(), *b"42", 258]  # bos + prompt, then the response + eos
    assert ids.tolist() == want and not cut
    assert mask.tolist() == [False] * (1 + len(prompt.encode())) + [True] * 3
    assert ("### Input:" in prompt) == bool(extra)


def test_chat_trains_on_the_assistant_turns_only(toks: dict[str, Path]) -> None:
    tok = _hf(toks["chat"])
    ids, mask, _ = _renderer("chat", tok).render({"messages": CONVERSATION})
    # The ids are exactly apply_chat_template's; the loss covers each reply and its <|im_end|>, nothing else.
    assert ids.tolist() == list(tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    assert tok.decode(ids[mask]) == "Hello!<|im_end|>Bye now.<|im_end|>"
    prompt = tok.decode(ids[~mask])
    assert "Be brief." in prompt and "Hi there" in prompt and "And?" in prompt and "Hello" not in prompt
    runs = np.flatnonzero(np.diff(mask.astype(int)) == 1)
    assert len(runs) == 2  # two separate assistant spans in a multi-turn conversation


def test_generation_blocks_give_the_same_mask_as_prefix_rendering(toks: dict[str, Path]) -> None:
    tok = _hf(toks["chat"])
    prefix = _renderer("chat", tok)
    tok.chat_template = CHATML_GENERATION
    gen = _renderer("chat", tok)
    assert gen.generation and not prefix.generation
    a, b = prefix.render({"messages": CONVERSATION}), gen.render({"messages": CONVERSATION})
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


def test_chat_needs_a_chat_template(toks: dict[str, Path], tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    for tokenizer, says in (("byte", "byte tokenizer has none"), (str(toks["plain"]), "has no chat_template")):
        spec = _spec(tmp_path, {"source": str(data), "format": "chat", "tokenizer": tokenizer, "pack": True})
        with pytest.raises(NodeInputError, match=says) as err:
            build_source(spec, load_tokenizer(tokenizer), micro=2, vocab=512)
        assert "Fix:" in str(err.value)


BAD_CHAT: list[tuple[str, Any]] = [
    ("not_json", '{"messages": [oops'),
    ("not_object", "[1, 2]"),
    ("missing_field", {"conversation": CONVERSATION}),
    ("bad_message", {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),
    ("unknown_role", {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
    ("not_string", {"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]}),
    ("no_assistant", {"messages": [{"role": "user", "content": "hi"}]}),
    ("empty_response", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}),
    ("template_error", {"messages": [{"role": "tool", "content": "{}"}, {"role": "assistant", "content": "x"}]}),
    ("overlong", {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "x"}]}),
]


def test_every_kind_of_bad_record_is_counted_and_none_is_trained_on(toks: dict[str, Path], tmp_path: Path) -> None:
    good = {"messages": CONVERSATION}
    data = _jsonl(tmp_path / "mixed.jsonl", [good, *(r for _, r in BAD_CHAT), good])
    spec = _spec(tmp_path, {"source": str(data), "format": "chat", "tokenizer": str(toks["chat"]), "seq_len": 128,
                            "pack": True})
    docs, report = sft_docs(spec.data, load_tokenizer(str(toks["chat"])))
    assert len(docs) == 2 and report["records"] == len(BAD_CHAT) + 2 and report["kept"] == 2
    assert report["bad"] == {reason: 1 for reason, _ in BAD_CHAT}
    assert report["first"]["not_json"].startswith(f"{data}:2: ")  # file:line of the record, and why
    assert "wizard" in report["first"]["unknown_role"]
    assert report["earliest"].startswith(f"{data}:2: ")


def test_overlong_truncate_keeps_the_prompt_and_drop_skips() -> None:
    rec = {"instruction": "Say it.", "output": "a long answer " * 20}
    head = 1 + len(sft.PROMPT_NO_INPUT.format(instruction="Say it.").encode())
    ids, mask, cut = _renderer("alpaca", seq_len=head + 10).render(rec)
    assert cut and len(ids) == head + 10 and not mask[:head].any() and mask[head:].all()
    tally = sft.Tally()
    assert sft.render_into(_renderer("alpaca", seq_len=head + 10, overlong="drop"), rec, "f:1", tally) is None
    assert tally.bad == {"overlong": 1}
    with pytest.raises(sft.Bad, match="prompt alone fills"):
        _renderer("alpaca", seq_len=head).render(rec)


def test_a_file_of_bad_records_only_is_refused_naming_its_first_bad_line(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "wrong.jsonl", [{"prompt": "q", "completion": "a"}] * 3)
    spec = _spec(tmp_path, {"source": str(data), "format": "alpaca", "pack": True})
    with pytest.raises(NodeInputError, match=rf"none of its 3 records.*{data}:1: no 'instruction'"):
        build_source(spec, ByteTokenizer(), micro=2, vocab=512)


# ------------------------------------------------------------------------------------------- batching
def _alpaca_records(n: int) -> list[dict[str, str]]:
    return [{"instruction": f"Count to {i % 7 + 1}.", "input": "fast" if i % 3 else "",
             "output": " ".join(str(k) for k in range(i % 7 + 1))} for i in range(n)]


@pytest.mark.parametrize("mode", ["padded", "dynamic", "pack"])
def test_the_mask_travels_through_every_batching_mode(tmp_path: Path, mode: str) -> None:
    data = _jsonl(tmp_path / "a.jsonl", _alpaca_records(40))
    flags = {"pack": mode == "pack", "dynamic_batching": mode == "dynamic"}
    src = build_source(_spec(tmp_path, {"source": str(data), "format": "alpaca", "seq_len": 512, **flags}),
                       ByteTokenizer(), micro=2, vocab=512)
    rend = _renderer("alpaca", seq_len=512)
    want = {bytes(r["output"], "utf-8") + b"\x00" for r in _alpaca_records(40)}  # response bytes (+ eos as 0)
    seen = set()
    for g in range(src.batches_per_epoch()):
        b = src.batch(g)
        x, y = b.input_ids.numpy(), b.labels.numpy()
        assert (x >= 0).all() and b.trained == int((y[:, 1:] != IGNORE).sum()) > 0
        for r in range(len(x)):
            starts = [0] if b.position_ids is None else list(np.flatnonzero(b.position_ids[r].numpy() == 0))
            for s, e in zip(starts, [*starts[1:], len(x[r])], strict=True):
                ids = [int(i) for i in x[r, s:e]]
                if ids[0] != 257:
                    continue  # pads
                n = ids.index(258) + 1  # bos ... eos: one example
                got, mask, _ = rend.render(_record_of(ids[:n]))
                assert got.tolist() == ids[:n]
                assert (y[r, s + 1:s + n] != IGNORE).tolist() == mask[1:].tolist()  # labels follow the mask
                assert y[r, s] == IGNORE or s == 0  # never predicted from the previous document
                seen.add(bytes(i if i < 256 else 0 for i in np.asarray(ids[:n])[mask]))
    assert seen == want


def _record_of(ids: list[int]) -> dict[str, str]:
    """The alpaca record a byte-tokenized example came from (prompt parsed back)."""
    text = bytes(i for i in ids if i < 256).decode()
    body, output = text.split("### Response:\n")
    instruction = body.split("### Instruction:\n")[1].split("\n\n")[0]
    extra = body.split("### Input:\n")[1].split("\n\n")[0] if "### Input:" in body else ""
    return {"instruction": instruction, "input": extra, "output": output}


# ------------------------------------------------------------------------------------------- prepared
def _prepare(tmp_path: Path, toks: dict[str, Path], records: list[Any], seq_len: int = 128,
             echo: Any = None) -> Path:
    from hpctrain.data.prepare import Options, prepare

    data = _jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "prep"
    opts = Options(format="chat", seq_len=seq_len, val_fraction=0.0)
    prepare([str(data)], str(toks["chat"]), out, opts, workers=1, progress=False, echo=echo or (lambda _: None))
    return out


def _conversations(n: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."},
                          *([{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
                            if i % 2 else [])]} for i in range(n)]


def test_prepared_folder_round_trip_holds_the_raw_paths_ids_and_mask(toks: dict[str, Path], tmp_path: Path) -> None:
    lines: list[str] = []
    records = [*_conversations(30), {"messages": [{"role": "user", "content": "hi"}]}, "not json"]
    out = _prepare(tmp_path, toks, records, echo=lines.append)
    m = fmt.read_manifest(out)
    assert m.version == fmt.MASKED_VERSION and m.masked and m.options["format"] == "chat"
    assert m.records["records"] == 32 and m.records["kept"] == 30
    assert m.records["bad"] == {"not_json": 1, "no_assistant": 1}
    assert all((out / sh.mask).stat().st_size == sh.tokens for sh in m.train.shards)
    assert any("no_assistant" in line and "chat.jsonl:31" in line for line in lines), lines  # the printed table
    split = fmt.PreparedSplit(out, "train")
    raw_spec = _spec(tmp_path / "raw", {"source": str(tmp_path / "chat.jsonl"), "format": "chat",
                                         "tokenizer": str(toks["chat"]), "seq_len": 128, "pack": True})
    raw, _ = sft_docs(raw_spec.data, load_tokenizer(str(toks["chat"])))
    assert len(split) == len(raw) == 30
    for i, doc in enumerate(raw):
        mask = split.mask(i)
        assert mask is not None
        assert split.doc(i).tolist() == np.where(doc < 0, -doc - 1, doc).tolist()
        assert (mask != 0).tolist() == (doc >= 0).tolist()
    # The node reads the folder as the raw path builds its batches.
    spec = _spec(tmp_path / "lazy", {"source": str(out), "format": "chat", "tokenizer": str(toks["chat"]),
                                      "seq_len": 128, "pack": True})
    lazy = build_source(spec, load_tokenizer(str(toks["chat"])), micro=2, vocab=512)
    ram = DataSource(raw, mode="pack", micro=2, seq_len=128, budget=256, seed=lazy.seed, pad_id=lazy.pad_id,
                     vocab=512, masked=True)
    assert lazy.masked and lazy.report["kept"] == 30
    for g in range(lazy.batches_per_epoch()):
        a, b = lazy.batch(g), ram.batch(g)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) and a.trained == b.trained


def test_prepared_sft_folders_refuse_what_would_cut_or_unmask(toks: dict[str, Path], tmp_path: Path) -> None:
    out = _prepare(tmp_path, toks, _conversations(6))
    short = _spec(tmp_path / "a", {"source": str(out), "format": "chat", "tokenizer": str(toks["chat"]),
                                    "seq_len": 64, "pack": True})
    with pytest.raises(NodeInputError, match="seq_len = 128"):
        build_source(short, load_tokenizer(str(toks["chat"])), micro=2, vocab=512)
    text = tmp_path / "text"
    from datakit import write_prepared

    write_prepared(text, toks["chat"], ["some text " * 5] * 4)
    assert fmt.read_manifest(text).version == fmt.VERSION  # an unmasked folder is written and read as before
    wrong = _spec(tmp_path / "b", {"source": str(text), "format": "chat", "tokenizer": str(toks["chat"]),
                                    "seq_len": 128, "pack": True})
    with pytest.raises(NodeInputError, match="without loss masks"):
        build_source(wrong, load_tokenizer(str(toks["chat"])), micro=2, vocab=512)


def test_prepare_refuses_a_file_of_bad_records_and_chat_without_a_template(toks: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    from hpctrain.data.prepare import Options, prepare

    with pytest.raises(HpcUsageError, match=r"none of its 2 records.*chat.jsonl:1: message 0 has role 'wizard'"):
        _prepare(tmp_path, toks, [{"messages": [{"role": "wizard", "content": "x"}]}] * 2)
    data = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    for tokenizer in ("byte", str(toks["plain"])):
        with pytest.raises(HpcUsageError, match="--tokenizer = .*Fix: "):
            prepare([str(data)], tokenizer, tmp_path / "p2", Options(format="chat", seq_len=64), workers=1,
                    progress=False, echo=lambda _: None)
    with pytest.raises(HpcUsageError, match="--seq-len"):
        Options(format="alpaca")


def test_data_prepare_command_alpaca_with_the_byte_tokenizer(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    data = _jsonl(tmp_path / "a.jsonl", [*_alpaca_records(12), {"instruction": "x", "output": ""}])
    out = tmp_path / "prep"
    res = CliRunner().invoke(cli, ["data", "prepare", str(data), "--tokenizer", "byte", "--out", str(out), "--format",
                                   "alpaca", "--seq-len", "512", "--overlong", "drop", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "13 read, 12 trained on" in res.output and "empty_response" in res.output
    m = fmt.read_manifest(out)
    assert m.masked and m.options["overlong"] == "drop" and m.inputs[0]["bad"] == 1


def test_submit_checks_sft_sources_before_any_allocation(toks: dict[str, Path], tmp_path: Path) -> None:
    from datakit import write_prepared
    from hpctrain.data.source import submit_source
    from hpctrain.spec.model import Data

    raw = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    chat = Data(source=str(raw), format="chat", tokenizer=str(toks["chat"]), seq_len=256)
    with pytest.raises(HpcUsageError, match="data.tokenizer = 'byte'.*Fix: "):
        submit_source(str(raw), "byte", "text", 512, 1, data=Data(source=str(raw), format="chat"))
    with pytest.raises(HpcUsageError, match=r"--format chat --seq-len 256"):  # the command names the format
        submit_source(str(raw), str(toks["chat"]), "text", 512, 2, data=chat)
    write_prepared(tmp_path / "text", toks["chat"], ["plain text " * 4] * 3)
    with pytest.raises(HpcUsageError, match="without loss masks"):
        submit_source(str(tmp_path / "text"), str(toks["chat"]), "text", 512, 1, data=chat)


def test_text_prepare_options_keep_their_cache_key() -> None:
    from dataclasses import asdict

    from hpctrain.data.prepare import Options

    text = Options()
    assert text.key_dict() == {k: v for k, v in asdict(text).items()
                               if k not in ("format", "messages_field", "seq_len", "overlong")}
    assert "format" in Options(format="chat", seq_len=64).key_dict()


# ------------------------------------------------------------------------------------------- training
def _trained_per_step(run: Path, tok: Any, steps: int) -> list[int]:
    """The trained tokens of the batches each step read (dp 2 x gas 2 from cursor 0), rebuilt from the run's spec."""
    spec = read_spec(RunFolder(run))
    src = build_source(spec, tok, micro=spec.train.micro_batch, vocab=512)
    out = []
    for s in range(steps):
        batches = [src.batch(s * 4 + k) for k in range(4)]
        for b in batches:  # what the model saw: labels are -100 outside the responses
            assert b.trained < b.tokens
        out.append(sum(b.trained for b in batches))
    return out


@pytest.mark.deepspeed
@pytest.mark.parametrize("path", ["raw-alpaca", "prepared-chat"])
def test_training_on_sft_data_reports_trained_tokens(toks: dict[str, Path], tmp_path: Path, path: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    if path == "raw-alpaca":
        source, tok_name, data_format = _jsonl(tmp_path / "a.jsonl", _alpaca_records(60)), "byte", "alpaca"
        seq = 256
    else:
        source = _prepare(tmp_path, toks, _conversations(60), seq_len=64)
        tok_name, data_format = str(toks["chat"]), "chat"
        seq = 64
    run = make_run(tmp_path / "run", data={"source": str(source), "format": data_format, "tokenizer": tok_name,
                                           "seq_len": seq, "pack": True},
                   train={"steps": 3}, parallel={"zero": 2})
    proc = torchrun(run, 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    want = _trained_per_step(run, load_tokenizer(tok_name), 3)
    assert [r["trained_tokens"] for r in recs] == want
    assert all(0 < r["trained_tokens"] < r["tokens"] and r["trained_tokens_per_s"] > 0 for r in recs)
    data = [e for e in events(run) if e.get("event") == "data"]
    assert len(data) == 1 and data[0]["kept"] == 60 and data[0]["format"] == data_format
    # `hpctrain summary`: trained tokens/s beside tokens/s, and the records' report, in the schema.
    from hpctrain.collect import metrics as cm
    from hpctrain.collect import summary as co
    from summary_schema import summary_errors

    speed = cm.attempt_metrics(recs, [], []).to_dict()
    assert 0 < speed["trained_tokens_per_s"] < speed["tokens_per_s"]
    rec = co.build_run(co.from_folder(run))
    assert rec["data"]["records"] == 60 and rec["data"]["bad"] == {}
    assert summary_errors({"schema_version": 1, "generated": 0.0, "runs": [rec], "errors": [], "warnings": []}) == []
    from hpctrain.cli.collect import _print_data

    _print_data(rec)
    assert f"data ({data_format}): 60 records, 60 trained on" in capsys.readouterr().out
