"""Issue 26 audited as a hostile user and a newcomer would drive it, without a DeepSpeed launch:

- `hpctrain export --out` names a folder the export replaces whole: the base model's folder, one that holds it or
  the run, or any folder that is not an earlier export is refused and left as it was; `--tag` naming no
  checkpoint (or a path) lists the ones there are;
- the export carries the chat template: transformers 5 saves it as chat_template.jinja, beside the tokenizer files;
- a list key takes the run file's own TOML array on the command line (`--set 'lora.target_modules=["q_proj"]'`),
  the form every refusal of that key shows as its fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner

from hpctrain.cli.main import cli
from runkit import make_run
from test_data_sft import CHATML, CONVERSATION, _chat_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder as save_pretrained writes it, with a chat tokenizer (its template in
    chat_template.jinja), under a path with a space and a non-ASCII letter."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = _chat_tokenizer(tmp_path_factory.mktemp("audit") / "my models" / "bäse", CHATML)
    vocab = len(AutoTokenizer.from_pretrained(str(folder)))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    assert (folder / "chat_template.jinja").is_file()  # transformers 5 keeps it out of tokenizer_config.json
    return folder


def _run(tmp_path: Path, base: Path) -> Path:
    return make_run(tmp_path / "run", model={"config": "", "path": str(base)},
                    data={"source": "synthetic", "tokenizer": str(base)})


def _export(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["export", *args])
    return res.exit_code, res.output


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_never_replaces_a_folder_that_is_not_an_export(tmp_path: Path, base: Path) -> None:
    run = _run(tmp_path, base)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine\n")
    before = {f: _files(f) for f in (base, other)}
    for out, why in [(base, "which this run reads"), (base.parent, "which this run reads"),
                     (tmp_path, "holds the run folder"), (other, "not an earlier export (it holds todo.txt")]:
        code, text = _export(str(run), "--out", str(out))
        assert code == 2 and why in text and "Fix: pass --out a new or empty folder" in text, text
        assert "Traceback" not in text
    assert {f: _files(f) for f in (base, other)} == before  # nothing was touched
    # a folder an earlier export wrote, or an empty one, is past this check: the run has no checkpoint yet
    (tmp_path / "empty").mkdir()
    code, text = _export(str(run), "--out", str(tmp_path / "empty"))
    assert code == 2 and "no complete checkpoint to export: the run has written none (" in text, text
    assert f"on the time-limit signal and at its end). Fix: `hpctrain status {run.name}` shows how it ended" in text


def test_export_tag_that_names_no_checkpoint_lists_the_ones_there_are(tmp_path: Path, base: Path) -> None:
    run = _run(tmp_path, base)
    for step in (2, 4):  # complete checkpoints as the runs' module sees them: a folder with a marker
        folder = run / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / "hpctrain.json").write_text(f'{{"step": {step}, "complete": true}}\n')
    from hpctrain.runs.checkpoints import complete_steps

    listed = ", ".join(f"step-{n}" for n in complete_steps(run / "checkpoints"))
    for tag in ("step-99", "..", "../checkpoints/step-2"):
        code, text = _export(str(run), "--tag", tag)
        assert code == 2 and f"--tag {tag}: no such checkpoint" in text, text
        assert f"Fix: pass one of {listed}" in text if listed else "Train first" in text
        assert "delete" not in text  # never advice to delete the run folder (the old message for "..")
    assert run.is_dir() and (run / "spec.toml").is_file()


def test_the_export_keeps_the_chat_template(tmp_path: Path, base: Path) -> None:
    """write_hf (the end-of-run export and `hpctrain export`) from the base's own weights: the folder's tokenizer
    renders a conversation exactly as the model folder's does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpctrain.node.checkpointing.export import write_hf
    from hpctrain.node.model.build import hf_config
    from hpctrain.node.runconf import read_spec
    from hpctrain.runs.folder import RunFolder

    paths = RunFolder(_run(tmp_path, base))
    spec = read_spec(paths)
    sd = {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(str(base)).state_dict().items()}
    out = write_hf(paths, spec, hf_config(spec.model), sd, "step-1", 1)
    want = AutoTokenizer.from_pretrained(str(base)).apply_chat_template(CONVERSATION, tokenize=False)
    got = AutoTokenizer.from_pretrained(str(out)).apply_chat_template(CONVERSATION, tokenize=False)
    assert got == want and "<|im_start|>assistant" in got


