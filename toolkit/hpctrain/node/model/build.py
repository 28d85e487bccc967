"""The model: a Hugging Face causal LM from a local folder or a config, built for DeepSpeed.

Loading a pretrained folder (`[model] path`):

- ZeRO 0-2: transformers' `from_pretrained` in the training dtype. Every rank holds the whole model anyway.
- ZeRO-3: the model is built partitioned under `deepspeed.zero.Init` with transformers' own init switched
  off (`no_init_weights`: it would index partitioned, empty tensors, e.g. `weight[padding_idx]` when
  config.json sets `pad_token_id`, and its values are overwritten anyway), tied, and then each rank reads
  from the safetensors files only the byte range of its own partition of each parameter (`load_partitioned`).
  No rank ever holds a whole tensor, let alone the whole model, and nothing is communicated: the ranks
  together read the model's bytes once. A fresh model from a config is initialised once, after
  construction, one gathered module at a time (`reinit_weights`).

Where the time goes when a rank loads (the log line "model built in ...; loaded ..." gives both figures):
1. imports (torch, deepspeed, transformers, the model's module): a few seconds, paid before any of this;
2. construction under zero.Init: allocating and partitioning every parameter module by module (one
   layer whole at a time, in the training dtype, no init kernels): grows with the number of tensors,
   and on GPUs includes the partitions' allocation there;
3. reading: `pread` of each partition's bytes (model bytes / world size per rank), by a few threads at once
   (`load_threads`), each in file order; on a cold shared filesystem this is I/O bound, warm it is a memcpy;
4. the dtype cast and copy into the partition (host to GPU on GPU ranks: one copy per tensor).
There is no fp32 copy of the whole model, no double init and no collective per tensor.

Measured with bench/load_rss.py (2-core CPU machine, 2 ranks, Llama-3.2-1B's shape in bf16, 2.47 GB, page
cache warm, 2026-12-02): construction 24-25 s, reading 4.8-6.1 s (1.24 GB a rank); peak RSS 2.0 and 2.56 GB
against 0.5 GB after imports and a 1.24 GB partition: above the partition is one whole tensor zero.Init
builds before partitioning it (the 0.53 GB embedding or head). The former loader (rank 0 reads every
tensor through safetensors' mmap, a GatheredParameters broadcast each) peaked at 4.66 GB on rank 0 and
read for 24.7 s. Its construction, the same code, took 8.5 s: the runs shared the 2 cores with other
processes at different times, so construction times here are noise-bound; time it on the GPU machine.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.node.runconf import NodeInputError

log = logging.getLogger("hpctrain.node")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_model_inputs(model_spec: Any) -> None:
    """Fail fast (before the process group exists) on a model the node cannot build."""
    if bool(model_spec.path) == bool(model_spec.config):
        raise NodeInputError("[model]: set exactly one of path (a local Hugging Face folder) or config "
                             "(a config.json path or a preset name such as \"llama-tiny\").")
    if model_spec.path and not (Path(model_spec.path) / "config.json").is_file():
        raise NodeInputError(f"[model] path = {model_spec.path!r}: no config.json there. Point it at a local folder "
                             "written by save_pretrained (compute nodes are offline: no hub ids).")
    if model_spec.config:
        load_config_dict(model_spec.config)


def load_config_dict(name: str) -> dict[str, Any]:
    """A preset name, or a config.json path (a folder holding one also works)."""
    from hpctrain.spec import presets

    if name in presets.PRESETS:
        return presets.preset_config(name)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise NodeInputError(f"[model] config = {name!r}: neither a preset ({', '.join(sorted(presets.PRESETS))}) "
                             "nor an existing config.json.")
    try:
        return dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise NodeInputError(f"{path}: not valid JSON ({exc.msg}).") from exc


def hf_config(model_spec: Any) -> Any:
    """The transformers config object with the spec's overrides applied."""
    from transformers import AutoConfig

    if model_spec.path:
        try:
            cfg = AutoConfig.from_pretrained(model_spec.path, local_files_only=True)
        except ValueError as exc:
            if "trust_remote_code" not in str(exc):
                raise
            raise NodeInputError(_remote_code_refusal(model_spec.path)) from None
    else:
        d = load_config_dict(model_spec.config)
        d.pop("architectures", None)
        cfg = AutoConfig.for_model(d.pop("model_type", "llama"), **d)
    for key, value in dict(model_spec.overrides).items():
        setattr(cfg, key, value)
    cfg.use_cache = False  # training: no KV cache
    return cfg


