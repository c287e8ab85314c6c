#!/usr/bin/env bash
# kvfleet end to end on kind: cluster, images, CRDs and operator, the tiny CPU sample, one completion.
#
#   e2e/kind/run.sh [up]     create (or reuse) the kind cluster and run the scenario
#   e2e/kind/run.sh down     delete the kind cluster
#
# Environment (all optional):
#   KVFLEET_KIND_CLUSTER   cluster name (default kvfleet; the kubectl context is kind-<name>)
#   KIND_NODE_IMAGE        kindest/node image for a new cluster (default: your kind release's; Kubernetes >= 1.30)
#   KVFLEET_SAMPLE         InferenceDeployment to apply (default manifests/samples/tiny-cpu.yaml)
#   KVFLEET_SKIP_BUILD=1   use the kvfleet/agent:dev and kvfleet/operator:dev images already in Docker
#   KVFLEET_READY_TIMEOUT  how long to wait for the InferenceDeployment to be Ready (default 600s)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE="$ROOT/e2e/kind"
CLUSTER=${KVFLEET_KIND_CLUSTER:-kvfleet}
CONTEXT="kind-$CLUSTER"
# These four must match e2e/kind/overlay/kustomization.yaml and manifests/base.
AGENT_IMAGE=kvfleet/agent:dev
OPERATOR_IMAGE=kvfleet/operator:dev
OPERATOR_NS=kvfleet-system
OPERATOR_DEPLOY=kvfleet-operator
SAMPLE=${KVFLEET_SAMPLE:-$ROOT/manifests/samples/tiny-cpu.yaml}
READY_TIMEOUT=${KVFLEET_READY_TIMEOUT:-600s}
MIN_K8S_MINOR=30  # agent pods stop with a preStop `sleep` action: beta and on by default from Kubernetes 1.30
OWNER_LABEL=serving.kvfleet.dev/inference-deployment  # on every agent pod (operator/kvfleet_operator/builders.py)