@pytest.mark.parametrize(("value", "want"), [('["q_proj", "v_proj"]', ("q_proj", "v_proj")),
                                             ("q_proj,v_proj", ("q_proj", "v_proj")), ("[]", ())])
def test_set_takes_a_list_as_the_run_file_writes_it(base: Path, value: str, want: tuple[str, ...]) -> None:
    import hpctrain

    plan = hpctrain.plan({"model": {"path": str(base)}, "lora": {"r": 4}, "data": {"source": "synthetic"},
                          "resources": {"gpus_per_node": 0}}, set={"lora.target_modules": value})
    where = ", ".join(want) if want else "every linear layer but the output head"
    assert any(f"LoRA r=4 on {where}" in r for r in plan.reasons), plan.reasons


@pytest.mark.parametrize("value", ["[1, 2]", '["q_proj"', "[q_proj]"])
def test_set_refuses_a_list_it_cannot_read(value: str) -> None:
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import coerce

    with pytest.raises(HpcUsageError, match=r"^lora.target_modules = .*must be a list of strings"):
        coerce("lora.target_modules", value)


# ------------------------------------------------------------------------------------------ --lora-r, QLoRA
def _plan_json(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["plan", *args, "--json"])
    return res.exit_code, res.output


def test_lora_r_flag_turns_adapters_on_and_off_over_the_run_file(tmp_path: Path, base: Path) -> None:
    import json

    runfile = tmp_path / "lora run.toml"
    runfile.write_text(f'[model]\npath = "{base}"\n[lora]\nr = 16\n[data]\nsource = "synthetic"\n'
                       "[resources]\ngpus_per_node = 0\n")
    adapters = {}
    for r in (16, 4, 0):
        code, out = _plan_json(str(runfile), "--lora-r", str(r))
        assert code == 0, out
        plan = json.loads(out)
        adapters[r] = plan["memory"].get("lora_params")
        lr = {d["key"]: d["value"] for d in plan["defaults"]}["train.lr"]
        assert lr == (2e-4 if r else 2e-5)  # the adapters' default, or a full fine-tune's
    assert adapters[16] == 4 * adapters[4] and adapters[4] > 0 and not adapters[0]
    code, out = _plan_json(str(runfile), "--lora-r", "-1")
    assert code == 2 and "lora.r = -1: must lie in [0, 4096] (0 = off)" in out and "Fix: pass --lora-r 16" in out


def test_qlora_on_a_node_without_bitsandbytes_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    pytest.importorskip("deepspeed")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as on a node without it: its import fails
    from hpctrain.node.model.lora import load_quantized
    from hpctrain.node.runconf import NodeInputError

    with pytest.raises(NodeInputError, match=r'bitsandbytes is not installed on this node. Fix: install '
                                             r'hpctrain\[qlora\] in the image, or set \[lora\] quantize = "none"'):
        load_quantized(SimpleNamespace(path="/nonexistent"), None, "bf16")


