#!/bin/sh
# /usr/local/bin/scontrol inside the hpctrain image. The image has no SLURM client, but submitit's handler for
# the pre-timeout/preemption signal runs `scontrol requeue JOB` in rank 0 after checkpointing. This shim writes
# that request into the run folder; hpctrain's batch script, outside the container, carries it out with the real
# scontrol once srun returns. Other subcommands use a real scontrol bound into the image, if there is one.
set -eu

if [ "${1:-}" = requeue ] && [ -n "${HPCTRAIN_RUN_DIR:-}" ] && [ -d "$HPCTRAIN_RUN_DIR" ]; then
  shift
  printf '%s\n' "$*" >"$HPCTRAIN_RUN_DIR/requeue-request.tmp"
  mv -f "$HPCTRAIN_RUN_DIR/requeue-request.tmp" "$HPCTRAIN_RUN_DIR/requeue-request"
  echo "hpctrain: requeue of job $* requested; the batch script runs scontrol outside the container" >&2
  exit 0
fi
for bin in /usr/bin/scontrol /usr/local/slurm/bin/scontrol /opt/slurm/bin/scontrol; do
  if [ -x "$bin" ]; then
    exec "$bin" "$@"
  fi
done
echo "hpctrain: 'scontrol $*' is not available inside the container (no SLURM client in the image)" >&2
exit 1