WORK="" PF_PID="" REUSED=0 ROLLED=0
NAME="" NAMESPACE="" MODEL="" HOST_PATH="" PVC="" IMAGE="" HTTP_PORT=""
cleanup() {
  if [[ -n "$PF_PID" ]]; then kill "$PF_PID" 2>/dev/null || true; fi
  if [[ -n "$WORK" ]]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT

step() { printf '\n==> %s\n' "$*"; }
info() { printf '    %s\n' "$*"; }
die() { printf '\nerror: %s\n' "$*" >&2; exit 1; }
k() { kubectl --context "$CONTEXT" "$@"; }  # never whatever the current context happens to be

need() {  # need CMD INSTALL-HINT
  command -v "$1" >/dev/null 2>&1 || die "'$1' is not on PATH. Install it: $2"
}

preflight() {
  need docker "https://docs.docker.com/engine/install/"
  need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation (or: go install sigs.k8s.io/kind@latest)"
  need kubectl "https://kubernetes.io/docs/tasks/tools/#kubectl"
  need curl "with your package manager (apt-get install curl, dnf install curl, brew install curl)"
  docker info >/dev/null 2>&1 ||
    die "docker cannot reach a Docker engine. Is it running, and may this user use it? Try: docker info"
  local version major minor
  version=$(kind version 2>/dev/null || true)
  read -r major minor <<<"$(sed -n 's/^kind v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' <<<"$version")"
  # kind 0.23 is the first whose default node image is Kubernetes 1.30 (see MIN_K8S_MINOR). Older kind works only
  # with KIND_NODE_IMAGE naming a 1.30+ image built for it, which kind 0.20-0.22 releases do not list.
  if (( ${major:-0} == 0 && ${minor:-0} < 23 )) && [[ -z "${KIND_NODE_IMAGE:-}" ]]; then
    die "kind >= 0.23 is needed (found: ${version:-none}); see https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
  fi
}

cluster_exists() { kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; }

cluster_up() {
  if cluster_exists; then
    step "reusing kind cluster '$CLUSTER' (start afresh with: $0 down)"
    REUSED=1
    kind export kubeconfig --name "$CLUSTER" >/dev/null  # recreates context $CONTEXT if it was removed
  else
    step "creating kind cluster '$CLUSTER' (one control plane, one worker)"
    local image_args=()
    if [[ -n "${KIND_NODE_IMAGE:-}" ]]; then image_args=(--image "$KIND_NODE_IMAGE"); fi
    kind create cluster --name "$CLUSTER" --config "$HERE/cluster.yaml" ${image_args[@]+"${image_args[@]}"} --wait 180s
  fi
  k get nodes -o wide
  local minor  # the server's minor version is the last "minor" in the JSON (client first, then server)
  minor=$(k version -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | tail -1)
  if [[ -n "$minor" ]] && (( minor < MIN_K8S_MINOR )); then
    die "the cluster runs Kubernetes 1.$minor; kvfleet needs 1.$MIN_K8S_MINOR or later. Use kind >= 0.23, or set KIND_NODE_IMAGE to a kindest/node v1.$MIN_K8S_MINOR+ image from your kind release's notes; then: $0 down && $0"
  fi
}

build_images() {
  if [[ "${KVFLEET_SKIP_BUILD:-0}" == 1 ]]; then
    step "KVFLEET_SKIP_BUILD=1: using the images already in Docker"
    local img
    for img in "$AGENT_IMAGE" "$OPERATOR_IMAGE"; do
      docker image inspect "$img" >/dev/null 2>&1 || die "image $img is not in Docker; run without KVFLEET_SKIP_BUILD=1"
    done
  else
    # Each Dockerfile has its own <Dockerfile>.dockerignore, which only BuildKit reads (Docker's default since 23.0).
    step "building $AGENT_IMAGE from docker/agent.Dockerfile (the first build downloads PyTorch: minutes)"
    # The tiny sample runs on CPU: CPU torch wheels keep the image small (TORCH_INDEX_URL= for the CUDA ones).
    DOCKER_BUILDKIT=1 docker build -f "$ROOT/docker/agent.Dockerfile" -t "$AGENT_IMAGE" \
        --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}" "$ROOT"
    step "building $OPERATOR_IMAGE from docker/operator.Dockerfile"
    DOCKER_BUILDKIT=1 docker build -f "$ROOT/docker/operator.Dockerfile" -t "$OPERATOR_IMAGE" "$ROOT"
  fi
  step "loading both images into the nodes (kind skips a node that already has the same image)"
  kind load docker-image --name "$CLUSTER" "$AGENT_IMAGE" "$OPERATOR_IMAGE"
}

install_operator() {
  step "installing the CRDs and the operator: manifests/base through e2e/kind/overlay"
  kubectl kustomize "$HERE/overlay" >"$WORK/install.yaml"
  grep -q "image: $OPERATOR_IMAGE\$" "$WORK/install.yaml" ||
    die "e2e/kind/overlay no longer sets the operator image (did the image name in manifests/base change?)"
  grep -q "value: $AGENT_IMAGE\$" "$WORK/install.yaml" ||
    die "e2e/kind/overlay no longer sets KVFLEET_AGENT_IMAGE (did the Deployment or container name in manifests/base change?)"
  # Server-side, as manifests/base asks. The base applies in one pass; the CRDs go first anyway so that the wait
  # below sees them served before the operator starts (crds/ is the base's CRD kustomization).
  k apply --server-side -k "$ROOT/crds"
  k wait --for=condition=Established --timeout=60s \
    crd/inferencedeployments.serving.kvfleet.dev crd/clusterkopfpeerings.kopf.dev crd/kopfpeerings.kopf.dev
  k apply --server-side -f "$WORK/install.yaml"
  if [[ "$REUSED" == 1 ]]; then  # a rebuilt :dev image has the same name, so the spec alone would not roll it
    k -n "$OPERATOR_NS" rollout restart "deployment/$OPERATOR_DEPLOY"
  fi
  k -n "$OPERATOR_NS" rollout status "deployment/$OPERATOR_DEPLOY" --timeout=180s || {
    k -n "$OPERATOR_NS" get pods -o wide || true
    die "the operator is not ready; see: kubectl --context $CONTEXT -n $OPERATOR_NS logs deployment/$OPERATOR_DEPLOY"
  }
}