# -------------------------------------------------------------------------------------------- trackers
def test_trackers_get_the_trained_tokens_per_second(tmp_path: Path) -> None:
    """An SFT run's metrics lines carry trained_tokens_per_s (the responses) beside tokens_per_s: `hpctrain sync`
    (the same step events the live trackers write, hpctrain.runs.tracking.step_events) puts both in TensorBoard."""
    import json

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpctrain.runs.folder import RunFolder

    folder = RunFolder(make_run(tmp_path / "sft-20261203-120000-abcd"))
    lines = [{"step": s, "loss": 3.0, "lr": 1e-4, "tokens_per_s": 1000.0 + s, "trained_tokens_per_s": 200.0 + s}
             for s in (1, 2, 3)]
    folder.metrics_dir.mkdir(parents=True, exist_ok=True)
    folder.metrics_jsonl.write_text("".join(json.dumps(r) + "\n" for r in lines))
    folder.events_jsonl.write_text(json.dumps({"kind": "train", "time": 1.0, "rank": 0, "event": "start",
                                               "step": 0}) + "\n")
    res = CliRunner().invoke(cli, ["sync", str(folder.path), "--to", "tensorboard"])
    assert res.exit_code == 0, res.output
    acc = EventAccumulator(str(folder.tensorboard_dir), size_guidance={"scalars": 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
           for tag in ("train/tokens_per_s", "train/trained_tokens_per_s")}
    assert got == {"train/tokens_per_s": [(1, 1001.0), (2, 1002.0), (3, 1003.0)],
                   "train/trained_tokens_per_s": [(1, 201.0), (2, 202.0), (3, 203.0)]}


# --------------------------------------------------------------------------------- chat without a template
def test_submit_refuses_a_chat_run_whose_tokenizer_has_no_template(tmp_path: Path, base: Path) -> None:
    """Before any allocation (the node refused it only once the job had waited in the queue); a template in
    chat_template.jinja or in tokenizer_config.json passes; a prepared chat folder needs none."""
    import json
    import shutil

    from hpctrain.data.source import submit_source
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import Data

    plain = tmp_path / "plain tok"
    shutil.copytree(base, plain)
    (plain / "chat_template.jinja").unlink()
    raw = tmp_path / "chat.jsonl"
    raw.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    data = Data(source=str(raw), format="chat", seq_len=64)
    with pytest.raises(HpcUsageError, match=r"^data.tokenizer = .*plain tok': has no chat_template .* Fix: set "
                                            r"\[data\] tokenizer to the instruct model's tokenizer folder"):
        submit_source(str(raw), str(plain), "text", 512, 1, data=data)
    assert submit_source(str(raw), str(base), "text", 512, 1, data=data) == (str(raw), "")  # chat_template.jinja
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHATML}))
    assert submit_source(str(raw), str(plain), "text", 512, 1, data=data) == (str(raw), "")

    # the newcomer's command: `hpctrain submit --dry-run` stops with it, exit 2, and writes nothing
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    runfile = tmp_path / "chat.toml"
    runfile.write_text(f'[model]\npath = "{base}"\n[data]\nsource = "{raw}"\nformat = "chat"\nseq_len = 64\n'
                       f'tokenizer = "{plain}"\n[resources]\ngpus_per_node = 0\n')
    res = CliRunner().invoke(cli, ["submit", str(runfile), "--dry-run", "--out", str(tmp_path / "dry")])
    assert res.exit_code == 2 and "has no chat_template" in res.output and not (tmp_path / "dry").exists()


@pytest.mark.parametrize("text", ["", "\n\n", "\ufeff\r\n  \r\n"], ids=["empty", "blank", "bom-crlf"])
def test_submit_refuses_a_records_file_without_a_record(tmp_path: Path, base: Path, text: str) -> None:
    """Every rank would read it and stop with "no records found" after the allocation."""
    from hpctrain.data.source import submit_source
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import Data

    raw = tmp_path / "my data.jsonl"
    raw.write_text(text, encoding="utf-8")
    for fmt_ in ("chat", "alpaca", "jsonl"):
        with pytest.raises(HpcUsageError, match=r"^data.source = .*my data.jsonl': holds no records .* Fix: point "):
            submit_source(str(raw), str(base) if fmt_ == "chat" else "byte", "text", 512, 1,
                          data=Data(source=str(raw), format=fmt_))  # type: ignore[arg-type]


