#!/bin/bash
# build.sh — build the hpctrain image with whatever engine this machine has, and convert it for the
# runtimes that cannot read an engine's image store (Charliecloud, Apptainer, enroot/pyxis).
#
# usage: containers/build.sh COMMAND [options]
#   deps                     apt-get podman, runc, debootstrap, charliecloud-runtime (as root; skipped when present)
#   base                     localhost/bookworm-min: a minimal Debian 12 made with debootstrap (cached)
#   build [--cpu] [--engine docker|podman] [--tag T] [--base IMAGE] [--no-cache] [--dry-run] [-- ENGINE-ARGS...]
#                            build ./Dockerfile. --cpu: the CPU test image (base localhost/bookworm-min, torch from
#                            the local wheel folder, no DeepSpeed ops prebuilt), tag localhost/hpctrain:cpu
#   charliecloud TAG DIR     the image as a Charliecloud directory (ch-convert, else podman/docker export | tar)
#   apptainer TAG SIF        print the commands that make a SIF (Apptainer is not installable here)
#   enroot TAG SQSH          print the command that makes an enroot squashfs for pyxis
#   ci                       deps, base, build --cpu, charliecloud → $HPCTRAIN_CH_IMAGE (what the tests use)
#
# Environment: ENGINE (docker|podman, default: docker when its daemon answers, else podman), WHEELS (local wheel
# folder mounted at /wheels during a podman build; default: pip's find-links, else /opt/wheels), CA_BUNDLE
# (mounted over the image's CA file so pip works behind a TLS-intercepting proxy; default: pip's cert),
# HPCTRAIN_CH_IMAGE (default /var/tmp/hpctrain-ch/hpctrain-cpu). Layers are cached by the engine: a second build
# with unchanged sources takes seconds.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
BASE_TAG=localhost/bookworm-min
CPU_TAG=localhost/hpctrain:cpu
GPU_TAG=hpctrain:latest
CH_IMAGE=${HPCTRAIN_CH_IMAGE:-/var/tmp/hpctrain-ch/hpctrain-cpu}
DRY=0

say() { printf '[build.sh %s] %s\n' "$(date +%T)" "$*" >&2; }
die() {
  echo "build.sh: ERROR: $*" >&2
  exit 1
}
run() { # print, and run unless --dry-run
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [ "$DRY" = 1 ] || "$@"
}

engine() {
  if [ -n "${ENGINE:-}" ]; then
    case $ENGINE in docker | podman) ;; *) die "ENGINE=$ENGINE: use docker or podman" ;; esac
    command -v "$ENGINE" >/dev/null || die "ENGINE=$ENGINE but '$ENGINE' is not installed. Fix: install it, or unset ENGINE"
    echo "$ENGINE"
  elif command -v docker >/dev/null && timeout 10 docker info >/dev/null 2>&1; then
    echo docker
  elif command -v podman >/dev/null; then
    echo podman
  else
    die "no container engine: docker's daemon does not answer and podman is not installed. Fix: $0 deps (as root), or install docker/podman"
  fi
}

pip_conf() { # pip_conf KEY: a value from pip's configuration (find-links, cert), first one wins
  local pip=(python3 -m pip)
  command -v pip >/dev/null && pip=(pip)
  # Read it all first: `| head -n 1` could end sed with SIGPIPE, and pipefail would end the build.
  local conf
  conf="$("${pip[@]}" config list 2>/dev/null)" || return 0
  sed -n "/^[a-z:]*\.$1='/{s/^[a-z:]*\.$1='\([^' ]*\).*/\1/p;q;}" <<<"$conf"
}

