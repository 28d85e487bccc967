#!/usr/bin/env bash
# `make demo`: train examples/tiny.toml on this machine with the local executor (2 CPU ranks, ZeRO-3,
# checkpoint every 5 steps), crash it on purpose after step 12, resume from checkpoint step-10, and
# print the run's summary. No GPU, no cluster, no downloads; about 1-2 minutes on a laptop.
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

echo "== 2. train on the local executor; this attempt crashes on purpose after step 12"
run_json=$(HPCTRAIN_FAIL_AT_STEP=12 $HPC submit examples/tiny.toml --executor local --json)
run=$(echo "$run_json" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[0]["run_id"])')
folder=$(echo "$run_json" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[0]["run_dir"])')
echo "run $run in $folder"
echo "attempt 0: $(wait_done "$run")   latest checkpoint: $(cat "$folder/checkpoints/latest")"

echo "== 3. resume: the same run folder again; the node finds checkpoints/latest and continues"
if $HPC resubmit --help >/dev/null 2>&1; then
  $HPC resubmit "$run" --executor local
  echo "attempt 1: $(wait_done "$run")"
else
  # No `hpctrain resubmit` in this checkout yet: relaunch the ranks directly (what resubmit does).
  HPCTRAIN_ATTEMPT=1 OMP_NUM_THREADS=1 timeout 600 "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 -m hpctrain.node "$folder" >/dev/null
  echo "attempt 1 (torchrun): done"
fi
grep -h "resumed from" "$folder"/logs/attempt-1.rank-0.log || true

echo "== 4. summary"
if $HPC summary --help >/dev/null 2>&1; then
  $HPC summary "$run"
else
  "$PY" - "$folder" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
recs = [json.loads(l) for l in (run / "metrics" / "metrics.jsonl").read_text().splitlines()]
for r in recs[:: max(1, len(recs) // 10)] + recs[-1:]:
    print(f"step {r['step']:3d}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  tok/s {r['tokens_per_s']:.0f}")
print("exported model:", run / "hf")
PY
fi
$HPC list