def test_prepare_of_an_empty_records_file_names_the_format_not_the_text_field(tmp_path: Path, base: Path) -> None:
    raw = tmp_path / "empty.jsonl"
    raw.write_text("\n")
    res = CliRunner().invoke(cli, ["data", "prepare", str(raw), "--format", "chat", "--seq-len", "64",
                                   "--tokenizer", str(base), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "no records (for the training split)" in res.output, res.output
    assert "check --format chat" in res.output and "--text-field" not in res.output


def test_the_api_tells_the_fine_tuning_defaults_as_the_cli_prints_them(tmp_path: Path, base: Path) -> None:
    import hpctrain

    source = {"model": {"path": str(base)}, "data": {"source": "synthetic"}, "resources": {"gpus_per_node": 0}}
    run = hpctrain.submit(source, dry_run=True, lora_r=8, out=tmp_path / "dry")
    res = CliRunner().invoke(cli, ["submit", "--model", str(base), "--data", "synthetic", "--gpus-per-node", "0",
                                   "--lora-r", "8", "--dry-run"])
    assert res.exit_code == 0, res.output
    printed = [line.removeprefix("hpctrain: ") for line in res.stderr.splitlines() if line.startswith("hpctrain: ")]
    assert printed and run.notes[:len(printed)] == printed
    assert any(n.startswith("train.lr = 0.0002 (fine-tuning default for LoRA adapters") for n in run.notes)


def test_export_after_the_model_folder_moved_names_it(tmp_path: Path, base: Path) -> None:
    """It was transformers' traceback: "Repo id must be in the form 'repo_name'..." for the missing path."""
    import shutil

    moved = tmp_path / "base copy"
    shutil.copytree(base, moved)
    run = make_run(tmp_path / "run", model={"config": "", "path": str(moved)}, lora={"r": 4},
                   data={"source": "synthetic", "tokenizer": str(moved)})
    shutil.rmtree(moved)
    code, text = _export(str(run))
    assert code == 2 and "Traceback" not in text, text
    assert f"[model] path = '{moved}': no config.json there, and the export reads the model's config and the " \
           "frozen base the adapters merge into from it. Fix: put the model folder back" in text


def test_submit_refuses_a_model_folder_without_weights(tmp_path: Path, base: Path) -> None:
    """config.json and the tokenizer but no weights (a partial download): every rank failed after the allocation."""
    import shutil

    partial = tmp_path / "partial download"
    shutil.copytree(base, partial, ignore=shutil.ignore_patterns("*.safetensors"))
    res = CliRunner().invoke(cli, ["submit", "--model", str(partial), "--data", "synthetic", "--gpus-per-node", "0",
                                   "--dry-run"])
    assert res.exit_code == 2 and f"model.path = '{partial}': holds a config.json but no weights" in res.output
    assert "Fix: download the whole model folder" in res.output
    (partial / "pytorch_model.bin").write_bytes(b"")  # ZeRO 0-2 read .bin through from_pretrained
    res = CliRunner().invoke(cli, ["submit", "--model", str(partial), "--data", "synthetic", "--gpus-per-node", "0",
                                   "--dry-run"])
    assert res.exit_code == 0, res.output


def test_the_tokenizer_hash_reads_no_model_weights(tmp_path: Path, base: Path) -> None:
    """The tokenizer of a fine-tune is the model folder: its hash (the data cache's key, at every submit of raw
    data and every prepare) covers the tokenizer files, not the weights beside them, which it read whole."""
    import shutil

    from hpctrain.data.tokenizer import folder_hash

    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    before = folder_hash(folder)
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"\0" * 1024)
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert folder_hash(folder) == before
    (folder / "chat_template.jinja").write_text("{{ messages }}")  # a tokenizer file: another tokenizer
    assert folder_hash(folder) != before


def test_a_fine_tune_refuses_data_prepared_with_another_kind_of_tokenizer(tmp_path: Path, base: Path) -> None:
    """Alpaca prepared with the byte tokenizer, then fine-tuned on a model with its own: the vocabulary check
    passed (259 ids < the model's) and the model trained on byte ids, silently. Another tokenizer folder warns."""
    import json
    import re
    import shutil

    from hpctrain.data.prepare import Options, prepare
    from hpctrain.data.source import submit_source
    from hpctrain.errors import HpcUsageError
    from hpctrain.spec.model import Data

    raw = tmp_path / "alpaca.jsonl"
    raw.write_text("".join(json.dumps({"instruction": f"Add one to {i}", "output": str(i + 1)}) + "\n"
                           for i in range(8)))
    other = tmp_path / "other tok"
    shutil.copytree(base, other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / "chat_template.jinja").write_text("{{ messages }}")
    data = Data(source="", format="alpaca", seq_len=256)
    made = {}
    for name, tok in (("byte", "byte"), ("model", str(base))):
        made[name] = tmp_path / f"prepared {name}"
        prepare([str(raw)], tok, made[name], Options(format="alpaca", seq_len=256), workers=1, progress=False,
                echo=lambda _: None)
    with pytest.raises(HpcUsageError, match=r"prepared with the tokenizer 'byte', and this fine-tune's \[data\] "
                                            r"tokenizer is .*: the pretrained model would train on another "):
        submit_source(str(made["byte"]), str(base), "text", 302, 1, data=data, finetune=True)
    with pytest.raises(HpcUsageError, match=re.escape(f"prepared with the tokenizer '{base}', and this fine-tune's "
                                                      "[data] tokenizer is 'byte'")):
        submit_source(str(made["model"]), "byte", "text", 302, 1, data=data, finetune=True)
    assert submit_source(str(made["model"]), str(base), "text", 302, 1, data=data, finetune=True) == \
        (str(made["model"]), "")
    _, note = submit_source(str(made["model"]), str(other), "text", 302, 1, data=data, finetune=True)
    assert note.startswith("WARNING: data.source") and "whose files differ from [data] tokenizer" in note
    # pretraining from a prepared folder is not a fine-tune: its tokenizer setting does not decide the ids
    assert submit_source(str(made["model"]), "byte", "text", 302, 1, data=data) == (str(made["model"]), "")


def test_a_seq_len_past_learned_positions_is_refused_at_plan(tmp_path: Path) -> None:
    """GPT-2's positions are a table: one token past it fails every rank's first forward (IndexError on the CPU,
    a device assert on GPUs); the plan refused nothing. RoPE families only extrapolate and stay allowed."""
    from transformers import AutoModelForCausalLM

    import hpctrain
    from familykit import make_folder
    from hpctrain.errors import HpcUsageError

    folder = make_folder(tmp_path, "gpt2")
    positions = AutoModelForCausalLM.from_pretrained(str(folder)).config.n_positions
    with pytest.raises(IndexError):  # what the node would meet
        AutoModelForCausalLM.from_pretrained(str(folder))(input_ids=torch.zeros(1, positions + 1, dtype=torch.long))
    source = {"model": {"path": str(folder)}, "data": {"source": "synthetic"}, "resources": {"gpus_per_node": 0}}
    with pytest.raises(HpcUsageError, match=rf"^data.seq_len = {2 * positions}: longer than the model's {positions} "
                                            rf"learned positions .* Fix: set \[data\] seq_len = {positions}"):
        hpctrain.plan(source, **{"data.seq_len": 2 * positions})
    assert hpctrain.plan(source, **{"data.seq_len": positions}).world_size == 1
    llama = make_folder(tmp_path, "llama3")
    assert hpctrain.plan({**source, "model": {"path": str(llama)}}, **{"data.seq_len": 4 * positions}).world_size


# ------------------------------------------------------------------------------------- a JSON array of records
def test_a_json_array_of_alpaca_records_trains_as_its_jsonl_does(tmp_path: Path) -> None:
    """Stanford Alpaca ships alpaca_data.json, one JSON array: prepare read it line by line ("none of its 258
    records can be trained on ... not_json") and the node's raw reader as well. Now each item is a record, in
    both paths: the same ids and masks as the same records written as JSON Lines, and the same counts."""
    import json

    import numpy as np

    from hpctrain.data import format as fmt
    from hpctrain.data.prepare import Options, prepare
    from hpctrain.node.data.loader import sft_docs
    from hpctrain.node.data.tokenize import load_tokenizer
    from hpctrain.node.runconf import read_spec
    from hpctrain.runs.folder import RunFolder

    recs: list[object] = [{"instruction": f"Add one to {i}", "output": str(i + 1)} for i in range(6)]
    recs += [{"instruction": "no output"}, ["not", "an", "object"]]
    array, lines = tmp_path / "alpaca_data.json", tmp_path / "alpaca.jsonl"
    array.write_text("\ufeff" + json.dumps(recs, indent=4), encoding="utf-8")  # with a BOM, as editors save it
    lines.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = {}
    for name, path in (("array", array), ("lines", lines)):
        spec = read_spec(RunFolder(make_run(tmp_path / f"run-{name}", data={
            "source": str(path), "format": "alpaca", "tokenizer": "byte", "seq_len": 256, "pack": True})))
        docs, tally = sft_docs(spec.data, load_tokenizer("byte"))
        out = tmp_path / f"prep-{name}"
        prepare([str(path)], "byte", out, Options(format="alpaca", seq_len=256, val_fraction=0.0), workers=1,
                progress=False, echo=lambda _: None)
        got[name] = (docs, tally, fmt.read_manifest(out).records)
    (a_docs, a_tally, a_prep), (l_docs, l_tally, l_prep) = got["array"], got["lines"]
    assert len(a_docs) == len(l_docs) == 6 and all(np.array_equal(a, b) for a, b in zip(a_docs, l_docs, strict=True))
    for tally in (a_tally, a_prep):
        assert (tally["records"], tally["kept"], tally["bad"]) == (8, 6, {"missing_field": 1, "not_object": 1})
    assert (l_tally["records"], l_tally["kept"]) == (l_prep["records"], l_prep["kept"]) == (8, 6)
    assert a_tally["first"]["missing_field"].startswith(f"{array} item 6: ")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"instruction": "x", "output": "y"},')
    from hpctrain.errors import HpcUsageError

    with pytest.raises(HpcUsageError, match=r"not a valid JSON array .* Fix: fix the file, or write one JSON "):
        prepare([str(broken)], "byte", tmp_path / "prep-broken", Options(format="alpaca", seq_len=256), workers=1,
                progress=False, echo=lambda _: None)


