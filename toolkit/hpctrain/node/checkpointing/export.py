"""Consolidated Hugging Face folder from a complete checkpoint (also `hpctrain export RUN`).

Reads the checkpoint files alone (no process group, one process): ZeRO 1-3 through DeepSpeed's
zero_to_fp32 (fp32 master weights), ZeRO-0 from the model-states file, pipeline runs from the
per-layer files. The folder is written aside and renamed, so a half-written export is never seen.
A LoRA run's export is the merged model with the adapters alone in its `adapter/` folder (node/model/lora.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from hpctrain.node.checkpointing import checkpoint as ckpt
from hpctrain.node.runconf import NodeInputError, read_spec
from hpctrain.runs.checkpoints import complete_steps
from hpctrain.runs.folder import RunFolder


def export_hf(run_dir: str | Path, out: str | Path | None = None, tag: str | None = None) -> Path:
    """Write RUN/hf (or `out`) from checkpoint `tag` (default: the latest complete one); returns the folder."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # zero_to_fp32 and transformers draw progress bars on stderr
    from hpctrain.node.model.build import hf_config

    paths = RunFolder(run_dir)
    spec = read_spec(paths)
    if out is not None:
        check_out(Path(out), paths, spec)
    _check_model_folder(spec)
    point = _point(paths, tag, spec)
    cfg = hf_config(spec.model)
    if int(point.meta.get("pp", 1)) > 1:
        cfg.tie_word_embeddings = False  # the pipeline trains an untied head (see pipeline.py)
    sd = consolidated_state_dict(paths.checkpoints_dir, point, cfg)
    if not point.meta.get("adapters"):
        return write_hf(paths, spec, cfg, sd, point.tag, point.step, out)
    # LoRA: sd holds the adapters; merged into the base of [model] path, and saved alone in hf/adapter/
    from hpctrain.node.model.lora import ADAPTER_DIR, merge

    final = Path(out) if out else paths.export_dir
    staged = final.with_name(f".tmp-{final.name}-{ADAPTER_DIR}")
    merged = merge(spec, cfg, sd, point.path, staged)
    folder = write_hf(paths, spec, cfg, merged, point.tag, point.step, out)
    os.replace(staged, folder / ADAPTER_DIR)
    return folder


