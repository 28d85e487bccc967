"""Fine-tuning as a hostile user, a newcomer and a skeptic try it (issue 26), without a DeepSpeed launch:

- chat records of every odd shape, in one file with a BOM, CRLF line ends and blank lines: each bad one counted
  with a reason that names what to do, none trained on, and the same counts through the raw reader and
  `data prepare`; the loss mask of conversations that open with the assistant or hold consecutive assistant
  turns (every response and its end-of-turn token trained, no header, no prompt);
- LoRA's default targets (PEFT's "all-linear") on every family of tests/familykit.py beyond the Llama-likes:
  GPT-2's Conv1D, fused qkv, MoE; the output head never adapted, the merged model's logits equal to
  base + adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hpctrain.data import format as fmt
from hpctrain.data import sft
from runkit import make_run
from test_data_sft import CHATML, _chat_tokenizer

U = {"role": "user", "content": "Hi there"}
A = {"role": "assistant", "content": "Hello!"}
TOOL_CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _chat_tokenizer(tmp_path_factory.mktemp("qa-tok") / "chat", CHATML)


def _renderer(tok_dir: Path) -> tuple[sft.Renderer, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    enc = sft.Encoding(lambda t: tok.encode(t, add_special_tokens=False), tok.bos_token_id, tok.eos_token_id, tok)
    return sft.Renderer("chat", enc, 256), tok


def _trained(r: sft.Renderer, tok: Any, msgs: list[dict[str, Any]]) -> tuple[str, str]:
    """(the trained text, the rest), decoded."""
    ids, mask, _ = r.render({"messages": msgs})
    return tok.decode(ids[mask]), tok.decode(ids[~mask])


def test_a_conversation_opening_with_the_assistant_trains_its_reply_not_its_header(tok_dir: Path) -> None:
    r, tok = _renderer(tok_dir)
    trained, rest = _trained(r, tok, [A, U, {"role": "assistant", "content": "Bye."}])
    assert trained == "Hello!<|im_end|>Bye.<|im_end|>"  # before: "<|im_start|>assistant\nHello!..." was trained
    assert rest.count("assistant") == 2 and "Hi there" in rest


def test_consecutive_assistant_turns_are_each_trained_with_their_end_of_turn(tok_dir: Path) -> None:
    r, tok = _renderer(tok_dir)
    ids, mask, _ = r.render({"messages": [U, A, {"role": "assistant", "content": "And more."}]})
    assert tok.decode(ids[mask]) == "Hello!<|im_end|>And more.<|im_end|>"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = np.flatnonzero(ids == end)
    assert mask[ends[1:]].all() and not mask[ends[0]]  # the user's end-of-turn is prompt; each reply's is trained
    assert len(np.flatnonzero(np.diff(mask.astype(int)) == 1)) == 2  # two spans: the second header is not trained


HOSTILE: list[tuple[str | None, Any]] = [
    (None, {"messages": [U, A]}),
    ("no_assistant", {"messages": [{"role": "system", "content": "Be brief."}]}),
    ("unknown_role", {"messages": [{"role": "User", "content": "x"}, A]}),
    ("unknown_role", {"messages": [{"role": 3, "content": "x"}, A]}),
    ("not_string", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, A]}),
    ("not_string", {"messages": [U, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                                 {"role": "tool", "content": "1"}, A]}),
    ("not_string", {"messages": [U, {"role": "assistant", "content": 42}]}),
    ("empty_response", {"messages": [U, {"role": "assistant", "content": "\t \n"}]}),
    ("empty_response", {"messages": [U, A, U, {"role": "assistant", "content": ""}]}),
    ("missing_field", {"conversations": [U, A]}),
    ("missing_field", {"messages": []}),
    ("missing_field", {"messages": {"role": "user", "content": "x"}}),
    ("bad_message", {"messages": [U, {"role": "assistant", "text": "x"}]}),
    ("not_object", '"a string"'),
    ("not_json", "{'messages': []}"),
    ("overlong", {"messages": [{"role": "user", "content": "word " * 300}, A]}),
    (None, {"messages": [A, U, A]}),
    (None, {"messages": [U, A, {"role": "assistant", "content": "More."}]}),
]


def _hostile_file(path: Path) -> Path:
    """HOSTILE as jsonl with a BOM, CRLF line ends and blank lines (none of which is a record)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for _, r in HOSTILE]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(lines).encode() + b"\r\n   \r\n")
    return path


