#!/usr/bin/env bash
# A fine-tune end to end on this machine, no GPU, no cluster, no downloads (about a minute on an idle 2-core
# machine once installed): make a tiny "pretrained" model folder and chat data (examples/scripts/
# make_tiny_finetune.py), plan and fine-tune it with the local executor (ZeRO-3; the loss on the assistant turns
# only, packed rows), then summarise the run, export a Hugging Face folder and ask it the training questions.
# Add --lora-r 8 to FLAGS for LoRA adapters on the frozen base (the export then also writes hf/adapter/; a random
# 2-layer base is too weak for adapters alone to learn the answers in a minute, a real pretrained one is not).
# The same commands fine-tune a real model folder on a cluster: drop --executor local and the tiny sizes
# (docs/finetune.md; examples/finetune-lora.toml for an 8B model).
#
#   bash examples/finetune-tiny.sh [WORK_DIR]     # default: a new folder under /tmp
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"   # one ninja/python on PATH for the ranks
PY="$VENV/bin/python"
WORK=${1:-$(mktemp -d /tmp/hpctrain-finetune-tiny.XXXXXX)}
mkdir -p "$WORK"
export HPCTRAIN_RUNS_DIR=${HPCTRAIN_RUNS_DIR:-$WORK/runs}

echo "== 1. a tiny model folder (tokenizer with a chat template, 2-layer Llama) and chat data in $WORK"
"$PY" examples/scripts/make_tiny_finetune.py "$WORK"

# The flags a real fine-tune takes (--model, --data, the format), and the tiny sizes of this demo; lr 3e-3
# because a random 2-layer model must learn the answers in 120 steps (a real fine-tune keeps the default 2e-5).
FLAGS=(--model "$WORK/model" --data "$WORK/chat.jsonl" --set data.format=chat
       --steps 120 --global-batch 8 --set data.seq_len=128 --set train.lr=3e-3 --set checkpoint.every_steps=60)

echo "== 2. plan (what the run would get, and each fine-tuning default with its reason)"
hpctrain plan "${FLAGS[@]}"

echo "== 3. train on the local executor"
run=$(hpctrain submit "${FLAGS[@]}" --executor local --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[0]["run_id"])')
state=""
for _ in $(seq 1 600); do  # bounded: 10 minutes
  state=$(hpctrain status "$run" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["state"])')
  case "$state" in PENDING | RUNNING | REQUEUED | "") sleep 1 ;; *) break ;; esac
done
echo "run $run: $state"
[ "$state" = COMPLETED ] || { hpctrain summary "$run"; exit 1; }

echo "== 4. summary (tokens/s, and trained tokens/s: the assistant turns the loss covers)"
hpctrain summary "$run"

echo "== 5. export: a from_pretrained folder (weights, config, tokenizer and its chat template)"
hpctrain export "$run" --out "$WORK/export"

echo "== 6. the fine-tuned model answers the training questions"
"$PY" - "$WORK/export" <<'ASK'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
for q in ("Which animal says woof?", "What do bees make?"):
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    print(f"{q} -> {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()}")
ASK
