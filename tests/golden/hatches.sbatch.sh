#!/bin/bash
# hpctrain 0.1.0: batch script for run hatches.
# Rendered from the resolved spec; change the run file or flags and re-submit instead of editing.
#SBATCH --cpus-per-task=1
#SBATCH --dependency=afterok:12,afterany:13_2
#SBATCH --error=/runs/r1/submitit/%j_0_log.err
#SBATCH --export=ALL
#SBATCH --job-name=hatches
#SBATCH --mail-type=END,FAIL
#SBATCH --mail-user=me+ml@example.org
#SBATCH --no-requeue
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/runs/r1/submitit/%j_0_log.out
#SBATCH --signal=USR2@90
#SBATCH --time=00:10:00
#SBATCH --exclusive
#SBATCH --reservation='my res;$(id)`x`'"'"'q'"'"'#c'
#SBATCH --nice=10

set -eo pipefail
umask 077  # run folder files stay private to the user (logs, hostfile, checkpoints)
set -u

# Plain environment from the spec and the site profile. Secrets (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, WANDB_API_KEY)
# are not written here: they reach the ranks from the submitting shell through --export=ALL.
export HPCTRAIN_RUN_DIR=/runs/r1
# submit --snapshot: the job runs the copy of the code taken at submit, not the folder it was submitted from.
cd '/runs/r1/code/sub dir'
export PYTHONPATH='/runs/r1/code/sub dir'"${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export DS_ACCELERATOR=cpu
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
/opt/venv/bin/python -m hpctrain.fault.supervisor watch "$HPCTRAIN_RUN_DIR" --timeout 300 --world 2 &
HPCTRAIN_WATCHDOG_PID=$!
trap 'kill "$HPCTRAIN_WATCHDOG_PID" 2>/dev/null || true' EXIT

# Launch: srun starts 1 task(s) per node, one per rank, each running submitit's job.
srun --unbuffered --kill-on-bad-exit=1 --output /runs/r1/submitit/%j_%t_log.out --error /runs/r1/submitit/%j_%t_log.err /opt/venv/bin/python -u -m submitit.core._submit /runs/r1/submitit
