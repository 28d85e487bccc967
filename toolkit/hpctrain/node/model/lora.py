"""LoRA and QLoRA through PEFT: adapters wrapped around the loaded model before `deepspeed.initialize`.

- `wrap` turns the loaded model into a PEFT model whose only trainable parameters are the adapters
  ([lora] target_modules, or every linear layer but the output head); DeepSpeed's optimizer then holds
  state for those alone. Under ZeRO-3 the base was partitioned at construction (zero.Init); the adapter
  layers PEFT adds afterwards are ordinary parameters, which DeepSpeed's ZeRO-3 engine partitions at
  initialize (`DeepSpeedZeRoOffload._convert_to_zero_parameters`).
- `load_quantized` is QLoRA's load: from_pretrained with bitsandbytes NF4 weights (bf16 compute), then
  PEFT's prepare_model_for_kbit_training. GPU or CPU ranks, ZeRO 0-2 without offload (spec/rules.py refuses
  the rest at submit).
- `merge` gives the export (node/checkpointing/export.py) the adapters (PEFT save_pretrained) and the merged base.

Checkpoints of a LoRA run hold the adapters and their optimizer state only (node/checkpointing/checkpoint.py saves with
`exclude_frozen_parameters`): the base is read again from [model] path at every start.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from hpctrain.node.monitor.metrics import log
from hpctrain.node.runconf import NodeInputError

ADAPTER_DIR = "adapter"  # the export's adapter folder, inside the merged folder


def lora_config(lo: Any) -> Any:
    """PEFT's LoraConfig for the spec's [lora] section (alpha 0 = 2 x r; () = PEFT's "all-linear")."""
    from peft import LoraConfig

    targets: Any = list(lo.target_modules) if lo.target_modules else "all-linear"
    return LoraConfig(r=lo.r, lora_alpha=lo.alpha or 2 * lo.r, lora_dropout=lo.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


def wrap(model: Any, spec: Any, *, checkpointing: bool) -> Any:
    """The PEFT model around `model`; only adapter parameters require grad. Collective-free."""
    import torch
    from peft import get_peft_model

    lo = spec.lora
    if spec.lora.quantize == "4bit":
        from peft import prepare_model_for_kbit_training

        # Casts the norms to fp32 and enables input grads; gradient checkpointing as the spec decided.
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=checkpointing)
    elif checkpointing:
        # Checkpointed blocks whose inputs need no grad (a frozen embedding) would backpropagate nothing
        # into the adapters: the embedding output must require grad.
        model.enable_input_require_grads()
    # Every rank must create the same adapter init (ZeRO 0-2 keep a replica each): seed right here, as the
    # base's construction may have drawn different amounts of randomness on different ranks.
    torch.manual_seed(spec.train.seed)
    try:
        peft_model = get_peft_model(model, lora_config(lo), autocast_adapter_dtype=False)
    except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise NodeInputError(f"lora.target_modules = {list(lo.target_modules)}: {exc}. Fix: choose among the "
                             f"model's linear layers {names}, or set [lora] target_modules = [] (all of them)."
                             ) from exc
    trainable, total = trainable_counts(peft_model)
    log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.3f%%)", lo.r, lo.alpha or 2 * lo.r,
             list(lo.target_modules) or "every linear layer but the head", trainable, total, 100 * trainable / total)
    return peft_model


def adapter_checkpoints(engine: Any) -> None:
    """Make the engine's module state in checkpoints the adapters alone.

    DeepSpeed's `exclude_frozen_parameters` drops frozen parameters by their `named_parameters` name, which
    names a tied weight once: the output head tied to the embedding stays in the state dict. On an H200
    (2026-12-02) a Llama-3.2-1B LoRA r=16 checkpoint was 683 MB, 525 MB of it that bf16 head, beside 158 MB of
    adapters and their Adam state. Keeping the trainable names only removes it (the base is [model] path).
    """
    keep = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    full = engine.module_state_dict

    def adapters_only(*args: Any, **kwargs: Any) -> Any:
        sd = full(*args, **kwargs)
        if kwargs.get("exclude_frozen_parameters"):
            for name in [n for n in sd if n not in keep]:
                del sd[name]
        return sd

    engine.module_state_dict = adapters_only


def trainable_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameters, ZeRO-3 partitioned ones at full size."""
    trainable = total = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def load_quantized(model_spec: Any, cfg: Any, precision: str, attn: str = "") -> Any:
    """QLoRA's base: [model] path loaded with 4-bit NF4 weights (double quantization), computing in bf16
    (fp16 when the run trains in fp16), on this rank's device: its GPU, or the CPU (bitsandbytes >= 0.50 has
    CPU kernels for NF4, so the CPU test suite runs the whole QLoRA path)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise NodeInputError("lora.quantize = \"4bit\": bitsandbytes is not installed on this node. Fix: install "
                             "hpctrain[qlora] in the image, or set [lora] quantize = \"none\".") from exc
    compute = torch.float16 if precision == "fp16" else torch.bfloat16
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)
    device = get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0")))  # "cuda:N" or "cpu"
    return AutoModelForCausalLM.from_pretrained(model_spec.path, config=cfg, quantization_config=quant,
                                                dtype=compute, device_map={"": device}, local_files_only=True,
                                                attn_implementation=attn or None)


# --------------------------------------------------------------------------------------------- export
def merge(spec: Any, cfg: Any, sd: dict[str, Any], where: Path, adapter_out: Path) -> dict[str, Any]:
    """The export of a LoRA checkpoint (node/checkpointing/export.py writes it): saves the adapters alone into
    `adapter_out` (adapter_config.json + adapter_model.safetensors) and returns the base's state dict with
    them merged in. `sd`: the checkpoint's trainable parameters under the training module's names. The base
    is read again from [model] path in fp32 (a QLoRA run's adapters merge into the unquantized base)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(spec.model.path, config=cfg, dtype=torch.float32,
                                                local_files_only=True)
    model = _adapted(base, spec, sd, where)
    shutil.rmtree(adapter_out, ignore_errors=True)
    model.save_pretrained(str(adapter_out), safe_serialization=True)
    return dict(model.merge_and_unload().state_dict())


def _adapted(base: Any, spec: Any, sd: dict[str, Any], where: Path) -> Any:
    """`base` wrapped as in training, with the checkpoint's adapter weights; refuses a mismatch."""
    from peft import get_peft_model

    model = get_peft_model(base, lora_config(spec.lora), autocast_adapter_dtype=False)
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or unexpected:
        raise NodeInputError(f"{where}: the checkpoint's adapters do not match [lora] in spec.toml (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}). Fix: export with the spec the run "
                             "trained with.")
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    return model
