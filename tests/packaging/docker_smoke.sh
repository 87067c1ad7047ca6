#!/usr/bin/env bash
# Builds both images of the Dockerfile and checks what they promise. The operator image (target
# `operator`): non-root, no torch, every operator module imports, the operator's entry point and
# the chart's init-container script on a read-only root filesystem. The runtime image (target
# `runtime`): non-root user, both entry points, a short real training run of the toy model with a
# read-only root filesystem. Prints both images' sizes. Needs a running Docker daemon ($DOCKER_HOST
# or the default socket) that can reach the Python package index (build step `pip install`).
#
# Usage: tests/packaging/docker_smoke.sh [--local-base]
#   --local-base  build the base image here first: a minimal Debian rootfs made with debootstrap
#                 from the machine's configured Debian mirror (for hosts that cannot pull
#                 images), imported as preemptible-base:local and passed as BASE_IMAGE.
# Environment: IMAGE (runtime image, preemptible:smoke), OPERATOR_IMAGE (preemptible-operator:smoke),
# BASE_IMAGE (Dockerfile default), TORCH_INDEX_URL, DOCKER (docker), BUILD_NETWORK (host).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
IMAGE="${IMAGE:-preemptible:smoke}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-preemptible-operator:smoke}"
DOCKER="${DOCKER:-docker}"
BUILD_NETWORK="${BUILD_NETWORK:-host}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
BASE_IMAGE="${BASE_IMAGE:-}"

log() { printf '==> [docker-smoke %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() {
  printf 'ERROR [docker-smoke]: %s\n' "$*" >&2
  exit 1
}

# Every run re-tags the same names: the images they replace (about 6 GB each) and the containers of
# a failed build would pile up in the engine's data directory until the disk is full.
cleanup() {
  "$DOCKER" container prune -f >/dev/null 2>&1 || true
  "$DOCKER" image prune -f >/dev/null 2>&1 || true
}
trap cleanup EXIT

local_base() {
  command -v debootstrap >/dev/null || die "--local-base needs debootstrap (apt-get install debootstrap)"
  local mirror rootfs
  mirror="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)"
  [ -n "$mirror" ] || mirror="$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)"
  [ -n "$mirror" ] || die "no Debian mirror configured in /etc/apt/sources.list(.d)"
  rootfs="$(mktemp -d)"
  log "debootstrap bookworm (python3, venv, CA certificates) from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$mirror" >/dev/null
  # The build's pip must trust what this machine trusts.
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | "$DOCKER" import - preemptible-base:local >/dev/null
  rm -rf "$rootfs"
  BASE_IMAGE=preemptible-base:local
}

[ "${1:-}" = "--local-base" ] && local_base
[ "$#" -le 1 ] || die "usage: $0 [--local-base]"

base_args=()
[ -z "$BASE_IMAGE" ] || base_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
run() { "$DOCKER" run --rm --network none "$@"; }
size_mb() { echo "$(("$("$DOCKER" image inspect -f '{{.Size}}' "$1")" / 1000000))"; }

# ------------------------------------------------------------------------------ operator image
log "docker build --target operator -t $OPERATOR_IMAGE ${base_args[*]}"
"$DOCKER" build --network "$BUILD_NETWORK" "${base_args[@]}" --target operator \
  -t "$OPERATOR_IMAGE" "$repo"

log "operator image: non-root, no torch, the operator's entry point"
[ "$(run "$OPERATOR_IMAGE" id -u)" != 0 ] || die "the operator image runs as root"
if run "$OPERATOR_IMAGE" python -c 'import torch' >/dev/null 2>&1; then
  die "torch is importable in the operator image"
fi
run --read-only --tmpfs /tmp "$OPERATOR_IMAGE" preemptible-operator --help >/dev/null
run --read-only --tmpfs /tmp "$OPERATOR_IMAGE" preemptible-operator run --help >/dev/null
run --read-only --tmpfs /tmp "$OPERATOR_IMAGE" python -c \
  'import importlib, pkgutil, sys, preemptible_operator as p
for m in pkgutil.iter_modules(p.__path__):
    importlib.import_module(f"preemptible_operator.{m.name}")
assert "torch" not in sys.modules'
cmd="$("$DOCKER" image inspect -f '{{json .Config.Cmd}}' "$OPERATOR_IMAGE")"
[ "$cmd" = '["preemptible-operator","run","--all-namespaces"]' ] || die "unexpected CMD $cmd"

log "the chart's init-container script compiles in the operator image"
"$DOCKER" run --rm --network none --read-only -i "$OPERATOR_IMAGE" python -c \
  'import sys; compile(sys.stdin.read(), "ensure_peering.py", "exec"); import kubernetes' \
  <"$repo/charts/preemptible/files/ensure_peering.py"

# ------------------------------------------------------------------------------- runtime image
build_args=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" "${base_args[@]}")
log "docker build -t $IMAGE ${build_args[*]}"
"$DOCKER" build --network "$BUILD_NETWORK" "${build_args[@]}" -t "$IMAGE" "$repo"

log "runtime image: runs as a non-root user"
uid="$(run "$IMAGE" id -u)"
[ "$uid" != 0 ] || die "the image runs as root"

log "entry points"
run "$IMAGE" preemptible-operator --help >/dev/null
run "$IMAGE" preemptible-operator run --help >/dev/null
run "$IMAGE" trainer-runtime --help >/dev/null
cmd="$("$DOCKER" image inspect -f '{{json .Config.Cmd}}' "$IMAGE")"
[ "$cmd" = '["preemptible-operator","run","--all-namespaces"]' ] || die "unexpected CMD $cmd"

log "a short training run with a checkpoint, read-only root filesystem, as another uid"
run --read-only --tmpfs /tmp --user 1000:1000 "$IMAGE" \
  python -m trainer_runtime.toy --max-steps 4 --save-steps 2 --output-dir /tmp/out >/dev/null
run --read-only --tmpfs /tmp "$IMAGE" sh -c \
  'python -m trainer_runtime.toy --max-steps 4 --save-steps 2 --output-dir /tmp/out >/dev/null \
   && test -f /tmp/out/checkpoint-4/manifest.json'

log "image sizes: operator $OPERATOR_IMAGE $(size_mb "$OPERATOR_IMAGE") MB, runtime $IMAGE $(size_mb "$IMAGE") MB"
log "all checks passed"