def _remote_code_refusal(path: str) -> str:
    """Why a folder whose model transformers does not know (config.json's auto_map names the folder's own
    Python files) is refused: hpctrain never runs code from a model folder (trust_remote_code)."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        d = {}
    return (f"[model] path = {path!r}: its model_type {d.get('model_type', '?')!r} is not one this transformers "
            "knows, and the folder's auto_map points at its own Python code, which hpctrain does not run "
            "(trust_remote_code). Fix: use a transformers-native copy of the model (its model_type listed in "
            "transformers' docs, converted with the model's conversion script), a newer transformers in the image "
            "that knows it, or train it from your own script (`hpctrain submit --script`), where you load it.")


def build_model(model_spec: Any, cfg: Any, precision: str, ds_config: dict[str, Any], zero3: bool,
                attn: str = "", device: str = "cpu") -> Any:
    """from_pretrained or from_config, partitioned at construction for ZeRO-3 (no rank holds it whole).
    `attn`: transformers' attn_implementation ("": transformers' default; hpctrain.node.model.attention).
    `device`: where a fresh model is built without ZeRO-3 ("cuda" on GPU ranks: the current device)."""
    from transformers import AutoModelForCausalLM

    _import_model_code(cfg)
    dtype = DTYPES[precision]
    if model_spec.path and not zero3:
        with _attention_refused(attn):
            return AutoModelForCausalLM.from_pretrained(model_spec.path, config=cfg, dtype=dtype,
                                                        local_files_only=True, attn_implementation=attn or None)
    if not zero3:
        # Without ZeRO-3 a GPU rank builds (and initialises) the fresh model on its GPU, as DeepSpeed would move
        # it there anyway: on the host, every rank of a node held the whole model in fp32 (4 N bytes each: 32 GB
        # per rank for 8B) and ran transformers' init twice on the CPU. On the H200 machine (2026-12-02) a
        # Llama-1B ZeRO-0 run of the entrypoint took 60 s start to end against the plain loop's 30 s (which
        # builds on the GPU), with a 7.0 GB host peak against 2.1 GB. transformers initialises it once, here.
        with torch.device(device), _attention_refused(attn):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                    attn_implementation=attn or None)
    t0 = time.perf_counter()
    with _partitioned_construction(ds_config), _attention_refused(attn):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype,
                                                 attn_implementation=attn or None)
    built = time.perf_counter() - t0
    if model_spec.path:
        _tie(model)  # post_init ties inside init_weights, which no_init_weights switched off
        stats = load_partitioned(model, model_spec.path)
        log.info("model built in %.1f s; loaded %d tensors, %.2f GB read by this rank in %.1f s", built,
                 stats.tensors, stats.bytes_read / 1e9, stats.seconds)
    else:
        reinit_weights(model, zero3)  # ties after the init, as post_init does: a tied head's init is dropped
        gc.collect()  # the untied head's partition (see _tie)
        log.info("model built and initialised in %.1f s", time.perf_counter() - t0)
    return model


def _tie(model: Any) -> None:
    """Tie, and free the head zero.Init built before the tie replaced it.

    DeepSpeed's per-parameter closures make each parameter part of a reference cycle, so the replaced head
    (its partition: vocab x hidden / world size, 0.26 GB a rank for Llama-3.2-1B on 2 ranks) would stay
    until the cycle collector happened to run.
    """
    model.tie_weights()
    gc.collect()


@contextlib.contextmanager
def _partitioned_construction(ds_config: dict[str, Any]) -> Iterator[None]:
    """zero.Init as transformers enters it for its own ZeRO-3 path, without its global DeepSpeed config.

    no_init_weights: transformers' init would run on parameters already partitioned to empty tensors (an
    IndexError on `weight[padding_idx]` for a config with pad_token_id, silently nothing elsewhere) and
    torch's per-layer init kernels would be wasted: weights are loaded or initialised gathered afterwards.
    prevent_arange_dtype_change (entered before zero.Init): under bf16 zero.Init would cast torch.arange's
    floating results, and RoPE inverse frequencies would differ from from_pretrained's.
    """
    import deepspeed
    from transformers.initialization import no_init_weights

    with no_init_weights(), _keep_arange_dtype(), deepspeed.zero.Init(config_dict_or_path=ds_config):
        yield


def _keep_arange_dtype() -> contextlib.AbstractContextManager[None]:
    """transformers' prevent_arange_dtype_change where it has one (5.24 does; 5.17, the H200 image's, does not:
    an ImportError before step 1), else the same patch of DeepSpeed's constructor wrapper, here."""
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:
        return _arange_keeps_dtype()
    keep: contextlib.AbstractContextManager[None] = prevent_arange_dtype_change()
    return keep


