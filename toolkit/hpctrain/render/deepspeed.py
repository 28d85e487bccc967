"""The one DeepSpeed config builder: (spec, plan) -> ds_config.json, in DeepSpeed's own schema.

Built once, at submit, and written to the run folder; the node reads it and passes it to
`deepspeed.initialize` as it is. Every choice that does not depend on the allocation is made here
(ZeRO block, offload, optimizer implementation, tensor/pipeline sections, logging). What does depend
on it (the batch product after a world-size change, loading a universal checkpoint, an env-var knob on
the node) is applied on the node by `hpctrain.node.runconf.effective_ds_config`, which writes the result
to ds_config.effective.json and logs every edit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.plan.buckets import zero3_buckets
from hpctrain.plan.memory import SUB_GROUP_SIZE
from hpctrain.runs.folder import CSV, METRICS, TENSORBOARD, json_text
from hpctrain.spec.model import Spec
from hpctrain.spec.rules import partial_offload_ok

if TYPE_CHECKING:
    from hpctrain.plan.model import Plan

# DeepSpeed prints a throughput line every N steps; hpctrain's own metrics replace it.
STEPS_PER_PRINT = 10**9


def _offload_block(spec: Spec) -> dict[str, Any]:
    p = spec.parallel
    block: dict[str, Any] = {"device": p.offload_device, "pin_memory": True}
    if p.offload_device == "nvme":
        block["nvme_path"] = p.nvme_path
    return block


def _zero_block(spec: Spec, plan: Plan) -> dict[str, Any]:
    """zero_optimization. ZeRO-3's buckets, prefetch and persistence come from the measured table of
    hpctrain.plan.buckets (by device kind and model size); ZeRO-1/2 keep buckets of h*h (not measured)."""
    stage, h = plan.zero_stage, int(plan.model.get("hidden", 1024))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return zero
    zero.update({"overlap_comm": plan.device == "gpu", "contiguous_gradients": True,
                 "reduce_bucket_size": h * h})
    if stage in (1, 2):
        # DeepSpeed's ZeRO-1/2 optimizer asserts an all-gather bucket of an even number of elements: an odd hidden
        # size (Qwen3-shaped h=33 in tests/test_node_families) failed deepspeed.initialize with h*h.
        zero.update({"allgather_partitions": True, "allgather_bucket_size": h * h + h * h % 2, "reduce_scatter": True})
    if stage == 3:
        b = zero3_buckets(plan.device, plan.param_count, h)
        zero.update({"reduce_bucket_size": b.reduce, "stage3_prefetch_bucket_size": b.prefetch,
                     "stage3_param_persistence_threshold": b.persistence,
                     "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if plan.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = _offload_block(spec)
        if plan.offload_ratio < 1 and partial_offload_ok(stage, plan.offload, spec.parallel.offload_device):
            # Partial offload (ZeRO-3 only): DeepSpeed keeps the first int((1 - ratio) * n) of its n optimizer
            # sub-groups on the GPU. The plan's estimate counted whole sub-groups of this size: say it.
            zero["offload_optimizer"]["ratio"] = plan.offload_ratio
            zero["sub_group_size"] = SUB_GROUP_SIZE
    if plan.offload in ("param", "all"):
        zero["offload_param"] = _offload_block(spec)
    return zero


def adam_implementation(plan: Plan) -> dict[str, Any]:
    """Optimizer params that pick the AdamW implementation DeepSpeed builds.

    DeepSpeed's FusedAdam (GPU) and DeepSpeedCPUAdam cost a JIT compile on every fresh node or container
    (40-90 s, and nvcc on the compute node for FusedAdam; 41 s and 2 GB on a CPU node). torch ships a fused
    CUDA AdamW that runs at the same memory-bound pace, so GPU ranks without optimizer offload use it. With
    offload the optimizer runs on the host, where DeepSpeedCPUAdam is ~5x faster than torch's (5.35 vs
    0.97 Gparam/s on 16 H200-host cores), so it stays. CPU ranks: torch's (foreach) AdamW.
    """
    if plan.device == "cpu":
        return {"torch_adam": True}
    if plan.offload in ("optimizer", "all"):
        return {}
    return {"torch_adam": True, "fused": True}


def monitor_blocks(spec: Spec) -> dict[str, Any]:
    """DeepSpeed's monitor blocks for [tracking] backends (deepspeed.monitor: TensorBoard, W&B, CSV).

    output_path is relative: DeepSpeed joins it with job_name under the directory the rank runs in, and the
    node runs every rank in its run folder (node.launch.main), so the files land in RUN/metrics/tensorboard and
    RUN/metrics/csv wherever the folder sits. W&B's run id, resume and folder are not fields of DeepSpeed's
    block: the node sets them in the environment wandb.init reads (node.monitor.tracking.wandb_env). MLflow has no
    DeepSpeed monitor; the node's MlflowMonitor reads [tracking] from spec.toml, so it has no block here.
    """
    t = spec.tracking
    out: dict[str, Any] = {}
    if "tensorboard" in t.backends:
        out["tensorboard"] = {"enabled": True, "output_path": METRICS, "job_name": TENSORBOARD}
    if "csv" in t.backends:
        out["csv_monitor"] = {"enabled": True, "output_path": METRICS, "job_name": CSV}
    if "wandb" in t.backends:
        block = {"enabled": True, "project": t.project, "team": t.entity, "group": t.group}
        out["wandb"] = {k: v for k, v in block.items() if v != ""}
    return out


def build_ds_config(spec: Spec, plan: Plan) -> dict[str, Any]:
    """The DeepSpeed config of a run. The optimizer block stays minimal: the node builds the LR schedule."""
    t = spec.train
    params: dict[str, Any] = {"lr": t.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": t.weight_decay,
                              **adam_implementation(plan)}
    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": _zero_block(spec, plan),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        **monitor_blocks(spec),
    }
    if t.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    if plan.tp > 1:
        # DeepSpeed AutoTP shards the HF model's Linear layers inside a node, in deepspeed.initialize. It
        # checks train_batch_size before it knows the tp groups (it would count tp peers as data-parallel
        # ranks): leave it out and let DeepSpeed derive it from micro x accum x dp.
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
        del cfg["train_batch_size"]
    if plan.pp > 1:
        cfg["pipeline"] = {"stages": plan.pp, "partition": "parameters", "seed_layers": False,
                           "activation_checkpoint_interval": 1 if plan.activation_checkpointing else 0}
    return cfg


def to_json(cfg: dict[str, Any]) -> str:
    """ds_config.json's text, in the format the node writes ds_config.effective.json in."""
    return json_text(cfg)
