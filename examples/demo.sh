#!/usr/bin/env bash
# `make demo`: train examples/tiny.toml on this machine with the local executor (2 CPU ranks, ZeRO-3,
# checkpoint every 5 steps), preempt it with SIGUSR2 the way SLURM does before a time limit (every rank
# checkpoints at the next step boundary, submitit requeues the job, the ranks resume from that
# checkpoint), then print the run's summary. No GPU, no cluster, no downloads; about a minute.
#
#   bash examples/demo.sh            # uses ./runs and a private state dir unless HPCTRAIN_* are set
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"   # one ninja/python on PATH for the ranks (see recipes)
export HPCTRAIN_RUNS_DIR=${HPCTRAIN_RUNS_DIR:-$PWD/runs}
HPC="hpctrain"
PY="$VENV/bin/python"

wait_done() {  # poll the registry until the run leaves PENDING/RUNNING (bounded: 10 minutes)
  local run=$1 state=""
  for _ in $(seq 1 600); do
    state=$($HPC status "$run" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["state"])')
    case "$state" in PENDING|RUNNING|REQUEUED|"") sleep 1 ;; *) echo "$state"; return 0 ;; esac
  done
  echo "TIMEOUT"; return 1
}

echo "== 1. plan"
$HPC plan examples/tiny.toml

echo "== 2. train on the local executor (2 ranks, ZeRO-3, checkpoint every 5 steps)"
run_json=$($HPC submit examples/tiny.toml --executor local --steps 40 --json)
run=$(echo "$run_json" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[0]["run_id"])')
folder=$(echo "$run_json" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[0]["run_dir"])')
job=$(echo "$run_json" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[0]["job_id"])')
echo "run $run in $folder (local job $job)"

echo "== 3. preempt it: SIGUSR2 (what SLURM sends before the time limit) -> checkpoint, requeue, resume"
for _ in $(seq 1 600); do  # until 8 steps are done (bounded: 2 minutes)
  n=0
  [ -f "$folder/metrics/metrics.jsonl" ] && n=$(wc -l < "$folder/metrics/metrics.jsonl")
  [ "$n" -ge 8 ] && break
  sleep 0.2
done
# The local job id is the controller's pid; its children are the two ranks.
mapfile -t ranks < <(ps -o pid= --ppid "$job" || true)
[ "${#ranks[@]}" -gt 0 ] && kill -USR2 "${ranks[@]}"
echo "attempt finished: $(wait_done "$run")"
grep -h "signal 12\|resumed from" "$folder"/logs/attempt-0.rank-0.log || true
echo "latest checkpoint: $(cat "$folder/checkpoints/latest")"

echo "== 4. summary"
$HPC summary "$run"
echo "exported model: $folder/hf"
echo "TensorBoard events (loss, lr, tokens/s, memory, checkpoint seconds, eval loss by step): $folder/metrics/tensorboard"
echo "  view: tensorboard --logdir $folder/metrics/tensorboard   replay into W&B: hpctrain sync $run --to wandb"
$HPC list