@contextlib.contextmanager
def _arange_keeps_dtype() -> Iterator[None]:
    """zero.Init wraps torch.arange like every floating constructor: device and dtype. Keep only the device."""
    from deepspeed.runtime.zero import partition_parameters as pp

    original = pp.zero_wrapper_for_fp_tensor_constructor

    def wrapper(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        if fn is not pp._orig_torch_arange:
            wrapped: Callable[..., Any] = original(fn, *args, **kwargs)
            return wrapped

        def arange(*a: Any, **kw: Any) -> Any:
            if kw.get("device") is None:  # DeepSpeed's own rule for the device, as its wrapper would apply it
                kw["device"] = kwargs["target_device"] if "target_device" in kwargs else torch.device(
                    pp.get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))
            return fn(*a, **kw)

        return arange

    pp.zero_wrapper_for_fp_tensor_constructor = wrapper
    try:
        yield
    finally:
        pp.zero_wrapper_for_fp_tensor_constructor = original


@contextlib.contextmanager
def _attention_refused(attn: str) -> Iterator[None]:
    """transformers' refusal of an asked-for attention implementation (its package missing from the image, a
    model without it) as a usage error that names the setting and the fix, not a traceback."""
    try:
        yield
    except (ImportError, ValueError) as exc:
        text = str(exc)
        if not attn or not any(w in text.lower() for w in ("attention", "attn", "sdpa")):
            raise
        raise NodeInputError(f"[model] attention = {attn!r}: transformers cannot use it here ({text.splitlines()[0]}). "
                             "Fix: install its package in the image, or set [model] attention = \"auto\" "
                             "(transformers' default).") from exc


# -------------------------------------------------------------------------------------------- safetensors
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes lie in a safetensors file (the format: u64 header size, JSON header, data)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file


@dataclass
class LoadStats:
    """What `load_partitioned` did on this rank."""

    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


