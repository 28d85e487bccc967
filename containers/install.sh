#!/bin/bash
# install.sh — the Python side of the hpctrain image, one step per call (run by the Dockerfile's RUN lines).
#
#   install.sh python                   a python3 with venv (apt-get only when the base has none: Debian/Ubuntu)
#   install.sh torch SPEC               /opt/venv (sees the base's site-packages), then torch: SPEC such as
#                                       torch==2.13.0, or "base" to keep the base image's own torch (NGC)
#   install.sh compiler OPS             g++ and Python headers, only when OPS (DeepSpeed ops to prebuild) is not empty
#   install.sh deepspeed OPS SPEC       the DeepSpeed wheel into /wheelhouse/deps, with the ops in OPS prebuilt
#                                       (e.g. "CPU_ADAM FUSED_ADAM"; empty = pure python, ops JIT on first use)
#   install.sh requirements PYPROJECT   hpctrain's + its [node] extra's requirements -> /wheelhouse/deps/requirements.txt
#   install.sh hpctrain-wheel SRC       the hpctrain wheel into /wheelhouse/hpctrain
#   install.sh deps DIR                 install DIR's deepspeed wheel and requirements.txt, never touching torch
#   install.sh hpctrain DIR             install DIR's hpctrain wheel (--no-deps) and check the imports
#
# The steps are split so that a change to hpctrain's sources rebuilds only the last, small layers.
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

step_deepspeed() {
  local ops=${1:-} ds_spec=${2:?deepspeed spec} op
  "${PIP[@]}" install ninja "setuptools>=68" wheel
  # DS_BUILD_OPS=0 then one DS_BUILD_<OP>=1 per requested op: only those are compiled into the wheel.
  local -a env=(DS_BUILD_OPS=0 "MAX_JOBS=$(nproc)")
  for op in $ops; do
    [[ $op =~ ^[A-Z0-9_]+$ ]] || die "DS_BUILD_OPS_SET entry '$op' is not an op name such as CPU_ADAM"
    env+=("DS_BUILD_$op=1")
  done
  env "${env[@]}" PATH="$VENV/bin:$PATH" "${PIP[@]}" wheel --no-build-isolation --no-deps -w /wheelhouse/deps "$ds_spec"
}

step_requirements() {
  local pyproject=${1:?pyproject.toml}
  mkdir -p /wheelhouse/deps
  # hpctrain's requirements plus its [node] extra, read from pyproject.toml alone (so this layer, and the
  # runtime layer that installs them, stay cached while only hpctrain's sources change). Not torch (already
  # installed) nor deepspeed (the wheel built above).
  "$VENV/bin/python" - "$pyproject" >/wheelhouse/deps/requirements.txt <<'PY'
import sys

from pip._vendor import tomli  # pip's own copies: nothing to install, any python version
from pip._vendor.packaging.requirements import Requirement

with open(sys.argv[1], "rb") as f:
    project = tomli.load(f)["project"]
for text in project["dependencies"] + project["optional-dependencies"]["node"]:
    req = Requirement(text)
    if req.name in ("torch", "deepspeed") or (req.marker and not req.marker.evaluate()):
        continue
    print(str(req).split(";")[0])
PY
  cat /wheelhouse/deps/requirements.txt
}

step_hpctrain_wheel() {
  local src=${1:?hpctrain source folder}
  "${PIP[@]}" wheel --no-build-isolation --no-deps -w /wheelhouse/hpctrain "$src"
}

step_deps() {
  local house=${1:?folder with the deepspeed wheel and requirements.txt} ds
  ds=$(compgen -G "$house/deepspeed-*.whl") || die "no deepspeed wheel in $house"
  # torch is pinned to what is installed, so nothing here can replace it (a base image's CUDA build stays).
  "$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__)' >/tmp/torch-pin.txt
  "${PIP[@]}" install -c /tmp/torch-pin.txt "$ds" -r "$house/requirements.txt"
  rm -f /tmp/torch-pin.txt
}

step_hpctrain() {
  local house=${1:?folder with the hpctrain wheel} hp
  hp=$(compgen -G "$house/hpctrain-*.whl") || die "no hpctrain wheel in $house"
  "${PIP[@]}" install --no-deps "$hp"
  "$VENV/bin/python" -c 'import hpctrain.node, deepspeed, transformers, submitit; print("install.sh: hpctrain", hpctrain.__version__, "deepspeed", deepspeed.__version__)'
}

cmd=${1:-}
shift || true
case $cmd in
python) step_python ;;
torch) step_torch "$@" ;;
compiler) step_compiler "$@" ;;
deepspeed) step_deepspeed "$@" ;;
requirements) step_requirements "$@" ;;
hpctrain-wheel) step_hpctrain_wheel "$@" ;;
deps) step_deps "$@" ;;
hpctrain) step_hpctrain "$@" ;;
*) die "usage: install.sh python|torch SPEC|compiler OPS|deepspeed OPS SPEC|requirements PYPROJECT|hpctrain-wheel SRC|deps DIR|hpctrain DIR" ;;
esac