# -------------------------------------------------------------------------------------------------- epochs
def test_the_start_says_how_many_epochs_the_steps_make(tmp_path: Path) -> None:
    """hpctrain counts optimizer steps; the node's start line turns them into epochs of the run's own data (a
    fine-tune is planned in epochs). One epoch's micro-batches hold every record's tokens exactly once."""
    import json

    from hpctrain.node.data.loader import build_source, sft_docs
    from hpctrain.node.data.tokenize import load_tokenizer
    from hpctrain.node.runconf import read_spec
    from hpctrain.node.train import epochs_line
    from hpctrain.runs.folder import RunFolder

    raw = tmp_path / "alpaca.jsonl"
    raw.write_text("".join(json.dumps({"instruction": f"Add one to {i}", "output": str(i + 1)}) + "\n"
                           for i in range(40)))
    spec = read_spec(RunFolder(make_run(tmp_path / "run", data={
        "source": str(raw), "format": "alpaca", "tokenizer": "byte", "seq_len": 512, "pack": True},
        train={"steps": 30})))
    tok = load_tokenizer("byte")
    src = build_source(spec, tok, micro=spec.train.micro_batch, vocab=512)
    n = src.batches_per_epoch()
    docs, _ = sft_docs(spec.data, tok)
    assert sum(src.batch(i).tokens for i in range(n)) == sum(len(d) for d in docs)  # each record once
    per_step = 2 * spec.train.grad_accum  # dp 2 (TINY's two ranks) x gas
    assert epochs_line(n, per_step, 30) == (f"data: one epoch is {n} micro-batches = {n / per_step:.1f} optimizer "
                                            f"steps of {per_step} micro-batches; the run's 30 steps are "
                                            f"{30 * per_step / n:.2f} epochs")
    assert epochs_line(0, per_step, 30) == ""  # synthetic data has no epoch