def weight_files(path: str) -> list[Path]:
    """The folder's weight files: those its index names (sharded), else model.safetensors, else *.safetensors."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise NodeInputError(f"[model] path = {path!r}: {index.name} is not a safetensors index ({exc}). "
                                 "Fix: re-save the model with save_pretrained.") from exc
        absent = [n for n in names if not (folder / n).is_file()]
        if absent:
            raise NodeInputError(f"[model] path = {path!r}: {index.name} names {', '.join(absent[:3])}, which "
                                 "the folder lacks. Fix: copy the whole folder.")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise NodeInputError(f"[model] path = {path!r}: no *.safetensors files; ZeRO-3 loads safetensors only. "
                             "Fix: re-save the model with save_pretrained(..., safe_serialization=True).")
    return files


def read_index(files: list[Path]) -> dict[str, _Stored]:
    """Every tensor's place, from the files' headers only (a few KB each)."""
    out: dict[str, _Stored] = {}
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise NodeInputError(f"{f}: tensor {key} has dtype {meta['dtype']}, which hpctrain cannot load.")
            out[key] = _Stored(f, _ST_DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + size + meta["data_offsets"][0])
    return out


def _pread(fd: int, stored: _Stored, start: int, count: int) -> torch.Tensor:
    """Elements [start, start + count) of the flattened tensor, read straight into a fresh host tensor."""
    out = torch.empty(count, dtype=stored.dtype)
    view = out.view(torch.uint8).numpy().data  # a writable memoryview of the tensor's bytes
    pos, offset = 0, stored.offset + start * out.element_size()
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n <= 0:
            raise NodeInputError(f"{stored.file}: ends before the tensor data its header promises (truncated copy?).")
        pos += n
    return out


def load_partitioned(model: Any, path: str) -> LoadStats:
    """Fill a ZeRO-3 partitioned model from a local folder's safetensors, each rank its own partitions.

    Each rank reads, of each parameter, only the contiguous byte range of its partition (ZeRO-3 partitions
    a parameter's flattened elements in equal contiguous chunks, the last one padded), in file order, and
    copies it into `param.ds_tensor`: no gather, no broadcast, no whole tensor on any rank. Parameters
    whose partition is not a plain host or device tensor (NVMe offload, hpZ secondary copies, quantised)
    go through GatheredParameters with rank 0 reading instead. Tied parameters are filled once, from
    whichever of their names the folder holds; persistent buffers the folder holds are loaded whole, the
    others keep the values construction computed (RoPE frequencies and the like, as from_pretrained does).
    """
    t0 = time.perf_counter()
    direct, fused = _checkpoint_names(model, read_index(weight_files(path)))
    stats = LoadStats()
    converted = _load_converted(model, fused, stats)
    todo, missing = _plan_reads(model, direct, converted)
    if missing:
        raise NodeInputError(f"[model] path = {path!r}: the weights lack {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''} ({len(missing)} of the model's parameters). "
                             "Fix: point [model] path at the complete folder, with the config.json it was saved "
                             "with.")
    todo.sort(key=lambda t: (str(t[1].file), t[1].offset))  # file order: each thread's reads stay sequential
    fds = {f: os.open(f, os.O_RDONLY) for f in dict.fromkeys(where.file for _, where, _ in todo)}
    try:
        # A partition or buffer written in place needs no other rank: those are read by a few threads at once
        # (os.preadv and the copy into the partition release the GIL), which a single reader left at ~1.3 GB/s
        # on the H200 machine (page cache warm; a parallel filesystem also serves several reads better than
        # one). The others go through a collective (GatheredParameters), one after another in the same order
        # on every rank, after the threads.
        alone = [t for t in todo if not _needs_collective(t[2])]
        with ThreadPoolExecutor(max_workers=load_threads(), thread_name_prefix="hpctrain-load") as pool:
            for n in pool.map(lambda t: _load_one(fds[t[1].file], *t), alone):
                stats.bytes_read += n
        for name, where, target in todo:
            if _needs_collective(target):
                stats.bytes_read += _load_one(fds[where.file], name, where, target)
        stats.tensors += len(todo)
    finally:
        for fd in fds.values():
            os.close(fd)
    stats.seconds = time.perf_counter() - t0
    return stats


def load_threads() -> int:
    """Reader threads per rank: HPCTRAIN_LOAD_THREADS, else this rank's share of the node's CPUs, at most 8."""
    wanted = os.environ.get("HPCTRAIN_LOAD_THREADS", "")
    if wanted:
        try:
            return max(1, int(wanted))
        except ValueError:
            raise NodeInputError(f"HPCTRAIN_LOAD_THREADS = {wanted!r}: not a whole number. Fix: set it to the "
                                 "reader threads a rank uses to load a folder (1 = one after another), or "
                                 "unset it.") from None
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(8, len(os.sched_getaffinity(0)) // ranks))


def _needs_collective(target: Any) -> bool:
    """A ZeRO-3 parameter whose partition is not written in place (_load_one gathers it through rank 0)."""
    return getattr(target, "ds_tensor", None) is not None and not _plain_partition(target)


def _plan_reads(model: Any, stored: dict[str, _Stored],
                done: Collection[str] = ()) -> tuple[list[tuple[str, _Stored, Any]], list[str]]:
    """(name, where, parameter or buffer) for everything to load, and the parameters the folder lacks
    (`done`: parameters already filled by a conversion)."""
    names: dict[int, list[str]] = {}
    objs: dict[int, Any] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        objs[id(p)] = p
    todo: list[tuple[str, _Stored, Any]] = []
    missing: list[str] = []
    for key, aliases in names.items():
        if any(n in done for n in aliases):
            continue
        found = next((n for n in aliases if n in stored), None)  # a tied head: whichever name was saved
        if found is None:
            missing.append(aliases[0])
        else:
            todo.append((found, stored[found], objs[key]))
    for mod_name, module in model.named_modules():
        for buf_name, buf in module._buffers.items():
            full = f"{mod_name}.{buf_name}" if mod_name else buf_name
            if buf is not None and buf_name not in module._non_persistent_buffers_set and full in stored:
                todo.append((full, stored[full], buf))
    return todo, missing


def _checkpoint_names(model: Any,
                      stored: dict[str, _Stored]) -> tuple[dict[str, _Stored], dict[str, dict[str, _Stored]]]:
    """The folder's tensors under the model's names: ({model name: tensor} read as stored, {first model name of a
    fusion: {checkpoint name: tensor}} that transformers' conversions turn into model tensors).

    transformers (5.x) keeps some families' weights on disk under other names than its modules use, and converts
    them in from_pretrained (what ZeRO 0-2 load with): GPT-NeoX's `embed_out` is `lm_head`, a checkpoint without
    the base model's prefix (GPT-2's own) gains it, legacy LayerNorm `gamma`/`beta` are `weight`/`bias`, and the
    MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) store one tensor per expert that the model holds fused
    (`mlp.experts.gate_up_proj`, experts x 2 intermediate x hidden); save_pretrained writes them back so. The
    same conversion list, transformers' own, decides the names here, so both loaders agree.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    names = dict.fromkeys([n for n, _ in model.named_parameters(remove_duplicate=False)]
                          + [n for n, _ in model.named_buffers()], True)
    direct: dict[str, _Stored] = {}
    fused: dict[str, dict[str, _Stored]] = {}
    for key in sorted(stored, key=dot_natural_key):  # transformers' order (a group rename activates on its first key)
        new, pattern = rename_source_key(key, renamings, converters, base_model_prefix=model.base_model_prefix,
                                         meta_state_dict=names)
        if pattern is None:
            direct.setdefault(new, stored[key])
        else:
            fused.setdefault(new, {})[key] = stored[key]
    return direct, fused


