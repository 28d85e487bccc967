"""A tiny "pretrained" model folder and instruction data, made here, for examples/finetune-tiny.sh.

Everything is made offline from what every machine has: a byte-level BPE tokenizer (the `tokenizers` library)
trained on the docstrings of Python's standard library, with a chat template; a 2-layer Llama of ~0.3 M
parameters saved with save_pretrained (safetensors, `pad_token_id` set, as real checkpoints do); and instruction
data whose answers follow a fixed pattern, in both SFT formats hpctrain reads:

    OUT/model/        config.json, model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja
    OUT/alpaca.jsonl  {"instruction": ..., "input": "", "output": "Answer: blue."}
    OUT/chat.jsonl    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}

    python examples/scripts/make_tiny_finetune.py OUT
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

QA = {"What colour is the sky on a clear day?": "blue", "Which animal says woof?": "dog",
      "What is frozen water called?": "ice", "Which star warms the Earth?": "sun",
      "What do bees make?": "honey", "What is the opposite of night?": "day"}
ANSWER = "Answer: {}."
# A minimal chat template (Jinja, as tokenizer_config.json / chat_template.jinja hold it): hpctrain renders chat
# records with the tokenizer's own template and takes the loss on the assistant turns only.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '</s>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def docstrings(limit_chars: int = 120_000) -> list[str]:
    """Module, class and function docstrings of the standard library: English prose, offline."""
    out: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    out.append(" ".join(doc.split()))
                    total += len(out[-1])
        if total > limit_chars:
            break
    return out


def tokenizer(folder: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def model(folder: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(folder))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)


def data(out: Path, n: int = 240) -> None:
    rng = random.Random(0)
    questions = list(QA)
    with (out / "alpaca.jsonl").open("w") as alpaca, (out / "chat.jsonl").open("w") as chat:
        for _ in range(n):
            q = rng.choice(questions)
            a = ANSWER.format(QA[q])
            alpaca.write(json.dumps({"instruction": q, "input": "", "output": a}) + "\n")
            chat.write(json.dumps({"messages": [{"role": "user", "content": q},
                                                {"role": "assistant", "content": a}]}) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    folder = out / "model"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer(folder, docstrings())
    model(folder)
    data(out)
    print(f"made {folder} (tokenizer with a chat template, a 2-layer Llama) and {out}/alpaca.jsonl, chat.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