def test_hostile_chat_records_are_counted_alike_raw_and_prepared(tok_dir: Path, tmp_path: Path) -> None:
    from hpctrain.data.prepare import Options, prepare
    from hpctrain.node.data.loader import sft_docs
    from hpctrain.node.data.tokenize import load_tokenizer
    from hpctrain.node.runconf import read_spec
    from hpctrain.runs.folder import RunFolder

    data = _hostile_file(tmp_path / "hostile.jsonl")
    want: dict[str, int] = {}
    for reason, _ in HOSTILE:
        if reason:
            want[reason] = want.get(reason, 0) + 1
    good = sum(1 for reason, _ in HOSTILE if reason is None)
    spec = read_spec(RunFolder(make_run(tmp_path / "run", data={"source": str(data), "format": "chat",
                                                                 "tokenizer": str(tok_dir), "seq_len": 128,
                                                                 "pack": True})))
    docs, raw = sft_docs(spec.data, load_tokenizer(str(tok_dir)))
    assert raw["records"] == len(HOSTILE) and raw["kept"] == good == len(docs) and raw["bad"] == want
    lines: list[str] = []
    out = tmp_path / "prep"
    prepare([str(data)], str(tok_dir), out, Options(format="chat", seq_len=128, val_fraction=0.0), workers=1,
            progress=False, echo=lines.append)
    prepared = fmt.read_manifest(out).records
    assert {k: prepared[k] for k in ("records", "kept", "bad")} == {k: raw[k] for k in ("records", "kept", "bad")}
    assert prepared["first"] == raw["first"]  # the same file:line and why for each reason
    # The reasons say what to do with the OpenAI shapes a user most likely has.
    assert "content parts" in raw["first"]["not_string"]
    assert raw["first"]["no_assistant"].startswith(f"{data}:3: ")  # the file's own line (CRLF, blank lines between)
    table = "\n".join(lines)
    assert all(reason in table for reason in want), table
    # Nothing bad reaches the tokens: every kept document is one of the good records, its prompt masked.
    for doc in docs:
        assert (doc < 0).any() and (doc >= 0).any()


def test_content_parts_and_tool_calls_say_why(tok_dir: Path) -> None:
    r, _ = _renderer(tok_dir)
    for i, (reason, rec) in enumerate(HOSTILE):
        if reason != "not_string":
            continue
        with pytest.raises(sft.Bad) as bad:
            r.render(rec)
        assert bad.value.reason == "not_string", i
    with pytest.raises(sft.Bad, match="tool_calls and no content string"):
        r.render(HOSTILE[5][1])
    with pytest.raises(sft.Bad, match=r"OpenAI content parts.*join its text parts"):
        r.render(HOSTILE[4][1])


# ------------------------------------------------------------------------------------------ LoRA per family
LORA_FAMILIES = ("gpt2", "gpt_neox", "phi", "falcon", "gemma", "granite", "mixtral", "qwen2_moe")