def write_hf(paths: RunFolder, spec: Any, cfg: Any, sd: dict[str, Any], tag: str, step: int,
             out: str | Path | None = None) -> Path:
    """save_pretrained of a full state dict (HF names) into RUN/hf or `out`, written aside then renamed."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise NodeInputError(f"{paths.checkpoints_dir / tag}: checkpoint does not match the model in spec.toml "
                             f"(missing {missing[:4]}, unexpected {unexpected[:4]}).")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    final = Path(out) if out else paths.export_dir
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    _save_tokenizer(spec, tmp)
    (tmp / EXPORT_MARKER).write_text(json.dumps(
        {"run": str(paths.path), "checkpoint": tag, "step": step, "time": time.time()}, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


EXPORT_MARKER = "hpctrain_export.json"


def check_out(out: Path, paths: RunFolder, spec: Any) -> None:
    """Refuse an --out folder the export would destroy: it replaces the folder whole, so a folder that is not an
    earlier export (the base model's, a home folder, one that holds the run) must never be it."""
    final = out.resolve()
    base = [Path(p).resolve() for p in (spec.model.path, spec.data.tokenizer) if p and p != "byte"]
    fix = (f"Fix: pass --out a new or empty folder, e.g. --out {shlex.quote(str(final) + '-export')}, or leave it "
           f"out ({paths.export_dir})")
    for folder in base:
        if final == folder or final in folder.parents:
            raise NodeInputError(f"--out {out}: holds {folder}, which this run reads ([model] path / [data] "
                                 f"tokenizer), and the export replaces --out whole. {fix}")
    if final == paths.path.resolve() or final in paths.path.resolve().parents:
        raise NodeInputError(f"--out {out}: holds the run folder {paths.path}, and the export replaces --out whole. "
                             f"{fix}")
    if final.is_dir() and not (final / EXPORT_MARKER).is_file():
        try:
            first = next(iter(sorted(final.iterdir())), None)
        except OSError as exc:
            raise NodeInputError(f"--out {out}: cannot be read ({exc}). {fix}") from exc
        if first is not None:
            raise NodeInputError(f"--out {out}: a folder that is not an earlier export (it holds {first.name}, and "
                                 f"no {EXPORT_MARKER}); the export replaces --out whole. {fix}")
    elif final.exists() and not final.is_dir():
        raise NodeInputError(f"--out {out}: is a file, not a folder. {fix}")


def _check_model_folder(spec: Any) -> None:
    """The export reads the model's config (and a LoRA run's frozen base) from [model] path: a folder moved or
    deleted since training is named, not left to transformers' hub lookup of the path as a repo id."""
    path = spec.model.path
    if path and not (Path(path) / "config.json").is_file():
        what = "the model's config and the frozen base the adapters merge into" if spec.lora.r else "the model's config"
        raise NodeInputError(f"[model] path = {path!r}: no config.json there, and the export reads {what} from it. "
                             "Fix: put the model folder back at that path (the run's spec.toml names it)")


def _point(paths: RunFolder, tag: str | None, spec: Any) -> ckpt.ResumePoint:
    if tag is None:
        point = ckpt.find_resume(paths.checkpoints_dir)
        if point is None:
            c = spec.checkpoint
            when = [f"every {c.every_steps} steps"] * bool(c.every_steps) + \
                [f"every {c.every_minutes:g} minutes"] * bool(c.every_minutes)
            raise NodeInputError(f"{paths.checkpoints_dir}: no complete checkpoint to export: the run has written "
                                 f"none ({', '.join([*when, 'on the time-limit signal and at its end'])}). Fix: "
                                 f"`hpctrain status {paths.path.name}` shows how it ended; train first, or resubmit "
                                 "it once it is fixed")
        return point
    path = paths.checkpoints_dir / tag
    if Path(tag).name != tag or tag in (".", "..") or not path.is_dir():  # a name in checkpoints/, never a path
        have = [f"step-{n}" for n in complete_steps(paths.checkpoints_dir)]
        raise NodeInputError(f"--tag {tag}: no such checkpoint in {paths.checkpoints_dir}. Fix: pass one of "
                             f"{', '.join(have)}, or leave --tag out (the latest)" if have else
                             f"--tag {tag}: no such checkpoint in {paths.checkpoints_dir}, and it holds no complete "
                             "checkpoint. Train first (checkpoints are written at the end of every run).")
    meta = ckpt.read_marker(path)
    ckpt.validate_files(path, meta)
    return ckpt.ResumePoint(tag, path, meta)


def consolidated_state_dict(ckpt_dir: Path, point: ckpt.ResumePoint, cfg: Any) -> dict[str, Any]:
    """Full state dict with Hugging Face names, whatever the ZeRO stage or pipeline layout."""
    import torch

    if int(point.meta.get("tp", 1)) > 1:
        raise NodeInputError(f"{point.path}: a tensor-parallel (tp={point.meta['tp']}) checkpoint is exported at the "
                             "end of training only (the node gathers the shards); offline merging is not implemented.")
    if int(point.meta.get("pp", 1)) > 1:
        from hpctrain.node.model.pipeline import hf_name

        sd: dict[str, Any] = {}
        for f in sorted(point.path.glob("layer_*-model_states.pt")):
            idx = int(re.match(r"layer_(\d+)-", f.name).group(1))  # type: ignore[union-attr]
            for k, v in torch.load(f, map_location="cpu", weights_only=False).items():
                sd[hf_name(idx, k, cfg.num_hidden_layers)] = v.float()
        return sd
    if int(point.meta.get("zero", 0)) >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=point.tag))
    states = torch.load(point.path / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}


def _save_tokenizer(spec: Any, out: Path) -> None:
    from hpctrain.node.data.tokenize import ByteTokenizer, copy_tokenizer_files

    if spec.data.tokenizer in ("", "byte"):
        ByteTokenizer().save(out)
    else:
        copy_tokenizer_files(spec.data.tokenizer, out)