@pytest.mark.parametrize(("value", "said"), [(5, "a number"), (1.5, "a number"), (True, "a boolean"),
                                             ({"text": "x"}, "an object")])
def test_a_field_of_the_wrong_type_is_named_in_jsons_words(value: object, said: str) -> None:
    """It said "'output' is a int" (Python's type name) for a record written in JSON."""
    from hpctrain.data import sft

    r = sft.Renderer("alpaca", sft.Encoding(lambda t: [ord(c) for c in t], 1, 2), 256)
    with pytest.raises(sft.Bad, match=f"^'output' is {said}, not a string$"):
        r.render({"instruction": "x", "output": value})
    chat = sft.Renderer("chat", sft.Encoding(lambda t: [ord(c) for c in t], 1, 2, chat=object()), 256)
    with pytest.raises(sft.Bad, match=f"message 1's content is {said}, not a string"):
        chat.render({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": value}]})


def test_a_broken_jsonl_line_says_where_in_that_line(tmp_path: Path) -> None:
    """The report names FILE:LINE; json's own words added "line 2 column 1" (the newline after the record)."""
    from hpctrain.data import sft

    with pytest.raises(sft.Bad, match=r"^Expecting ',' delimiter at character 31 of the line$"):
        sft.parse_line(b'{"messages": [{"role": "user"}\n')
    with pytest.raises(sft.Bad, match=r"^Expecting property name enclosed in double quotes at character 9 of the"):
        sft.parse_line('{"a": 1,}\r\n')


def test_lora_targets_that_name_no_module_are_refused_at_submit(tmp_path: Path, base: Path) -> None:
    """PEFT refused them on every rank after the allocation ("Target modules {...} not found"); the module names
    come from the safetensors headers (or a sharded folder's index), read without torch."""
    from familykit import make_folder

    sharded = make_folder(tmp_path, "mistral", max_shard_size="20KB")
    assert next(sharded.glob("*.safetensors.index.json"), None) is not None
    for folder in (base, sharded):
        def submit(targets: str, folder: Path = folder) -> tuple[int, str]:
            res = CliRunner().invoke(cli, ["submit", "--model", str(folder), "--data", "synthetic", "--gpus-per-node",
                                           "0", "--lora-r", "4", "--set", f"lora.target_modules={targets}",
                                           "--dry-run"])
            return res.exit_code, res.output

        code, out = submit('["qproj"]')
        assert code == 2 and "lora.target_modules = ['qproj']: none of them names a module of the model" in out, out
        assert "q_proj" in out and "Fix: set [lora] target_modules to some of those" in out
        for ok in ('["q_proj", "qproj"]', '["self_attn.v_proj"]', '["*_proj"]'):  # as PEFT matches a list
            assert submit(ok)[0] == 0, (ok, submit(ok)[1])


# ------------------------------------------------------------------------------ resume at another world size
def test_a_resubmission_at_another_world_size_is_planned_for_it(tmp_path: Path, base: Path) -> None:
    """`hpctrain resubmit RUN --nodes N --tasks-per-node M` (Run.resubmit(nodes=, tasks_per_node=)): the user's way
    to resume a run at another size, which the ranks do through a universal checkpoint (test_lora, test_node_train).
    There was none: resubmit kept the spec's size. The new size is judged by the spec's own rules."""
    from hpctrain.errors import HpcUsageError
    from hpctrain.slurm.submission import Submission

    run = make_run(tmp_path / "run", model={"config": "", "path": str(base)}, lora={"r": 4},
                   data={"source": "synthetic", "tokenizer": str(base)}, parallel={"zero": 3})
    same = Submission.resubmission(run)
    (spec, plan), = same.points
    assert (spec.resources.tasks_per_node, plan.world_size, plan.dp) == (2, 2, 2)
    one = Submission.resubmission(run, tasks_per_node=1)
    (spec1, plan1), = one.points
    assert (spec1.resources.tasks_per_node, plan1.world_size, plan1.dp) == (1, 1, 1)
    assert spec1.lora == spec.lora and spec1.train.steps == spec.train.steps  # nothing else moved
    four = Submission.resubmission(run, nodes=2)
    assert four.points[0][1].world_size == 4
    with pytest.raises(HpcUsageError, match=r"^resources.nodes = 0: "):
        Submission.resubmission(run, nodes=0)
    res = CliRunner().invoke(cli, ["resubmit", "--help"])
    assert "--nodes" in res.output and "--tasks-per-node" in res.output and "universal checkpoint" in res.output