@pytest.mark.parametrize("name", LORA_FAMILIES)
def test_lora_default_targets_adapt_every_family_and_merge_exactly(name: str, tmp_path: Path) -> None:
    """hpctrain's wrap (PEFT "all-linear") on a saved folder of the family: adapters on its linear layers
    (Conv1D for GPT-2, fused query_key_value for GPT-NeoX/Falcon), none on the head (tied or not), a gradient
    reaching every adapter, and merge_and_unload giving base + adapter's logits."""
    pytest.importorskip("peft")
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from familykit import make_folder
    from hpctrain.node.model import lora

    folder = make_folder(tmp_path, name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    spec = SimpleNamespace(lora=SimpleNamespace(r=4, alpha=0, dropout=0.0, target_modules=(), quantize="none"),
                           train=SimpleNamespace(seed=0))
    peft_model = lora.wrap(model, spec, checkpointing=False)
    adapters = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert not any("lm_head" in n or "embed_out" in n for n in adapters)
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    b_grads = [p.grad for n, p in adapters.items() if ".lora_B." in n]
    assert b_grads and all(g is not None and g.abs().sum() > 0 for g in b_grads)
    with torch.no_grad():
        for p in adapters.values():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        adapted = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()(input_ids=ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4), float((adapted - merged).abs().max())


# ------------------------------------------------------------------------------------------ the newcomer
def _data(fmt_: str, **kw: Any) -> Any:
    from hpctrain.spec.model import Data

    return Data(source="unused", format=fmt_, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("records", "fmt_", "field", "fix"), [
    ([{"messages": [U, A]}], "jsonl", "data.format = 'jsonl'", 'format = "chat"'),
    ([{"instruction": "x", "input": "", "output": "y"}], "jsonl", "data.format = 'jsonl'", 'format = "alpaca"'),
    ([{"instruction": "x", "output": "y"}], "chat", "data.format = 'chat'", 'format = "alpaca"'),
    ([{"conversations": [U, A]}], "alpaca", "data.format = 'alpaca'", "[data] text_field"),
    ([{"content": "some text"}], "jsonl", "data.text_field = 'text'", "one of: content"),
    ([{"chat": [U, A]}], "chat", "data.format = 'chat'", "[data] text_field"),
], ids=["chat-as-jsonl", "alpaca-as-jsonl", "alpaca-as-chat", "unknown-as-alpaca", "text-field", "chat-field"])
def test_submit_refuses_records_the_format_cannot_read(tmp_path: Path, records: list[Any], fmt_: str, field: str,
                                                       fix: str) -> None:
    """Before any allocation (on the node every rank failed after it), naming the field, value and the format
    the records fit."""
    from hpctrain.data.source import submit_source
    from hpctrain.errors import HpcUsageError

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records * 3))
    with pytest.raises(HpcUsageError) as err:
        submit_source(str(path), str(tmp_path), "text", 512, 1, data=_data(fmt_))  # a tokenizer folder: chat's
    assert str(err.value).startswith(field) and "Fix: " in str(err.value) and fix in str(err.value), str(err.value)


def test_submit_leaves_a_stray_bad_record_to_the_node(tmp_path: Path) -> None:
    from hpctrain.data.source import submit_source

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbfnot json\r\n{"oops": 1}\r\n{"instruction": "x", "output": "y"}\r\n')
    assert submit_source(str(path), "byte", "text", 512, 1, data=_data("alpaca")) == (str(path), "")


def test_the_raw_text_reader_takes_a_bom_and_crlf_as_prepare_does(tmp_path: Path) -> None:
    from hpctrain.node.data.loader import read_texts

    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "hello"}\r\n\r\n{"text": "world"}\r\n')
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfhello\r\nworld\n")
    assert read_texts(str(tmp_path / "a.jsonl"), "jsonl", "text") == ["hello", "world"]  # was: line 1 not JSON
    assert read_texts(str(tmp_path / "b.txt"), "text", "text") == ["hello", "world"]


def test_a_model_path_that_is_not_there_says_how_to_get_one(tmp_path: Path) -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.plan.planner import load_model_config
    from hpctrain.spec.model import Model

    with pytest.raises(HpcUsageError) as err:
        load_model_config(Model(path=str(tmp_path / "Llama-3.1-8B-Instruct"), config=""))
    text = str(err.value)
    assert text.startswith("model.path = ") and "save_pretrained" in text and "--model DIR" in text
    assert "presets" not in text  # presets are [model] config's, not a folder's


