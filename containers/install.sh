#!/bin/bash
# install.sh — the Python side of the hpctrain image, one step per call (run by the Dockerfile's RUN lines).
#
#   install.sh python                 a python3 with venv (apt-get only when the base has none: Debian/Ubuntu)
#   install.sh torch SPEC             /opt/venv (sees the base's site-packages), then torch: SPEC such as
#                                     torch==2.13.0, or "base" to keep the base image's own torch (NGC)
#   install.sh compiler OPS           g++ and Python headers, only when OPS (DeepSpeed ops to prebuild) is not empty
#   install.sh wheels OPS DS_SPEC SRC build wheels into /wheelhouse: DeepSpeed (ops in OPS prebuilt, e.g.
#                                     "CPU_ADAM FUSED_ADAM"; empty = pure-python, JIT on first use) and hpctrain
#   install.sh hpctrain WHEELHOUSE    install both wheels and hpctrain's [node] extra, never touching torch
#
# pip reads wheels from /wheels when that folder exists (a build-time mount of a local wheel folder, e.g.
# `podman build -v /opt/wheels:/wheels:ro`); otherwise it uses the configured index.
set -euo pipefail

VENV=/opt/venv
PIP=("$VENV/bin/pip" --no-cache-dir --disable-pip-version-check)
if [ -d /wheels ]; then export PIP_FIND_LINKS=/wheels; fi
# The system CA bundle (a build may mount the host's over it, for a TLS-intercepting proxy).
if [ -z "${PIP_CERT:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export PIP_CERT=/etc/ssl/certs/ca-certificates.crt
fi

die() {
  echo "install.sh: ERROR: $*" >&2
  exit 1
}

apt_install() {
  command -v apt-get >/dev/null || die "the base image has no apt-get and lacks: $*. Fix: use a Debian/Ubuntu base or one that has them"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
  rm -rf /var/lib/apt/lists/*
}

step_python() {
  if command -v python3 >/dev/null && python3 -c 'import venv, ensurepip' 2>/dev/null; then
    echo "install.sh: using the base image's $(python3 --version) at $(command -v python3)"
    return
  fi
  apt_install python3 python3-venv ca-certificates
}

step_torch() {
  local spec=${1:?torch SPEC or "base"}
  # --system-site-packages: a CUDA PyTorch base (pytorch/pytorch, NGC) keeps its own torch visible.
  [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
  if [ "$spec" = base ]; then
    "$VENV/bin/python" -c 'import torch; print("install.sh: base torch", torch.__version__)' ||
      die "TORCH_SPEC=base but the base image has no torch. Fix: pass --build-arg TORCH_SPEC=torch==2.13.0"
  else
    "${PIP[@]}" install "$spec"
  fi
}

step_compiler() {
  local ops=${1:-}
  [ -n "${ops// /}" ] || return 0
  local inc
  inc=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  if command -v g++ >/dev/null && [ -f "$inc/Python.h" ]; then return; fi
  apt_install g++ python3-dev
}

step_wheels() {
  local ops=${1:-} ds_spec=${2:?deepspeed spec} src=${3:?hpctrain source folder} op
  "${PIP[@]}" install ninja "setuptools>=68" wheel
  # DS_BUILD_OPS=0 then one DS_BUILD_<OP>=1 per requested op: only those are compiled into the wheel.
  local -a env=(DS_BUILD_OPS=0 "MAX_JOBS=$(nproc)")
  for op in $ops; do
    [[ $op =~ ^[A-Z0-9_]+$ ]] || die "DS_BUILD_OPS_SET entry '$op' is not an op name such as CPU_ADAM"
    env+=("DS_BUILD_$op=1")
  done
  env "${env[@]}" PATH="$VENV/bin:$PATH" "${PIP[@]}" wheel --no-build-isolation --no-deps -w /wheelhouse "$ds_spec"
  "${PIP[@]}" wheel --no-build-isolation --no-deps -w /wheelhouse "$src"
}

step_hpctrain() {
  local house=${1:?wheelhouse folder} hp ds
  hp=$(compgen -G "$house/hpctrain-*.whl") || die "no hpctrain wheel in $house"
  ds=$(compgen -G "$house/deepspeed-*.whl") || die "no deepspeed wheel in $house"
  # torch is pinned to what is installed, so nothing below can replace it (a base image's CUDA build stays).
  "$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__)' >/tmp/torch-pin.txt
  "${PIP[@]}" install --no-deps "$hp"
  # hpctrain's own requirements plus its [node] extra, except torch (already there; see above).
  "$VENV/bin/python" - >/tmp/hpctrain-reqs.txt <<'PY'
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement  # pip's own copy: no extra package needed

for text in requires("hpctrain") or []:
    req = Requirement(text)
    if req.name in ("torch", "deepspeed") or (req.marker and not req.marker.evaluate({"extra": "node"})):
        continue
    print(str(req).split(";")[0])
PY
  "${PIP[@]}" install -c /tmp/torch-pin.txt "$ds" -r /tmp/hpctrain-reqs.txt
  rm -f /tmp/torch-pin.txt /tmp/hpctrain-reqs.txt
  "$VENV/bin/python" -c 'import hpctrain.node, deepspeed, transformers, submitit; print("install.sh: hpctrain", hpctrain.__version__, "deepspeed", deepspeed.__version__)'
}

cmd=${1:-}
shift || true
case $cmd in
python) step_python ;;
torch) step_torch "$@" ;;
compiler) step_compiler "$@" ;;
wheels) step_wheels "$@" ;;
hpctrain) step_hpctrain "$@" ;;
*) die "usage: install.sh python | torch SPEC | compiler OPS | wheels OPS DS_SPEC SRC | hpctrain WHEELHOUSE" ;;
esac