def _load_converted(model: Any, fused: dict[str, dict[str, _Stored]], stats: LoadStats) -> set[str]:
    """Fill the parameters transformers' conversions make from several stored tensors (fused MoE experts), one
    group at a time: every rank runs the conversion on meta tensors (the names and shapes it makes), the
    parameters are gathered, rank 0 reads the group's tensors and converts them for real, and ZeRO-3 partitions
    the result again. The peak is one group (one layer's experts of one projection), never the model."""
    if not fused:
        return set()
    import deepspeed
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict

    mapping = get_model_conversion_mapping(model)
    convert: Any = _apply_weight_conversions_to_state_dict  # transformers' own ZeRO-3 conversion (untyped)
    params = dict(model.named_parameters(remove_duplicate=False))
    rank0 = torch.distributed.get_rank() == 0
    done: set[str] = set()
    for target in sorted(fused):
        sources = fused[target]
        meta = {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in sources.items()}
        made = {n: t for part in convert(model, meta, mapping) for n, t in part.items()}
        for name, t in made.items():
            want = tuple(getattr(params.get(name), "ds_shape", ()))
            if name not in params or tuple(t.shape) != want:
                raise NodeInputError(f"{next(iter(sources.values())).file}: {', '.join(sorted(sources)[:2])} ... "
                                     f"convert to {name} of shape {list(t.shape)}, which the model "
                                     f"{'lacks' if name not in params else f'expects as {list(want)}'}. "
                                     "Fix: use the config.json saved with these weights.")
        with deepspeed.zero.GatheredParameters([params[n] for n in made], modifier_rank=0), torch.no_grad():
            if rank0:
                real = {}
                for k, s in sources.items():
                    fd = os.open(s.file, os.O_RDONLY)
                    try:
                        real[k] = _pread(fd, s, 0, int(torch.Size(s.shape).numel())).view(s.shape)
                    finally:
                        os.close(fd)
                    stats.bytes_read += real[k].numel() * real[k].element_size()
                for part in convert(model, real, mapping):
                    for name, t in part.items():
                        params[name].copy_(t)
                del real
        stats.tensors += len(made)
        done |= set(made)
    return done


