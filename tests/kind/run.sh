#!/usr/bin/env bash
# End-to-end check on a kind cluster (needs Docker and internet; our CI machines have neither, so
# .github/workflows/kind.yaml runs it on a hosted runner):
#   1. create a kind cluster            2. build both images and load them into the cluster
#   3. install Kueue                    4. install the chart (helm)
#   5. Kueue preemption example: a low-priority TrainingJob runs, a high-priority one preempts it;
#      the low one must be requeued, resume from its just-in-time checkpoint, lose no steps and
#      finish; the high one must finish.
#
# Usage: tests/kind/run.sh [--dry-run] [--keep]
#   --dry-run  print every step (commands and waits) without running anything
#   --keep     leave the cluster running at the end (default: delete it)
# Environment: CLUSTER_NAME (preemptible), IMAGE (runtime image the examples name,
# preemptible:<chart appVersion>), OPERATOR_IMAGE (the chart's, preemptible-operator:<appVersion>),
# KUEUE_VERSION
# (tests/cluster/versions.env), KIND_NODE_IMAGE (kind's default), TORCH_INDEX_URL (Docker build
# argument, empty: default index), TIMEOUT_S (per wait, 900), NAMESPACE (preemptible-demo).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

DRY_RUN=0
KEEP=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --keep) KEEP=1 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "unknown argument: $arg (expected --dry-run or --keep)" >&2
      exit 2
      ;;
  esac
done

app_version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$repo/charts/preemptible/Chart.yaml")"
pinned_kueue="$(sed -n 's/^KUEUE_VERSION=//p' "$repo/tests/cluster/versions.env")"
CLUSTER_NAME="${CLUSTER_NAME:-preemptible}"
IMAGE="${IMAGE:-preemptible:$app_version}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-preemptible-operator:$app_version}"
KUEUE_VERSION="${KUEUE_VERSION:-$pinned_kueue}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
TIMEOUT_S="${TIMEOUT_S:-900}"
NAMESPACE="${NAMESPACE:-preemptible-demo}"
RELEASE=preemptible
OPERATOR_NS=preemptible-system
KUEUE_MANIFEST="https://github.com/kubernetes-sigs/kueue/releases/download/$KUEUE_VERSION/manifests.yaml"
examples="$repo/manifests/examples"

log() { printf '==> [kind %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() {
  printf 'ERROR [kind]: %s\n' "$*" >&2
  exit 1
}

# run CMD...: execute, or only print in dry-run mode.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# wait_for DESCRIPTION CMD...: retry CMD every 5 s until it succeeds or TIMEOUT_S passes.
wait_for() {
  local what="$1"
  shift
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ wait until %s:' "$what"
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  log "waiting until $what"
  local deadline=$((SECONDS + TIMEOUT_S))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "timed out after ${TIMEOUT_S}s waiting until $what"
    sleep 5
  done
}

# tj_field NAME JSONPATH: one field of a TrainingJob ("" when unset).
tj_field() { kubectl -n "$NAMESPACE" get trainingjob "$1" -o "jsonpath={$2}" 2>/dev/null; }

tj_phase_is() { [ "$(tj_field "$1" .status.phase)" = "$2" ]; }

tj_at_least() {
  local value
  value="$(tj_field "$1" "$2")"
  [ -n "$value" ] && [ "$value" -ge "$3" ]
}

dump_state() {
  [ "$DRY_RUN" = 1 ] && return 0
  log "state of the cluster at failure"
  kubectl get trainingjobs,jobs,pods,workloads -A -o wide || true
  kubectl -n "$NAMESPACE" describe trainingjobs || true
  kubectl -n "$OPERATOR_NS" logs "deploy/$RELEASE" --tail=200 || true
  kubectl get events -A --sort-by=.lastTimestamp | tail -n 60 || true
}

cleanup() {
  local rc=$?
  [ "$rc" = 0 ] || dump_state
  if [ "$KEEP" = 0 ]; then
    run kind delete cluster --name "$CLUSTER_NAME" || true
  else
    log "cluster kept: kubectl config use-context kind-$CLUSTER_NAME"
  fi
  exit "$rc"
}