read_sample() {
  [[ -f "$SAMPLE" ]] || die "no sample at $SAMPLE (set KVFLEET_SAMPLE)"
  # A server-side dry run validates the sample against the CRD and fills in its namespace.
  local fields
  fields=$(k apply --dry-run=server -f "$SAMPLE" -o 'jsonpath={.metadata.name}|{.metadata.namespace}|{.spec.model.name}|{.spec.model.source.hostPath.path}|{.spec.model.source.pvc.claimName}|{.spec.image}')
  IFS='|' read -r NAME NAMESPACE MODEL HOST_PATH PVC IMAGE <<<"$fields"
  [[ -n "$NAME" && -n "$NAMESPACE" && -n "$MODEL" ]] ||
    die "could not read the name, namespace and model name of $SAMPLE (got '$fields')"
  if [[ -n "$IMAGE" && "$IMAGE" != "$AGENT_IMAGE" ]]; then
    info "note: the sample sets spec.image=$IMAGE; the cluster must be able to pull it (or remove the field to use $AGENT_IMAGE)"
  fi
  if [[ -n "$PVC" ]]; then
    die "$SAMPLE reads its model from PVC '$PVC'; this script only prepares a hostPath model (use the tiny CPU sample)"
  fi
}

place_model() {
  if [[ -z "$HOST_PATH" ]]; then
    info "the model is inside the agent image; nothing to place"
    return
  fi
  step "writing the tiny random model to $HOST_PATH on every node (the sample's hostPath)"
  # `kvfleet-agent model init-tiny` runs once in the agent image; its output is streamed as a tar into each kind
  # node container (docker exec), where the agent pods mount it read-only as a hostPath of type Directory.
  docker run --rm --entrypoint sh "$AGENT_IMAGE" -c \
    'kvfleet-agent model init-tiny /tmp/tiny >/dev/null && tar -C /tmp/tiny -cf - .' >"$WORK/tiny.tar"
  local node
  for node in $(kind get nodes --name "$CLUSTER"); do
    # shellcheck disable=SC2016  # $1 expands inside the node, not here
    docker exec -i "$node" sh -c 'mkdir -p "$1" && find "$1" -mindepth 1 -delete && tar -C "$1" -xf - && chmod -R a+rX "$1"' \
      sh "$HOST_PATH" <"$WORK/tiny.tar"
    info "$node:$HOST_PATH: $(docker exec "$node" ls "$HOST_PATH" | tr '\n' ' ')"
  done
}

deploy_sample() {
  step "applying ${SAMPLE#"$ROOT"/}: InferenceDeployment $NAMESPACE/$NAME, served model '$MODEL'"
  k apply -f "$SAMPLE"
  if [[ "$REUSED" == 1 ]] && k -n "$NAMESPACE" get deployment "$NAME" >/dev/null 2>&1; then
    # Agents of an earlier run may hold an older :dev image; roll them (maxUnavailable 0 keeps one serving).
    k -n "$NAMESPACE" rollout restart "deployment/$NAME"
    ROLLED=1
  fi
  step "waiting up to $READY_TIMEOUT for InferenceDeployment $NAME to be Ready"
  if ! k -n "$NAMESPACE" wait --for=condition=Ready "inferencedeployment/$NAME" --timeout="$READY_TIMEOUT"; then
    k -n "$NAMESPACE" describe "inferencedeployment/$NAME" || true
    k -n "$NAMESPACE" get pods -l "$OWNER_LABEL=$NAME" -o wide || true
    k -n "$OPERATOR_NS" logs "deployment/$OPERATOR_DEPLOY" --tail=40 || true
    die "InferenceDeployment $NAME is not Ready after $READY_TIMEOUT (see above; agent logs: kubectl --context $CONTEXT -n $NAMESPACE logs -l $OWNER_LABEL=$NAME)"
  fi
  if [[ "$ROLLED" == 1 ]]; then k -n "$NAMESPACE" rollout status "deployment/$NAME" --timeout="$READY_TIMEOUT"; fi
  k -n "$NAMESPACE" get inferencedeployment "$NAME"
}

