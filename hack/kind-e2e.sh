#!/usr/bin/env bash
# End-to-end test on a throwaway kind cluster (needs Docker, kind, kubectl):
#   1. builds the operator and CPU runtime images and loads them into kind,
#   2. installs the Helm chart (CRD, operator, RBAC),
#   3. makes the tiny trained model of crds/samples/tiny-cpu.yaml with
#      `mtp make-tiny` in a host folder mounted into the kind node (hostPath),
#   4. applies the sample, waits for Ready (export Job, then the rank pods),
#   5. sends a completion through the client Service (kubectl port-forward),
#   6. prints the status with the acceptance rate,
# and deletes the cluster on exit (KEEP_CLUSTER=1 keeps it for debugging).
#
# Settings (environment): CLUSTER (default mtp-e2e), KEEP_CLUSTER, TIMEOUT
# (seconds to wait for Ready, default 900), LOCAL_PORT (default 18000),
# MODELS_DIR (host folder for the models, kept; default: a temporary one).
# Uses the active Python environment if it has `mtp` and helm, else sets up
# .venv with hack/setup-env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${CLUSTER:-mtp-e2e}"
KEEP_CLUSTER="${KEEP_CLUSTER:-0}"
TIMEOUT="${TIMEOUT:-900}"
LOCAL_PORT="${LOCAL_PORT:-18000}"
NAMESPACE=default
OPERATOR_NAMESPACE=mtp-system
SAMPLE=crds/samples/tiny-cpu.yaml
# The sample's hostPath; the kind node sees the host folder there.
NODE_MODELS_DIR=/tmp/mtp-models

die() {
    echo "kind-e2e: $*" >&2
    exit 1
}
log() {
    echo "==> $*" >&2
}

# ---- fail fast on missing tools, before anything is created
for tool in docker kind kubectl curl; do
    command -v "$tool" > /dev/null \
        || die "'$tool' is not installed or not on PATH; this script needs docker, kind, kubectl and curl."
done
docker info > /dev/null 2>&1 \
    || die "the Docker engine is not reachable ('docker info' failed); start Docker or fix DOCKER_HOST."
[ -f "$SAMPLE" ] || die "$SAMPLE is missing; run from a full checkout."

# The active environment when it has `mtp` and helm, else the project's .venv.
if ! command -v mtp > /dev/null || ! command -v helm > /dev/null; then
    bash hack/setup-env.sh
    # shellcheck disable=SC1091
    . "${MTP_VENV:-.venv}/bin/activate"
fi
command -v helm > /dev/null || die "helm is missing after hack/setup-env.sh (see hack/install-helm.sh)."

TAG="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/mtp-operator/Chart.yaml)"
[ -n "$TAG" ] || die "could not read appVersion from charts/mtp-operator/Chart.yaml"
SAMPLE_NAME="$(python -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$SAMPLE")"

WORK="$(mktemp -d)"
OWN_MODELS_DIR=0
if [ -z "${MODELS_DIR:-}" ]; then
    MODELS_DIR="$WORK/models"
    OWN_MODELS_DIR=1
fi
MODELS_DIR="$(mkdir -p "$MODELS_DIR" && cd "$MODELS_DIR" && pwd)"
PORT_FORWARD_PID=""
cleanup() {
    status=$?
    if [ -n "$PORT_FORWARD_PID" ]; then
        kill "$PORT_FORWARD_PID" 2> /dev/null || true
    fi
    if [ "$status" -ne 0 ] && kind get clusters 2> /dev/null | grep -qx "$CLUSTER"; then
        log "failed; operator log and resource state follow"
        kubectl -n "$OPERATOR_NAMESPACE" logs deploy/mtp-operator --tail=100 >&2 || true
        kubectl -n "$NAMESPACE" get mtpd,jobs,statefulsets,pods,services -o wide >&2 || true
    fi
    if [ "$KEEP_CLUSTER" = "1" ]; then
        log "keeping cluster $CLUSTER and $WORK (KEEP_CLUSTER=1)"
    else
        kind delete cluster --name "$CLUSTER" > /dev/null 2>&1 || true
        if [ "$OWN_MODELS_DIR" = "1" ]; then
            # Files the pods wrote belong to their uid; docker can remove them.
            rm -rf "$WORK" 2> /dev/null \
                || docker run --rm --user 0 --entrypoint rm -v "$WORK:/w" "mtp-runtime:$TAG" -rf /w/models || true
        fi
        rm -rf "$WORK" 2> /dev/null || true
    fi
    exit "$status"
}
trap cleanup EXIT INT TERM