check_tools() {
  local missing=()
  for tool in docker kind kubectl helm; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$DRY_RUN" = 1 ]; then
      log "(dry run) not installed here: ${missing[*]}"
    else
      die "missing tools: ${missing[*]} (this script needs Docker, kind, kubectl and helm)"
    fi
  fi
}

main() {
  check_tools
  [ -n "$app_version" ] || die "could not read appVersion from charts/preemptible/Chart.yaml"
  [ -n "$KUEUE_VERSION" ] || die "KUEUE_VERSION is empty and tests/cluster/versions.env has none"
  trap cleanup EXIT

  log "1/5 kind cluster $CLUSTER_NAME"
  local node_image=()
  [ -z "$KIND_NODE_IMAGE" ] || node_image=(--image "$KIND_NODE_IMAGE")
  run kind create cluster --name "$CLUSTER_NAME" "${node_image[@]}" --wait 180s
  run kubectl config use-context "kind-$CLUSTER_NAME"

  log "2/5 images $OPERATOR_IMAGE (operator, no torch) and $IMAGE (runtime)"
  run docker build --target operator -t "$OPERATOR_IMAGE" "$repo"
  run docker build --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" -t "$IMAGE" "$repo"
  run kind load docker-image "$OPERATOR_IMAGE" --name "$CLUSTER_NAME"
  run kind load docker-image "$IMAGE" --name "$CLUSTER_NAME"

  log "3/5 Kueue $KUEUE_VERSION"
  run kubectl apply --server-side -f "$KUEUE_MANIFEST"
  run kubectl -n kueue-system wait deploy/kueue-controller-manager --for=condition=Available \
    "--timeout=${TIMEOUT_S}s"
  # The webhooks answer a little after the Deployment is Available; retry the first Kueue object.
  run kubectl create namespace "$NAMESPACE"
  wait_for "Kueue accepts its objects" \
    kubectl -n "$NAMESPACE" apply --server-side -f "$examples/kueue/setup.yaml"

  log "4/5 chart"
  run helm install "$RELEASE" "$repo/charts/preemptible" --namespace "$OPERATOR_NS" \
    --create-namespace --set "image.repository=${OPERATOR_IMAGE%:*}" \
    --set "image.tag=${OPERATOR_IMAGE##*:}" \
    --wait "--timeout=${TIMEOUT_S}s"
  run kubectl -n "$OPERATOR_NS" rollout status "deploy/$RELEASE" "--timeout=${TIMEOUT_S}s"

  log "5/5 Kueue preemption example"
  run kubectl -n "$NAMESPACE" apply -f "$examples/kueue/low-priority.yaml"
  wait_for "low-priority is Running with a step > 0" tj_at_least low-priority .status.progress.step 1
  run kubectl -n "$NAMESPACE" apply -f "$examples/kueue/high-priority.yaml"
  wait_for "low-priority was preempted" tj_at_least low-priority .status.preemptions 1
  wait_for "high-priority Succeeded" tj_phase_is high-priority Succeeded
  wait_for "low-priority Succeeded" tj_phase_is low-priority Succeeded
  run kubectl -n "$NAMESPACE" get trainingjobs

  if [ "$DRY_RUN" = 0 ]; then
    local attempts lost reason
    attempts="$(tj_field low-priority .status.attempt)"
    lost="$(tj_field low-priority .status.lostSteps)"
    reason="$(tj_field low-priority '.status.attempts[0].reason')"
    log "low-priority: attempts=$attempts lostSteps=${lost:-0} first attempt ended by ${reason:-?}"
    [ "${attempts:-0}" -ge 2 ] || die "low-priority ran $attempts attempt(s); expected a requeue"
    [ "${lost:-0}" = 0 ] || die "low-priority lost $lost steps; a JIT checkpoint loses none"
  fi
  log "kind end-to-end check passed"
}

main
