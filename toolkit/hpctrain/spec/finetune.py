"""Fine-tuning defaults: the layer between hpctrain's defaults and the site profile.

A run with a pretrained `[model] path` is a fine-tune, and pretraining's defaults are wrong for it: lr 3e-4
without warmup is a step size for random weights, and the "byte" tokenizer feeds a pretrained model ids it never
learned (issue 26: an 8B folder run with both had its loss rise from 12.5 to 20.7 in the first steps; which of the
two did more was not measured). So resolution merges

    defaults < fine-tuning defaults < site profile < run file < flags

where this layer sets only keys that no other layer set (a key set anywhere, even to pretraining's value,
wins). Every value it sets comes with its reason; `hpctrain plan` and `submit` print them and plan.json records
them (plan.planner). The values follow the common supervised fine-tuning recipes: lr 2e-5 for a full
fine-tune (Stanford Alpaca, TRL's SFTConfig, torchtune's full Llama 3 recipes), 2e-4 for LoRA adapters (the
QLoRA paper; TRL's examples), a 3% warmup (Alpaca's warmup_ratio 0.03) and packed examples.

Packing is also the default of the SFT data formats (`[data] format = "alpaca" | "chat"`) without a model
folder: their examples are short, and padding each to seq_len wastes most of the compute.

Pure apart from one look into the model folder (which tokenizer files it holds); no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL_LR = 2e-5  # full fine-tune: every weight moves, so small steps
LORA_LR = 2e-4  # adapters start at zero (B = 0) and are few: ten times larger steps
PRETRAIN_LR = 3e-4  # hpctrain.spec.model.Train.lr (named here for the reasons; a test keeps them equal)
WARMUP_FRACTION = 0.03
MIN_LR_FRACTION = 0.1
SFT_FORMATS = ("alpaca", "chat")
# Files that make a folder a Hugging Face tokenizer (fast tokenizer, its config, or a sentencepiece model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class Default:
    """One value the fine-tuning layer chose, with why (printed by plan/submit, recorded in plan.json)."""

    key: str  # dotted spec key, e.g. "train.lr"
    value: Any
    reason: str

    def line(self) -> str:
        """`train.lr = 2e-05 (why): set [train] lr to choose` (the plan's and submit's line)."""
        section, _, name = self.key.partition(".")
        return f"{self.key} = {shown(self.value)} ({self.reason}): set [{section}] {name} to choose"

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "reason": self.reason}


def shown(value: Any) -> str:
    """A value as the run file spells it: 2e-05, true, '/models/x'."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)


def has_tokenizer(folder: str) -> bool:
    """The folder holds a Hugging Face tokenizer (False, not an error, when it cannot be read)."""
    try:
        return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)
    except (OSError, ValueError):
        return False


def defaults(get: Callable[[str], Any], explicit: frozenset[str] | set[str]) -> list[Default]:
    """The fine-tuning defaults for a merged request.

    `get(key)` is the value of a dotted key after the site, run file and flags (or hpctrain's default);
    `explicit` holds the keys one of those layers set. Only keys outside `explicit` are returned.
    """
    out: list[Default] = []

    def choose(key: str, value: Any, reason: str) -> None:
        if key not in explicit:
            out.append(Default(key, value, reason))

    model = str(get("model.path"))
    if model:
        lora = int(get("lora.r")) > 0
        lr = LORA_LR if lora else FULL_LR
        choose("train.lr", lr, (f"fine-tuning default for LoRA adapters (lora.r = {get('lora.r')}); a full "
                                f"fine-tune uses {_lr(FULL_LR)}, pretraining {_lr(PRETRAIN_LR)}") if lora else
               f"fine-tuning default for a pretrained model; pretraining uses {_lr(PRETRAIN_LR)}")
        base = float(get("train.lr")) if "train.lr" in explicit else lr
        choose("train.min_lr", float(f"{base * MIN_LR_FRACTION:.6g}"),
               "a tenth of train.lr, where the cosine schedule ends")
        steps = int(get("train.steps"))
        choose("train.warmup_steps", max(1, round(WARMUP_FRACTION * steps)) if steps > 1 else 0,
               f"3% of the {steps} train.steps, at least 1: Adam's first updates, before its moment estimates "
               "settle, must not hit pretrained weights at the full lr" if steps > 1 else
               "a one-step run has no step to warm up in")
        if has_tokenizer(model):
            choose("data.tokenizer", str(Path(model).expanduser().absolute()),
                   "the model folder's own tokenizer: a pretrained model understands only the ids it was trained on")
    fmt, source = str(get("data.format")), str(get("data.source"))
    text = source != "synthetic" and fmt != "synthetic"
    if (fmt in SFT_FORMATS or (model and text)) and not (
            get("data.dynamic_batching") and "data.dynamic_batching" in explicit):  # an explicit choice stands
        choose("data.pack", True, f"format {fmt!r} examples are short: packed into seq_len rows with "
               "per-document attention boundaries, no compute goes to padding" if fmt in SFT_FORMATS else
               "fine-tuning default for text data: documents packed into seq_len rows with per-document "
               "attention boundaries, no compute goes to padding")
    return out


def _lr(value: float) -> str:
    """2e-5, 3e-4: as the recipes write learning rates."""
    return f"{value:.0e}".replace("e-0", "e-")


def warnings(model_path: str, tokenizer: str, source: str, fmt: str) -> list[str]:
    """What a resolved fine-tuning request gets wrong that no default could fix (the plan prints them)."""
    if not model_path or tokenizer != "byte" or "synthetic" in (source, fmt):
        return []
    if has_tokenizer(model_path):  # set to byte explicitly: it wins, but it is almost surely a mistake
        fix = f"set [data] tokenizer = {model_path!r} (the folder's own), or leave it unset"
    else:
        fix = (f"copy the model's tokenizer files ({', '.join(TOKENIZER_FILES[:2])}) into {model_path}, "
               "or set [data] tokenizer to the folder that holds them")
    return [(f"WARNING: data.tokenizer = 'byte' with the pretrained model {model_path}: the model is fed UTF-8 "
             f"byte ids it was never trained on. Fix: {fix}")]
