"""Every environment variable hpctrain reads or sets, with what it means: docs/env.md is this table, and
tests/test_envvars.py fails on an HPCTRAIN_* name in the package that is not listed here (or the reverse).

`HPCTRAIN` lists hpctrain's own variables; `SET_FOR_RANKS` the others' variables hpctrain sets on the ranks (or in
the batch script) so that torch, DeepSpeed, NCCL, transformers and submitit behave as a run needs.
"""

from __future__ import annotations

# name -> one line: who sets it (user, batch script, node entry...) and what it changes.
HPCTRAIN: dict[str, str] = {
    # Where things live (the user's environment)
    "HPCTRAIN_CONFIG_DIR": "user: the folder of site profiles (sites/NAME.toml) and template overrides (templates/)",
    "HPCTRAIN_RUNS_DIR": "user: where run folders are created (default from config.toml, else ./runs)",
    "HPCTRAIN_STATE_DIR":
        "user: the registry's folder (default $XDG_STATE_HOME/hpctrain, else ~/.local/state/hpctrain)",
    "HPCTRAIN_DATA_CACHE": "user: the prepared-data cache (default <runs dir>/.prepared/KEY)",
    "HPCTRAIN_REMOTE": "user: run every command on this [remote] site's login node (like --remote SITE)",
    "HPCTRAIN_REMOTE_NO_SERVER": "user/tests: set: remote commands use plain ssh, no forwarded hpctrain server",
    "HPCTRAIN_ON_LOGIN": "set by the laptop in a remote command: the login node's hpctrain runs it locally",
    "HPCTRAIN_SSH_CONTROL_DIR": "user: the private (0700) folder of ssh control sockets for [remote] sites",
    "HPCTRAIN_CH_IMAGE": "tests/CI: the Charliecloud image the container tests use",
    "HPCTRAIN_SKIP_IMAGE_CHECK": "user: set: submit does not check that the container image exists on this host",
    # SLURM commands (hpctrain.slurmcommands)
    "HPCTRAIN_SLURM_RETRIES": "user: tries of a SLURM command while slurmctld/slurmdbd do not answer (default 3)",
    "HPCTRAIN_SLURM_BACKOFF_S": "user: the first wait between those tries, doubled each time (default 0.5)",
    "HPCTRAIN_SLURM_BUDGET_S": "user: the seconds one SLURM command may spend retrying (default 60)",
    "HPCTRAIN_SBATCH_TIMEOUT_S": "user: how long sbatch may take before its outcome is unknown (default 60)",
    "HPCTRAIN_SUBMIT_GRACE_S": "user: how long a submit of unknown outcome is looked for in squeue/sacct",
    "HPCTRAIN_SUBMIT_PAUSE_AT": "tests: the submit transaction's point where the submitting process pauses",
    "HPCTRAIN_SUBMIT_PAUSE_FILE": "tests: the file it writes 'PID TAG' into at that point, and waits on",
    # The batch script and the node entry
    "HPCTRAIN_RUN_DIR": "batch script -> ranks: this rank's run folder (hpctrain.runtime reads it)",
    "HPCTRAIN_RUN_DIRS": "batch script: the run folders of a sweep's array, indexed by the array task",
    "HPCTRAIN_DS_CONFIG": "batch script -> ranks: the DeepSpeed config a user's script passes to deepspeed",
    "HPCTRAIN_HOSTS": "batch script: the job's hosts (scontrol show hostnames), one per line",
    "HPCTRAIN_HOSTFILE": "batch script: the DeepSpeed hostfile written on the allocation",
    "HPCTRAIN_RANKS_PER_NODE": "batch script: ranks per node, for the launch line of a user's script",
    "HPCTRAIN_GUARD": "batch script: the in-container check (python imports hpctrain) before the rank starts",
    "HPCTRAIN_WATCHDOG_PID": "batch script: the hang watchdog's process, stopped when the step ends",
    "HPCTRAIN_ATTEMPT": "batch script -> ranks: the attempt number (logs/attempt-K; plus SLURM_RESTART_COUNT)",
    "HPCTRAIN_STARTED": "node entry -> a user's script: when this run's node entry started (unix time)",
    "HPCTRAIN_NODE_MODE": "in-job driver: 'health' makes the node entry run the health check, not training",
    "HPCTRAIN_HEALTH_DIR": "in-job driver: the folder the health check writes each node's report into",
    "HPCTRAIN_HEALTH_ROUND": "in-job driver: 2 = the second measurement, borderline nodes only",
    "HPCTRAIN_INJOB_RESTART": "in-job driver -> ranks: the restart's number within the job (0: first step)",
    "HPCTRAIN_LOCAL_RESTARTS": "node entry: runs before this one on submitit's local executor (attempt numbering)",
    "HPCTRAIN_DS_CHILD": "node entry: set in the ranks DeepSpeed's runner starts (they are ranks, not runners)",
    "HPCTRAIN_PREFLIGHT_PORT": "user: the pre-flight rendezvous port (default MASTER_PORT + 1)",
    "HPCTRAIN_REQUEUE_GRACE_S": "user: max s the ranks but 0 wait for rank 0's requeue after the signal's save (20)",
    "HPCTRAIN_WARM_RANKS": "user: 0 turns off warm ranks (a zygote per node forking each in-job step's ranks)",
    "HPCTRAIN_STACKS": "node entry -> a user's program: where its ranks write their stack dumps (JSON)",
    "HPCTRAIN_STACKS_PID": "node entry: the process that owns the stack dump (its children do not dump again)",
    # The trainer's knobs and the checkpoint writer
    "HPCTRAIN_CKPT_WRITERS": "user: writer threads per checkpoint file (default 4)",
    "HPCTRAIN_CKPT_WAIT_S": "user: how long the background writer may take before a save fails (default 1800)",
    "HPCTRAIN_CPU_ADAM": "user: 1 = DeepSpeed's own CPU Adam on CPU ranks, in place of hpctrain's choice",
    "HPCTRAIN_DS_ADAM": "user: 1 = DeepSpeed's own Adam on GPU ranks, in place of hpctrain's choice",
    "HPCTRAIN_CPU_FP16": "tests: 1 = fp16 on CPU ranks that lack native fp16 (slow, for tests only)",
    "HPCTRAIN_LOAD_THREADS": "user: reader threads a ZeRO-3 rank loads a model folder with (default: its share of "
                             "the node's CPUs, at most 8; 1 = one read after another)",
    "HPCTRAIN_FAST_INIT": "user: 0 turns off the ZeRO-3 offload engine build's in-place pinning and GPU defragment",
    "HPCTRAIN_COMPILE_CACHE": "user: torch.compile's cache folder on GPU ranks ('off': torch's default; default "
                              "<runs dir>/.compile-cache/<host>)",
    "HPCTRAIN_ZERO3_OFFLOAD_FIX": "user: 0 turns off hpctrain's ZeRO-3 CPU-offload step fixes (A/B runs)",
    # Fault injection (tests and demos)
    "HPCTRAIN_FAULT_INJECT": "tests: faults at steps and checkpoints ('hang:rank=1,step=10;ckpt-crash:step=12')",
    "HPCTRAIN_FAIL_AT_STEP": "tests/demo: every rank dies right after step N",
    "HPCTRAIN_FAIL_AFTER_WRITES": "tests: with FAIL_AT_STEP, the pending background checkpoint write finishes first",
    "HPCTRAIN_CKPT_WRITE_DELAY_S": "tests: slows each background checkpoint file write (a crash mid-write)",
    "HPCTRAIN_HEALTH_INJECT": "tests: fault injection into the health check ('borderline:host=H', ...)",
}

