#!/usr/bin/env bash
# `make demo`: train examples/tiny.toml on this machine with the local executor (2 CPU ranks, ZeRO-3,
# checkpoint every 5 steps), preempt it with SIGUSR2 the way SLURM does (every rank checkpoints at the
# next step boundary, submitit requeues the job, the ranks resume from that checkpoint as attempt 1), then
# show the loss going down and the run's summary. No GPU, no cluster, no downloads; about a minute on an
# idle 2-core machine once installed (see README: durations).
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

echo "== 3. preempt it: SIGUSR2 (what SLURM sends before a time limit, or at a preemption) -> checkpoint, requeue, resume"
log0="$folder/logs/attempt-0.rank-0.log" log1="$folder/logs/attempt-1.rank-0.log"
for _ in $(seq 1 600); do  # until 8 steps are done (bounded: 2 minutes)
  n=0
  [ -f "$folder/metrics/metrics.jsonl" ] && n=$(wc -l < "$folder/metrics/metrics.jsonl")
  [ "$n" -ge 8 ] && break
  sleep 0.2
done
# The local job id is the controller's pid; its children are the two ranks.
mapfile -t ranks < <(ps -o pid= --ppid "$job" || true)
[ "${#ranks[@]}" -gt 0 ] && kill -USR2 "${ranks[@]}"
# Print each step as it happens: the ranks' stop, then the requeued attempt's resume, then the end.
wait_line() {  # FILE PATTERN: print the first matching line once it is written (bounded: 10 minutes)
  for _ in $(seq 1 3000); do
    if [ -f "$1" ] && grep -m1 -h "$2" "$1"; then return 0; fi
    sleep 0.2
  done
  echo "(no '$2' in $1 after 10 minutes)"
}
wait_line "$log0" "checkpointed at step"
wait_line "$log1" "resumed from"
echo "run finished: $(wait_done "$run") (latest checkpoint: $(cat "$folder/checkpoints/latest"))"

echo "== 4. did it learn? the loss over steps, across both attempts"
"$PY" - "$folder/metrics/metrics.jsonl" <<'PLOT'
import json, sys
loss = {}
for line in open(sys.argv[1], encoding="utf-8"):
    try:
        rec = json.loads(line)
        loss[int(rec["step"])] = float(rec["loss"])  # a step redone after the resume: its last value
    except (ValueError, KeyError, TypeError):
        continue
steps = sorted(loss)
if steps:
    vals = [loss[s] for s in steps]
    lo, hi = min(vals), max(vals)
    bars = "▁▂▃▄▅▆▇█"
    spark = "".join(bars[int((v - lo) / (hi - lo or 1) * (len(bars) - 1))] for v in vals)
    print(f"loss {vals[0]:.3f} (step {steps[0]}) -> {vals[-1]:.3f} (step {steps[-1]})   {spark}")
PLOT

echo "== 5. summary (one row per attempt: the preempted one, then the resumed one)"
$HPC summary "$run"
echo "exported model: $folder/hf"
echo "TensorBoard events (loss, lr, tokens/s, memory, checkpoint seconds by step): $folder/metrics/tensorboard"

echo "== try next"
if [ -z "${VIRTUAL_ENV:-}" ]; then  # the commands below need hpctrain on PATH in the user's own shell
  echo "hpctrain lives in $VENV/bin: run 'source $VENV/bin/activate' first (or type $VENV/bin/hpctrain)"
fi
echo "  hpctrain summary $run --plot loss.png   # loss and tokens/s, the resume marked"
echo "  hpctrain logs $run --rank 1              # one rank's log, across both attempts"
echo "  tensorboard --logdir $folder/metrics/tensorboard   # the same figures in TensorBoard"
echo "  hpctrain plan examples/llama-8b-h200.toml --site h200-single   # what an 8B model needs on one H200"