def test_a_model_that_needs_remote_code_is_refused_before_the_process_group(tmp_path: Path) -> None:
    """InternLM2-shaped: a model_type transformers does not know and an auto_map naming the folder's own code.
    It was a ValueError traceback from AutoConfig on every rank; now the rank's input check names the fix."""
    from types import SimpleNamespace

    from hpctrain.node.model.build import hf_config
    from hpctrain.node.runconf import NodeInputError

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "hidden_size": 64,
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                     "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}}))
    with pytest.raises(NodeInputError, match=r"model_type 'internlm2' .*trust_remote_code.*Fix: .*--script"):
        hf_config(SimpleNamespace(path=str(tmp_path), config="", overrides={}, freeze=()))


# ------------------------------------------------------------------------------------------ the planner
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_the_planner_counts_every_expert_of_a_moe_model(name: str, tmp_path: Path) -> None:
    """Memory holds every expert: the plan's parameter count is the model's own (was the dense count, 40%)."""
    from transformers import AutoModelForCausalLM

    from familykit import make_folder
    from hpctrain.plan.planner import model_arch, param_count

    folder = make_folder(tmp_path, name)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    assert param_count(model_arch(json.loads((folder / "config.json").read_text()))) == real


def test_a_mixtral_8x7b_config_plans_as_46_7b() -> None:
    from hpctrain.plan.planner import model_arch, param_count

    cfg = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2, "max_position_embeddings": 32768}
    assert param_count(model_arch(cfg)) == 46_702_792_704  # Mixtral-8x7B-v0.1's own count


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_examples_follow_the_rule_alike_raw_and_prepared(tok_dir: Path, tmp_path: Path,
                                                                  overlong: str) -> None:
    """A long response is cut to seq_len (truncate: counted as truncated, its prompt whole) or dropped (drop:
    counted as overlong); a prompt that fills seq_len is dropped under both. The raw reader and `data prepare`
    count the same and keep the same tokens."""
    from hpctrain.data.prepare import Options, prepare
    from hpctrain.node.data.loader import sft_docs
    from hpctrain.node.data.tokenize import load_tokenizer
    from hpctrain.node.runconf import read_spec
    from hpctrain.runs.folder import RunFolder

    records = [{"messages": [U, A]}, {"messages": [U, {"role": "assistant", "content": "word " * 200}]},
               {"messages": [{"role": "user", "content": "word " * 200}, A]}]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = read_spec(RunFolder(make_run(tmp_path / "run", data={
        "source": str(data), "format": "chat", "tokenizer": str(tok_dir), "seq_len": 64, "pack": True,
        "overlong": overlong})))
    docs, raw = sft_docs(spec.data, load_tokenizer(str(tok_dir)))
    cut = overlong == "truncate"
    assert (raw["kept"], raw["truncated"], raw["bad"]) == (1 + cut, int(cut), {"overlong": 2 - cut})
    if cut:
        long_doc = max(docs, key=len)
        assert len(long_doc) == 64 and (long_doc[:8] < 0).all() and (long_doc[-8:] >= 0).all()  # prompt whole
    out = tmp_path / "prep"
    prepare([str(data)], str(tok_dir), out, Options(format="chat", seq_len=64, overlong=overlong, val_fraction=0.0),
            workers=1, progress=False, echo=lambda _: None)
    prepared = fmt.read_manifest(out).records
    assert {k: prepared[k] for k in ("records", "kept", "truncated", "bad")} == \
        {k: raw[k] for k in ("records", "kept", "truncated", "bad")}
    split = fmt.PreparedSplit(out, "train")
    assert sorted(len(split.doc(i)) for i in range(len(split))) == sorted(len(d) for d in docs)