cmd_deps() {
  local need=()
  command -v podman >/dev/null || need+=(podman)
  command -v runc >/dev/null || [ -x /usr/sbin/runc ] || need+=(runc)
  command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
  command -v ch-run >/dev/null || need+=(charliecloud-runtime)
  [ "${#need[@]}" -eq 0 ] && return
  [ "$(id -u)" = 0 ] || die "missing ${need[*]}; run '$0 deps' as root (apt-get)"
  say "apt-get install ${need[*]}"
  # runc, not crun: crun fails on this host's hybrid cgroups; --no-install-recommends keeps crun/buildah out.
  apt-get -o Acquire::Retries=3 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Retries=3 install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

cmd_base() {
  local eng root
  eng=$(engine)
  if "$eng" image inspect "$BASE_TAG" >/dev/null 2>&1; then
    say "$BASE_TAG exists (cached)"
    return
  fi
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  root=$(mktemp -d /var/tmp/hpctrain-rootfs.XXXXXX)
  say "debootstrap bookworm → $root"
  # ca-certificates: pip's TLS; the libraries are what Debian's python3 links to.
  if ! /usr/sbin/debootstrap --variant=minbase --include=ca-certificates,libssl3,libsqlite3-0 bookworm "$root" \
    "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/tmp/hpctrain-debootstrap.log 2>&1; then
    rm -rf "$root"
    die "debootstrap failed; log: /tmp/hpctrain-debootstrap.log"
  fi
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/*
  printf '127.0.0.1 localhost\n' >"$root/etc/hosts" # debootstrap leaves none
  tar -C "$root" -c . | "$eng" import - "$BASE_TAG" >/dev/null
  rm -rf "$root"
  say "$BASE_TAG imported"
}

cmd_build() {
  local cpu=0 tag="" base="" eng nocache=() extra=() args=()
  while [ $# -gt 0 ]; do
    case $1 in
    --cpu) cpu=1 ;;
    --engine) ENGINE=$2 && shift ;;
    --tag) tag=$2 && shift ;;
    --base) base=$2 && shift ;;
    --no-cache) nocache=(--no-cache) ;;
    --dry-run) DRY=1 ;;
    --) shift && extra=("$@") && break ;;
    *) die "build: unknown option $1 (see the header of $0)" ;;
    esac
    shift
  done
  eng=$(engine)
  tag=${tag:-$([ "$cpu" = 1 ] && echo "$CPU_TAG" || echo "$GPU_TAG")}
  if [ "$cpu" = 1 ]; then
    base=${base:-$BASE_TAG}
    args+=(--build-arg "BASE_IMAGE=$base" --build-arg "DS_BUILD_OPS_SET=" --build-arg "DS_ACCELERATOR=cpu"
      --build-arg "TORCH_CUDA_ARCH_LIST=")
  elif [ -n "$base" ]; then
    args+=(--build-arg "BASE_IMAGE=$base")
  fi
  if [ "$eng" = podman ]; then
    local wheels=${WHEELS:-$(pip_conf find-links)} ca=${CA_BUNDLE:-$(pip_conf cert)} nofile
    wheels=${wheels:-/opt/wheels}
    nofile=$(ulimit -Hn)
    # docker format (OCI drops SHELL), runc (crun cannot run on hybrid cgroups), ulimits podman can set without CAP_SYS_RESOURCE, host network
    # so RUN steps reach the package index the way this host does.
    args+=(--format docker --runtime runc --network host --ulimit "nofile=$nofile:$nofile" --ulimit nproc=32768:32768)
    [ -d "$wheels" ] && args+=(-v "$wheels:/wheels:ro")
    [ -n "$ca" ] && [ -f "$ca" ] && args+=(-v "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
  fi
  say "building $tag with $eng (context $ROOT)"
  local t0=$SECONDS
  run "$eng" build "${nocache[@]}" "${args[@]}" "${extra[@]}" -f "$ROOT/Dockerfile" -t "$tag" "$ROOT"
  [ "$DRY" = 1 ] || say "built $tag in $((SECONDS - t0)) s"
}

cmd_charliecloud() {
  local tag=${1:?TAG} dir=${2:?DIR} eng cid tmp
  eng=$(engine)
  local id
  id=$("$eng" image inspect --format '{{.Id}}' "$tag") || die "no image $tag in $eng. Fix: $0 build"
  if [ -f "$dir/ch/hpctrain-image-id" ] && [ "$(cat "$dir/ch/hpctrain-image-id")" = "$id" ]; then
    say "$dir is already $tag (cached)"
    return
  fi
  mkdir -p "$(dirname "$dir")"
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"
  local mnt=""
  if command -v ch-convert >/dev/null; then
    run ch-convert -i "$eng" "$tag" "$tmp"
  elif [ -d "$dir/bin" ] && [ "$eng" = podman ] && command -v rsync >/dev/null &&
    mnt=$(podman image mount "$tag" 2>/dev/null) && [ -n "$mnt" ]; then
    # An update: a hard-linked copy of the old directory, then rsync only what changed (rsync writes new
    # files and renames them, so the old directory, maybe in use by running jobs, is never modified).
    cp -al "$dir" "$tmp"
    rsync -a --delete --exclude='/dev/*' --exclude=/ch "$mnt"/ "$tmp"/
    podman image unmount "$tag" >/dev/null
  else
    mkdir -p "$tmp"
    cid=$("$eng" create "$tag")
    "$eng" export "$cid" | tar -x -C "$tmp" --exclude='dev/*'
    "$eng" rm "$cid" >/dev/null
  fi
  if [ ! -f "$tmp/ch/environment" ] || [ -n "$mnt" ]; then
    # What ch-convert writes: the image's ENV, read by `ch-run --set-env`.
    mkdir -p "$tmp/ch"
    "$eng" image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$tag" | sed '/^$/d' >"$tmp/ch/environment"
  fi
  echo "$id" >"$tmp/ch/hpctrain-image-id"
  # ch-run binds the host's /etc/hosts and /etc/resolv.conf onto these; they must exist.
  touch "$tmp/etc/hosts" "$tmp/etc/resolv.conf"
  if [ -e "$dir" ]; then
    mv "$dir" "$dir.old.$$"
  fi
  mv "$tmp" "$dir"
  rm -rf "$dir.old.$$"
  say "Charliecloud image: $dir ($(du -sh "$dir" | cut -f1))"
}

cmd_apptainer() {
  local tag=${1:?TAG} sif=${2:?SIF} eng
  eng=$(engine)
  echo "# Apptainer is not installed here; on a machine that has it (and the image), run one of:"
  if [ "$eng" = docker ]; then
    printf 'apptainer build %q docker-daemon://%q\n' "$sif" "$tag"
  else
    printf '%q save --format docker-archive -o hpctrain.tar %q\n' "$eng" "$tag"
    printf 'apptainer build %q docker-archive://hpctrain.tar\n' "$sif"
  fi
  printf '# or, with the image pushed to a registry, from the definition file:\n'
  printf 'apptainer build --build-arg IMAGE=REGISTRY/%q %q %q\n' "${tag#localhost/}" "$sif" "$HERE/hpctrain.def"
}

cmd_enroot() {
  local tag=${1:?TAG} sqsh=${2:?SQSH} eng
  eng=$(engine)
  local scheme=podman
  [ "$eng" = docker ] && scheme=dockerd
  printf 'enroot import -o %q %s://%q\n' "$sqsh" "$scheme" "$tag"
}

cmd_ci() {
  cmd_deps
  cmd_base
  cmd_build --cpu
  cmd_charliecloud "$CPU_TAG" "$CH_IMAGE"
}

cmd=${1:-}
shift || true
case $cmd in
deps) cmd_deps ;;
base) cmd_base ;;
build) cmd_build "$@" ;;
charliecloud) cmd_charliecloud "$@" ;;
apptainer) cmd_apptainer "$@" ;;
enroot) cmd_enroot "$@" ;;
ci) cmd_ci ;;
*)
  sed -n '2,20p' "$0" >&2
  exit 2
  ;;
esac
