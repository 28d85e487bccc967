#!/bin/bash
# hpctrain-entrypoint — the image's ENTRYPOINT (docker/podman run; Apptainer's `run` via the .def file).
#
#   IMAGE RUN_DIR [--mode train|preflight] [--launcher srun|deepspeed]   one rank: python -m hpctrain.node ...
#   IMAGE --help                                                         the node trainer's usage
#   IMAGE COMMAND [ARGS...]                                              any other command, as given
#                                                                        (hpctrain's srun line runs submitit's
#                                                                        `python3 -u -m submitit.core._submit DIR`)
# `apptainer exec`, `ch-run` and pyxis run their command directly and never pass through here.
set -euo pipefail

if [ "$#" -eq 0 ]; then
  exec python3 -m hpctrain.node --help
fi
case $1 in
-*) exec python3 -m hpctrain.node "$@" ;;
*/* | .)
  if [ -d "$1" ]; then
    exec python3 -m hpctrain.node "$@"
  fi
  ;;
esac
exec "$@"