complete_once() {
  local port log="$WORK/port-forward.log" local_port="" url body _
  port=$(k -n "$NAMESPACE" get service "$NAME" -o 'jsonpath={.spec.ports[?(@.name=="http")].port}')
  [[ -n "$port" ]] || die "Service $NAMESPACE/$NAME has no port named http"
  HTTP_PORT=$port
  step "port-forwarding service/$NAME (port http: $port) and sending one completion"
  # kubectl itself in the background (not the k function), so that $! is its pid and the kill below reaches it.
  kubectl --context "$CONTEXT" -n "$NAMESPACE" port-forward "service/$NAME" ":$port" >"$log" 2>&1 &  # a free local port
  PF_PID=$!
  for _ in $(seq 1 100); do
    local_port=$(sed -n 's/^Forwarding from 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$log" | head -1)
    if [[ -n "$local_port" ]] || ! kill -0 "$PF_PID" 2>/dev/null; then break; fi
    sleep 0.2
  done
  [[ -n "$local_port" ]] || { cat "$log" >&2; die "kubectl port-forward did not start (its output is above)"; }
  url="http://127.0.0.1:$local_port/v1/completions"
  body="{\"model\": \"$MODEL\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 16, \"temperature\": 0}"
  info "POST $url"
  info "$body"
  curl -fsS --retry 5 --retry-connrefused --retry-delay 1 --max-time 60 \
    -H 'Content-Type: application/json' -d "$body" "$url" || die "the completion request failed"
  printf '\n'
  info "(random weights: expect fluent-looking noise, not sense)"
  kill "$PF_PID" 2>/dev/null || true
  wait "$PF_PID" 2>/dev/null || true
  PF_PID=""
}

next_steps() {
  cat <<EOF

==> done: InferenceDeployment $NAMESPACE/$NAME serves '$MODEL' on kind cluster '$CLUSTER' (context $CONTEXT)

Watch it (replicas, conditions, the last scaling decision and its reason):
  kubectl --context $CONTEXT -n $NAMESPACE get infd -w
  kubectl --context $CONTEXT -n $NAMESPACE describe infd $NAME
  kubectl --context $CONTEXT -n $NAMESPACE get pods -l $OWNER_LABEL=$NAME -w
  kubectl --context $CONTEXT -n $OPERATOR_NS logs deployment/$OPERATOR_DEPLOY -f

Make it scale (the sample has autoscaling off; each replica requests 1 CPU and 2Gi; the agents' NetworkPolicy
admits pods labelled serving.kvfleet.dev/client=true):
  kubectl --context $CONTEXT -n $NAMESPACE patch infd $NAME --type merge \\
    -p '{"spec": {"autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 3, "targets": {"queueDepthPerReplica": 2}}}}'
  kubectl --context $CONTEXT -n $NAMESPACE run kvfleet-load --rm -i --restart=Never --image=$AGENT_IMAGE \\
    --labels=serving.kvfleet.dev/client=true --image-pull-policy=IfNotPresent -- bench serve --url http://$NAME:$HTTP_PORT --concurrency 32 --duration 180 --max-tokens 64

Talk to it:
  kubectl --context $CONTEXT -n $NAMESPACE port-forward service/$NAME 8000:http
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$MODEL", "prompt": "Hello", "max_tokens": 16}'
  curl -s localhost:8000/metrics | grep '^kvfleet_requests_'

Tear down:
  $0 down
EOF
}

up() {
  preflight
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfleet-kind.XXXXXX")
  cluster_up
  build_images
  install_operator
  read_sample
  place_model
  deploy_sample
  complete_once
  next_steps
}

down() {
  need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
  if cluster_exists; then
    step "deleting kind cluster '$CLUSTER'"
    kind delete cluster --name "$CLUSTER"
  else
    info "no kind cluster named '$CLUSTER'; nothing to delete"
  fi
  info "the images stay in Docker; remove them with: docker rmi $AGENT_IMAGE $OPERATOR_IMAGE"
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  -h | --help | help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) die "unknown command '$1' (use: up, down or --help)" ;;
esac