# Variables of other programs that hpctrain sets for the ranks or in the batch script.
SET_FOR_RANKS: dict[str, str] = {
    "MASTER_ADDR": "the rendezvous host (the first host of the job), for torch.distributed",
    "MASTER_PORT": "the rendezvous port, derived from the job id (hpctrain.nodelist.rendezvous_port)",
    "NODE_RANK": "this node's index in the job, for a user's script launched per node",
    "DS_ACCELERATOR": "cpu on CPU ranks (gloo): DeepSpeed does not look for a GPU",
    "OMP_NUM_THREADS": "the CPU threads per rank (SLURM_CPUS_PER_TASK, unless the user set it)",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable segments on GPU ranks unless the user set it",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "NCCL's flight recorder dump on a collective timeout",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "the size of that recorder's buffer",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "where the recorder dumps, in the run folder",
    "HF_HUB_OFFLINE": "1: compute nodes never reach the Hugging Face Hub",
    "TRANSFORMERS_OFFLINE": "1: the same for transformers",
    "TOKENIZERS_PARALLELISM": "false: no tokenizer thread pools forked into ranks",
    "TQDM_DISABLE": "1: no progress bars in rank logs",
    "MLFLOW_ALLOW_FILE_STORE": "lets the MLflow monitor write to a local folder",
    "SUBMITIT_EXECUTOR": "slurm: tells submitit's runner in the batch script which executor it runs under",
    "PYTHONPATH": "a user's script: hpctrain's sitecustomize first (stack dumps, stop signal)",
    "ACCELERATE_USE_CPU": "a user's script under accelerate on CPU ranks: Accelerator() uses gloo, one process a rank",
    "TORCHINDUCTOR_CACHE_DIR": "GPU ranks: the per-node compile cache (HPCTRAIN_COMPILE_CACHE), unless the user set it",
    "TRITON_CACHE_DIR": "GPU ranks: Triton's kernels in that cache's triton/ folder, unless the user set it",
    "TORCH_CUDA_ARCH_LIST": "DeepSpeed's op builds: '9.0a' rewritten to '9.0' (its builder parses it with int())",
}


def markdown() -> str:
    """docs/env.md: both tables."""
    out = ["# Environment variables", "", "Generated from `hpctrain.envvars` (tests/test_envvars.py checks it).", "",
           "## hpctrain's own", "", "| variable | meaning |", "| --- | --- |"]
    out += [f"| `{k}` | {v} |" for k, v in sorted(HPCTRAIN.items())]
    out += ["", "## Set by hpctrain for the ranks", "", "| variable | meaning |", "| --- | --- |"]
    out += [f"| `{k}` | {v} |" for k, v in sorted(SET_FOR_RANKS.items())]
    return "\n".join(out) + "\n"
