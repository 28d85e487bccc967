#!/bin/bash
# hpctrain 0.1.0: batch script for run finetune-offload.
# Rendered from the resolved spec; change the run file or flags and re-submit instead of editing.
#SBATCH --cpus-per-task=8
#SBATCH --error=/runs/r1/submitit/%j_0_log.err
#SBATCH --export=ALL
#SBATCH --gpus-per-node=1
#SBATCH --job-name=finetune-offload
#SBATCH --mem=64G
#SBATCH --no-requeue
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/runs/r1/submitit/%j_0_log.out
#SBATCH --signal=USR2@90
#SBATCH --time=04:00:00

set -eo pipefail
umask 077  # run folder files stay private to the user (logs, hostfile, checkpoints)
set -u

# Plain environment from the spec and the site profile. Secrets (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, WANDB_API_KEY)
# are not written here: they reach the ranks from the submitting shell through --export=ALL.
export HPCTRAIN_RUN_DIR=/runs/r1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
# NCCL's flight recorder (PyTorch): every rank keeps its last collectives in a ring buffer and, on a NCCL
# timeout, writes them to stacks/nccl-trace-rank-R beside the Python stack dumps (`hpctrain stacks`); read
# them with `torchfrtrace RUN_DIR/stacks -p nccl-trace-rank-`. A value set in the spec's env wins.
mkdir -p "$HPCTRAIN_RUN_DIR/stacks"
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$HPCTRAIN_RUN_DIR/stacks/nccl-trace-rank-}"
export SUBMITIT_EXECUTOR=slurm

# The job is --no-requeue, so a lost node ends it and the supervisor resubmits it without that host. Rank 0
# makes it requeueable only for its own time-limit/preemption requeue; this rerun turns that off again.
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  scontrol update JobId="$SLURM_JOB_ID" Requeue=0 || true
fi

# Rendezvous: rank 0 lives on the first host; the port derives from the job id so that jobs
# sharing a node do not collide. The whole list is read before taking its first line: a pipe into
# `head -n 1` would end scontrol with SIGPIPE on a large allocation, and pipefail would end the job.
HPCTRAIN_HOSTS="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
MASTER_ADDR="${HPCTRAIN_HOSTS%%$'\n'*}"
export MASTER_ADDR
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 11999))  # below the ephemeral range; +1 is the pre-flight's

# DeepSpeed hostfile for this allocation, in hostfile.j2's format (as `hpctrain hostfile` prints it), written
# aside then renamed; no host, or one listed twice, means a broken allocation.
awk 'NF == 0 { next } seen[$1]++ { print "hpctrain: host " $1 " is listed twice in the allocation; refusing to start" > "/dev/stderr"; exit 1 } { print "" $1 " slots=1" }' <<<"$HPCTRAIN_HOSTS" > "$HPCTRAIN_RUN_DIR/hostfile.tmp"
if [ ! -s "$HPCTRAIN_RUN_DIR/hostfile.tmp" ]; then
  echo "hpctrain: SLURM_JOB_NODELIST gave no hosts; refusing to start" >&2
  exit 1
fi
mv -f "$HPCTRAIN_RUN_DIR/hostfile.tmp" "$HPCTRAIN_RUN_DIR/hostfile"

# Hang watchdog (hpctrain.fault.supervisor), outside the ranks so a hung Python cannot stop it: when no rank
# advances for 300 s it names the silent ranks in metrics/watchdog.jsonl and cancels the job;
# the supervisor job then retries the run from its latest complete checkpoint.
/opt/venv/bin/python -m hpctrain.fault.supervisor watch "$HPCTRAIN_RUN_DIR" --timeout 300 --world 1 &
HPCTRAIN_WATCHDOG_PID=$!
trap 'kill "$HPCTRAIN_WATCHDOG_PID" 2>/dev/null || true' EXIT

# Container (apptainer): the runtime and the image must be on this node before any rank starts.
HPCTRAIN_GUARD='"$0" -c "import hpctrain, submitit" 2>/dev/null || { echo "hpctrain: apptainer container check failed on $(uname -n): the image has no $0 with hpctrain inside. Fix: build the image from hpctrain'"'"'s Dockerfile (hpctrain image build) and pass --container apptainer:IMAGE" >&2; exit 97; }; exec "$0" "$@"'  # run inside the image by each rank (exit 97)
hpctrain_container_error() {
  echo "hpctrain: apptainer container check failed on $(uname -n): $1. Fix: $2" >&2
  exit 2
}
command -v apptainer >/dev/null || hpctrain_container_error "apptainer is not on PATH" "install apptainer on the nodes or load its module (launch.modules in the site profile)"
[ -e /images/train.sif ] || hpctrain_container_error "image $(printf %q /images/train.sif) does not exist" "build the SIF (containers/README.md) on the shared filesystem"
# The image has no scontrol: a rank's `scontrol requeue` (submitit, after checkpointing on the time-limit
# signal) is written to the run folder instead, and carried out here when this script exits.
hpctrain_requeue_handoff() {
  local job
  [ -s "$HPCTRAIN_RUN_DIR/requeue-request" ] || return 0
  read -r job < "$HPCTRAIN_RUN_DIR/requeue-request" || true
  rm -f "$HPCTRAIN_RUN_DIR/requeue-request"
  case $job in
    *[!0-9_]* | "") echo "hpctrain: ignoring a malformed requeue request" >&2 ;;
    *) echo "hpctrain: requeueing job $job (requested inside the container)" >&2
       scontrol update JobId="$job" Requeue=1 || true  # the job is --no-requeue (see above)
       scontrol requeue "$job" || true ;;
  esac
}
trap 'hpctrain_requeue_handoff; kill "$HPCTRAIN_WATCHDOG_PID" 2>/dev/null || true' EXIT

# Launch: one task per node; the node entry starts DeepSpeed's runner with the hostfile.
srun --unbuffered --kill-on-bad-exit=1 --output /runs/r1/submitit/%j_%t_log.out --error /runs/r1/submitit/%j_%t_log.err --ntasks-per-node=1 apptainer exec --nv --bind /runs/r1:/runs/r1 --bind /shared/data/sft.jsonl:/shared/data/sft.jsonl --bind /scratch:/scratch --pwd /runs/r1 /images/train.sif sh -c "$HPCTRAIN_GUARD" python3 -u -m hpctrain.node "$HPCTRAIN_RUN_DIR" --launcher deepspeed --mode train
