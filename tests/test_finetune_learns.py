"""Proof that fine-tuning learns (issue 26, item 6), on the CPU, end to end through hpctrain's own trainer.

1. Pretrain a tiny Llama here on real English text (the docstrings of Python's standard library), with a BPE
   tokenizer trained on the same text; save both with save_pretrained, `pad_token_id` set in config.json (the
   setting that used to stop a pretrained folder under ZeRO-3).
2. Fine-tune that folder with the SFT path, `[data] format = "alpaca"`, on instruction data made here whose
   responses follow a fixed pattern ("Answer: <the word for that question>."): the full model under ZeRO-3 on 2
   ranks, and LoRA adapters on 1 rank. The loss is taken on the responses only.
3. The response loss falls well below its start, and greedy generation from the exported model answers every
   question with its pattern, which the pretrained model never does.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("peft")

from datakit import build_tokenizer
from runkit import make_run, metrics, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "scripts"))
from make_tiny_finetune import docstrings  # the example's reader of real English, offline

pytestmark = pytest.mark.deepspeed

# Each question's fixed answer: the pattern the fine-tuned model must follow.
QA = {"What colour is the sky on a clear day?": "blue", "Which animal says woof?": "dog",
      "What is frozen water called?": "ice", "Which star warms the Earth?": "sun",
      "What do bees make?": "honey", "What is the opposite of night?": "day"}
TEMPLATE = "Answer: {}."
SEQ = 96  # pretraining rows
FT_SEQ = 256  # fine-tuning rows: the alpaca prompt alone is ~95 tokens of this 512-id tokenizer


def pretrain(folder: Path, texts: list[str], steps: int = 400, batch: int = 16) -> Path:
    """A tiny Llama trained with a plain torch loop on `texts`, saved with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok_dir = build_tokenizer(folder, vocab_size=512, texts=texts)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.tensor([i for t in texts for i in tok(t)["input_ids"] + [tok.eos_token_id]])
    rows = ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    # One thread: this model is too small to gain from two, and OpenMP's spinning threads make a step ~20x
    # slower on a busy 2-core machine (the suite runs beside other work).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            batch_ids = rows[torch.randint(len(rows), (batch,), generator=gen)]
            loss = model(input_ids=batch_ids, labels=batch_ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(folder), safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    assert config.get("pad_token_id") is not None  # the setting under test
    return folder


def instruction_data(path: Path, n: int = 240) -> Path:
    rng = random.Random(0)
    questions = list(QA)
    with path.open("w") as fh:
        for _ in range(n):
            q = rng.choice(questions)
            fh.write(json.dumps({"instruction": q, "input": "", "output": TEMPLATE.format(QA[q])}) + "\n")
    return path


def answers(model_dir: Path, tokenizer_dir: Path) -> dict[str, str]:
    """Greedy answers of the model in `model_dir` to every question, in the alpaca prompt format."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpctrain.data.sft import PROMPT_NO_INPUT

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = {}
    for q in QA:
        # The trainer's own rendering: bos (when the tokenizer has one), then the no-input alpaca prompt.
        head = [tok.bos_token_id] if tok.bos_token_id is not None else []
        prompt = PROMPT_NO_INPUT.format(instruction=q)
        ids = torch.tensor([head + tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        out[q] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("learns")
    folder = pretrain(root / "base", docstrings(150_000))
    return folder, instruction_data(root / "sft.jsonl")


def _finetune(run: Path, base: Path, data: Path, *, ranks: int, **sections: Any) -> list[dict[str, Any]]:
    make_run(run, model={"config": "", "path": str(base)},
             data={"source": str(data), "format": "alpaca", "tokenizer": str(base), "seq_len": FT_SEQ, "pack": True},
             checkpoint={"every_steps": 0, "export_hf": True}, **sections)
    proc = torchrun(run, ranks, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Every example trained whole: none dropped or cut (the prompt must fit seq_len with its response).
    data = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e.get("event") == "data"]
    assert data and all(e["kept"] == e["records"] and not e["truncated"] and not e["bad"] for e in data), data
    return [m for m in metrics(run) if "loss" in m]


def _check_learned(rows: list[dict[str, Any]], model_dir: Path, base: Path) -> None:
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.25 * first, (first, last)
    got = answers(model_dir, base)
    assert all(got[q].strip().startswith(TEMPLATE.format(a)) for q, a in QA.items()), (got, first, last)


def test_the_pretrained_model_does_not_follow_the_pattern(pretrained: tuple[Path, Path]) -> None:
    base, _ = pretrained
    got = answers(base, base)
    assert not any(got[q].strip().startswith(TEMPLATE.format(a)) for q, a in QA.items()), got


def test_a_full_fine_tune_under_zero3_learns_the_responses(pretrained: tuple[Path, Path], tmp_path: Path) -> None:
    base, data = pretrained
    rows = _finetune(tmp_path / "full", base, data, ranks=2, parallel={"zero": 3},
                     train={"steps": 60, "micro_batch": 4, "grad_accum": 1, "lr": 2e-3, "min_lr": 2e-4,
                            "warmup_steps": 3, "precision": "fp32", "seed": 7})
    _check_learned(rows, tmp_path / "full" / "hf", base)


def test_lora_adapters_learn_the_responses(pretrained: tuple[Path, Path], tmp_path: Path) -> None:
    base, data = pretrained
    rows = _finetune(tmp_path / "lora", base, data, ranks=1, parallel={"zero": 2}, lora={"r": 16},
                     train={"steps": 80, "micro_batch": 8, "grad_accum": 1, "lr": 1e-2, "min_lr": 1e-3,
                            "warmup_steps": 3, "precision": "fp32", "seed": 7})
    _check_learned(rows, tmp_path / "lora" / "hf", base)