def _load_one(fd: int, name: str, where: _Stored, target: Any) -> int:
    """Copy one tensor (this rank's partition of it, for a ZeRO-3 parameter) in; returns the bytes read."""
    import deepspeed

    shape = tuple(getattr(target, "ds_shape", target.shape))
    if shape != where.shape:
        raise NodeInputError(f"{where.file}: {name} has shape {list(where.shape)}, the model expects "
                             f"{list(shape)}. Fix: use the config.json saved with these weights.")
    size = int(torch.empty(0, dtype=where.dtype).element_size())
    part = getattr(target, "ds_tensor", None)
    if part is None:  # a buffer, or a parameter ZeRO-3 does not manage
        with torch.no_grad():
            target.copy_(_pread(fd, where, 0, target.numel()).view(shape))
        return int(target.numel()) * size
    if _plain_partition(target):
        per_rank = int(part.ds_numel)
        start = per_rank * torch.distributed.get_rank(group=target.ds_process_group)
        count = max(0, min(per_rank, int(target.ds_numel) - start))  # the last rank's tail is padding
        if count:
            with torch.no_grad():
                part.narrow(0, 0, count).copy_(_pread(fd, where, start, count))
        return int(count) * size
    rank0 = torch.distributed.get_rank() == 0
    with deepspeed.zero.GatheredParameters([target], modifier_rank=0), torch.no_grad():
        if rank0:
            target.copy_(_pread(fd, where, 0, int(target.ds_numel)).view(shape))
    return int(target.ds_numel) * size if rank0 else 0


def _plain_partition(param: Any) -> bool:
    """Whether the partition is a plain tensor this rank may write in place (ZeRO-3's usual layout)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    part = param.ds_tensor
    return (getattr(param, "ds_secondary_tensor", None) is None and getattr(part, "final_location", None) is None
            and not hasattr(part, "ds_quant_scale") and param.ds_status == ZeroParamStatus.NOT_AVAILABLE
            and part.numel() == part.ds_numel)


def _import_model_code(cfg: Any) -> None:
    """Import the model's module (and torch._dynamo, which transformers pulls in) before zero.Init.

    zero.Init patches torch.Tensor.__new__; torch._dynamo imported lazily inside it fails with
    "Signature mismatch ... tensor_pynew".
    """
    import torch._dynamo  # noqa: F401
    from transformers import AutoModelForCausalLM

    with contextlib.suppress(KeyError):  # unknown architecture: from_config raises a clear error itself
        AutoModelForCausalLM._model_mapping[type(cfg)]


def reinit_weights(model: Any, zero3: bool) -> None:
    """Run transformers' weight init once, every parameter whole, then tie.

    Under zero.Init the parameters are already partitioned when HF's post_init runs, so its init never
    reaches them (build_model switches it off there); a tied embedding then starts with std 1 and the
    first loss is ~200 instead of ln(vocab) (seen on the H200 with Llama-1B). transformers' ZeRO-3 variant
    gathers one module (with its direct children's parameters, which some families' init touches) at a
    time, so the peak stays at one layer, and rank 0's values are what every rank keeps.
    """
    if zero3:
        from transformers.integrations.deepspeed import initialize_weights_zero3

        initialize_weights_zero3(model)
    else:
        model.initialize_weights()
    model.tie_weights()


def apply_freeze(model: Any, patterns: tuple[str, ...]) -> int:
    """requires_grad=False for parameters whose name matches any fnmatch pattern; returns how many."""
    if not patterns:
        return 0
    frozen = 0
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        names = [n for n, _ in model.named_parameters()][:8]
        raise NodeInputError(f"[model] freeze = {list(patterns)}: matches no parameter. Names look like: "
                             f"{', '.join(names)} ...")
    return frozen


def param_count(model: Any) -> int:
    """Total parameters, counting ZeRO-3 partitioned ones at full size (ds_numel)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += int(getattr(p, "ds_numel", p.numel()))
    return total


def flops_per_token(cfg: Any, n_params: int, seq_len: int) -> float:
    """Model FLOPs per trained token: 6*N (without the input embedding) + 12*L*H*S attention."""
    emb = cfg.vocab_size * cfg.hidden_size
    tied = getattr(cfg, "tie_word_embeddings", False)
    n = n_params - (0 if tied else emb)
    return float(6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len)
