#!/usr/bin/env bash
# For CI (as root): makes a Docker engine available for the image smoke test when this machine can
# run one. Installs docker.io and debootstrap from Debian if missing, starts dockerd in the
# background with its data under the cache, and waits for it. Prints the DOCKER_HOST to use on
# success; exits non-zero (and the image test stays skipped) when no engine can be started.
set -uo pipefail
CACHE="${PREEMPTIBLE_CACHE:-$HOME/.cache/preemptible}"
root="$CACHE/docker"
sock="$root/docker.sock"
log() { printf '==> [docker %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# A fresh machine has no cache yet: create it before anything (the install log) is written there.
mkdir -p "$root" || { log "cannot create $root"; exit 1; }

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  [ "$(id -u)" = 0 ] || { log "not root: cannot install docker.io"; exit 1; }
  log "installing docker.io and debootstrap"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap) \
    >"$CACHE/docker-install.log" 2>&1 || { log "install failed: see $CACHE/docker-install.log"; exit 1; }
fi
mkdir -p "$root/data"
if ! DOCKER_HOST="unix://$sock" docker info >/dev/null 2>&1; then
  log "starting dockerd (data in $root/data)"
  nohup dockerd --data-root "$root/data" --host "unix://$sock" --pidfile "$root/dockerd.pid" \
    --exec-root "$root/exec" >"$root/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do
    DOCKER_HOST="unix://$sock" docker info >/dev/null 2>&1 && break
    sleep 1
  done
fi
if ! DOCKER_HOST="unix://$sock" docker info >/dev/null 2>&1; then
  log "dockerd did not start: see $root/dockerd.log"
  exit 1
fi
echo "unix://$sock"