# ---- the tiny model, on the host, visible to the node as the sample's hostPath
log "making the sample's tiny model in $MODELS_DIR (kept if already there)"
mtp up "$SAMPLE" --models-dir "$MODELS_DIR" --make-model-only
# The export Job and the ranks run as a non-root uid and write the draft here.
chmod -R a+rwX "$MODELS_DIR"

# ---- cluster
log "creating kind cluster $CLUSTER"
cat > "$WORK/kind.yaml" << EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - hostPath: $MODELS_DIR
        containerPath: $NODE_MODELS_DIR
EOF
kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml" --wait 180s
kubectl config use-context "kind-$CLUSTER" > /dev/null

# ---- images
log "building images mtp-operator:$TAG and mtp-runtime:$TAG"
docker build --target operator -t "mtp-operator:$TAG" .
docker build --target runtime -t "mtp-runtime:$TAG" .
kind load docker-image --name "$CLUSTER" "mtp-operator:$TAG" "mtp-runtime:$TAG"

# ---- operator
log "installing the chart"
helm install mtp-operator charts/mtp-operator \
    --namespace "$OPERATOR_NAMESPACE" --create-namespace \
    --set image.tag="$TAG" \
    --set settings.runtimeImage="mtp-runtime:$TAG" \
    --wait --timeout 5m
kubectl wait --for=condition=Established --timeout=60s crd/mtpdeployments.mtp.inference.dev

# ---- the sample
log "applying $SAMPLE and waiting for Ready (up to ${TIMEOUT}s)"
kubectl -n "$NAMESPACE" apply -f "$SAMPLE"
kubectl -n "$NAMESPACE" wait --for=condition=Ready --timeout="${TIMEOUT}s" "mtpd/$SAMPLE_NAME"

# The client Service: the sample's server Service that is not headless.
SERVICE="$(kubectl -n "$NAMESPACE" get services \
    -l "mtp.inference.dev/deployment=$SAMPLE_NAME" \
    -o jsonpath='{range .items[?(@.spec.clusterIP!="None")]}{.metadata.name}{"\n"}{end}' | sed -n 1p)"
[ -n "$SERVICE" ] || die "no client Service labelled mtp.inference.dev/deployment=$SAMPLE_NAME"
HTTP_PORT="$(kubectl -n "$NAMESPACE" get service "$SERVICE" \
    -o jsonpath='{.spec.ports[?(@.name=="http")].port}')"

log "port-forwarding service/$SERVICE:$HTTP_PORT to localhost:$LOCAL_PORT"
kubectl -n "$NAMESPACE" port-forward "service/$SERVICE" "$LOCAL_PORT:$HTTP_PORT" > "$WORK/port-forward.log" 2>&1 &
PORT_FORWARD_PID=$!
for _ in $(seq 1 30); do
    curl -fsS "http://127.0.0.1:$LOCAL_PORT/health" > /dev/null 2>&1 && break
    sleep 1
done
curl -fsS "http://127.0.0.1:$LOCAL_PORT/health" > /dev/null \
    || die "rank 0 is not reachable through the port-forward: $(cat "$WORK/port-forward.log")"

MODEL_ID="$(curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/models" \
    | python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
log "completion from model $MODEL_ID"
for _ in 1 2 3; do
    curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/completions" \
        -H 'Content-Type: application/json' \
        -d "{\"model\": \"$MODEL_ID\", \"prompt\": \"def main(\", \"max_tokens\": 48, \"temperature\": 0}" \
        | python -c 'import json, sys; r = json.load(sys.stdin); print(repr(r["choices"][0]["text"]), r["usage"])'
done

# ---- status, after the operator's next metrics scrape has seen the requests
log "status of mtpd/$SAMPLE_NAME"
for _ in $(seq 1 60); do
    rate="$(kubectl -n "$NAMESPACE" get "mtpd/$SAMPLE_NAME" -o jsonpath='{.status.speculative.acceptanceRate}')"
    [ -n "$rate" ] && break
    sleep 2
done
kubectl -n "$NAMESPACE" get "mtpd/$SAMPLE_NAME"
kubectl -n "$NAMESPACE" get "mtpd/$SAMPLE_NAME" -o jsonpath='{.status}' \
    | python -c 'import json, sys, yaml; print(yaml.safe_dump(json.load(sys.stdin), sort_keys=False))'
[ -n "$rate" ] || die "status.speculative.acceptanceRate never appeared"
log "acceptance rate: $rate"
log "kind e2e passed"
