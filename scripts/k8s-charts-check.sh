#!/usr/bin/env bash
# Checks of charts/kinference-crds and charts/kinference with the real tools and a real API
# server (one started by `scripts/k8s-testenv.sh up DIR`):
#   - helm lint and helm template over every values file in charts/kinference/ci/, each
#     rendering validated by the API server (server-side dry run, after the CRDs are installed:
#     ci/epp-mode-values.yaml renders an InferencePool); values that must be refused are refused;
#   - the InferencePool CRD's schema equals upstream's (GIE, from the Go module proxy);
#   - helm install --no-hooks of both charts (no kubelet: nothing waits for pods), then the
#     objects they created (serve mode, and epp mode with the InferencePool created), and RBAC as the router's ServiceAccount: `kubectl auth can-i` for
#     allowed and denied verbs, and real requests with a token of that ServiceAccount;
#   - `k8s-testenv.sh pod-ready` gives a pod the status a kubelet would.
# Every failed check is reported; the exit status is 1 when any failed.
#
# usage: scripts/k8s-charts-check.sh DIR
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$(cd "${1:?usage: k8s-charts-check.sh DIR (of k8s-testenv.sh up)}" && pwd)"
export KUBECONFIG="$DIR/kubeconfig"
export PATH="$DIR/bin:$PATH"
CRDS="$ROOT/charts/kinference-crds"
CHART="$ROOT/charts/kinference"
GIE_VERSION=v1.6.0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failures=0

ok() { echo "  ok   $*"; }
bad() { echo "  FAIL $*"; failures=$((failures + 1)); }
# check DESCRIPTION CMD...: CMD must succeed.
check() { local d=$1; shift; if "$@" >"$WORK/out" 2>&1; then ok "$d"; else bad "$d"; sed 's/^/       /' "$WORK/out" | tail -n 15; fi; }
# refuse DESCRIPTION CMD...: CMD must fail.
refuse() { local d=$1; shift; if "$@" >"$WORK/out" 2>&1; then bad "$d (was accepted)"; else ok "$d"; fi; }
# equal DESCRIPTION WANT GOT
equal() { if [ "$2" = "$3" ]; then ok "$1 = $2"; else bad "$1: want '$2', got '$3'"; fi; }
k() { kubectl "$@"; }
jp() { kubectl get "$@" 2>/dev/null || true; }

# The plural names of our own CRDs (kinference.io), from the files `kinference crdgen` writes.
kinference_plurals() {
    local f
    for f in "$CRDS"/crds/kinference.io_*.yaml; do
        [ -e "$f" ] || continue
        "$PY" -c 'import sys, yaml
for d in yaml.safe_load_all(open(sys.argv[1])):
    if d: print(d["spec"]["names"]["plural"])' "$f"
    done
}

lint_and_template() {
    echo "== helm lint, helm template (+ server-side dry run)"
    check "lint kinference-crds" helm lint --strict "$CRDS"
    check "lint kinference-crds installInferencePool=true" helm lint --strict "$CRDS" --set installInferencePool=true
    k create namespace chart-ci >/dev/null
    k create namespace models >/dev/null
    k create namespace monitoring >/dev/null
    local f name
    for f in "$CHART"/ci/*.yaml; do
        name=$(basename "$f" .yaml)
        check "lint kinference -f ci/$name" helm lint --strict "$CHART" -f "$f"
        check "template kinference -f ci/$name" helm template r "$CHART" -n chart-ci -f "$f" \
            --api-versions monitoring.coreos.com/v1/ServiceMonitor
        cp "$WORK/out" "$WORK/$name.yaml"
        # ServiceMonitor's CRD is not in this cluster; everything else is checked by the server.
        "$PY" -c 'import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] != "ServiceMonitor"]
print(yaml.safe_dump_all(docs))' "$WORK/$name.yaml" >"$WORK/$name.server.yaml"
        check "ci/$name: API server accepts the objects (dry run)" \
            kubectl create --dry-run=server -f "$WORK/$name.server.yaml"
    done
    if grep -q "kind: ServiceMonitor" "$WORK/xxhash-monitoring-values.yaml"; then
        ok "ServiceMonitor rendered when enabled"
    else bad "no ServiceMonitor rendered when enabled"; fi
    if "$PY" -c 'import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
assert len(cm) == 1 and cm[0]["metadata"]["namespace"] == "monitoring", cm
dash = json.loads(cm[0]["data"]["kinference.json"])
assert dash["uid"] == "kinference-router" and dash["panels"], dash.keys()' "$WORK/xxhash-monitoring-values.yaml"; then
        ok "Grafana dashboard ConfigMap rendered when enabled (sidecar label, valid JSON)"
    else bad "no valid Grafana dashboard ConfigMap rendered when enabled"; fi
    check "template kinference-crds installInferencePool=true" helm template c "$CRDS" --set installInferencePool=true
    if grep -q "name: inferencepools.inference.networking.k8s.io" "$WORK/out"; then
        ok "InferencePool CRD rendered with installInferencePool=true"
    else bad "InferencePool CRD not rendered"; fi
    helm template c "$CRDS" >"$WORK/out" 2>&1
    if grep -q "inferencepools" "$WORK/out"; then bad "InferencePool CRD rendered by default"
    else ok "InferencePool CRD not rendered by default"; fi
}

refused_values() {
    echo "== values that must be refused"
    local d="$CHART/ci/default-values.yaml"
    refuse "no inferencePool.name" helm template r "$CHART" -f "$d" --set inferencePool.name=
    refuse "no pool.models" helm template r "$CHART" -f "$d" --set 'pool.models=null'
    refuse "no pool.blockSize" helm template r "$CHART" -f "$d" --set pool.blockSize=0
    refuse "xxhash without hashSeed" helm template r "$CHART" -f "$d" --set pool.hashAlgo=xxhash
    refuse "unknown hash algorithm (schema)" helm template r "$CHART" -f "$d" --set pool.hashAlgo=md5
    refuse "misspelt setting (schema)" helm template r "$CHART" -f "$d" --set replicaCoutn=3
    refuse "ServiceMonitor without its CRD" helm template r "$CHART" -f "$d" --set serviceMonitor.enabled=true
    refuse "unknown kinference-crds value" helm template c "$CRDS" --set installInferencePools=true
    refuse "unknown mode (schema)" helm template r "$CHART" -f "$d" --set mode=proxy
    refuse "unknown request body mode (schema)" helm template r "$CHART" -f "$d" --set mode=epp \
        --set epp.requestBodyMode=streamed
    refuse "unknown failureMode (schema)" helm template r "$CHART" -f "$d" --set epp.failureMode=Open
    refuse "service.epp.enabled, replaced by mode (schema)" helm template r "$CHART" -f "$d" \
        --set service.epp.enabled=true
    local e="$CHART/ci/epp-mode-values.yaml"
    refuse "inferencePool.create without matchLabels" helm template r "$CHART" -f "$e" \
        --set inferencePool.matchLabels=null
    refuse "inferencePool.create in another namespace" helm template r "$CHART" -n chart-ci -f "$e" \
        --set inferencePool.namespace=models
    refuse "nine inferencePool.targetPorts (schema)" helm template r "$CHART" -f "$e" \
        --set 'inferencePool.targetPorts={1,2,3,4,5,6,7,8,9}'
}

# The schema (descriptions aside) of our InferencePool CRD against upstream GIE's, read from the
# Go module proxy (the module's zip carries config/crd/bases/).
inferencepool_schema() {
    echo "== InferencePool CRD schema vs GIE $GIE_VERSION"
    local up
    up=$(cd "$WORK" && go mod download -json "sigs.k8s.io/gateway-api-inference-extension@$GIE_VERSION" |
        "$PY" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
    check "schema equal to upstream's (descriptions aside)" "$PY" - \
        "$up/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" \
        "$CRDS/files/inference.networking.k8s.io_inferencepools.yaml" <<'EOF'
import difflib, json, sys, yaml
def strip(o):
    if isinstance(o, dict):
        return {k: strip(v) for k, v in o.items() if k != "description"}
    if isinstance(o, list):
        return [strip(x) for x in o]
    return o
want, got = (json.dumps(strip(yaml.safe_load(open(f))["spec"]), indent=1, sort_keys=True).splitlines()
             for f in sys.argv[1:3])
diff = list(difflib.unified_diff(want, got, "upstream", "ours", lineterm=""))
print("\n".join(diff))
sys.exit(1 if diff else 0)
EOF
}

install_crds() {
    echo "== helm install kinference-crds"
    check "install kinference-crds --set installInferencePool=true" \
        helm install kinference-crds "$CRDS" --set installInferencePool=true --no-hooks
    check "InferencePool CRD established" kubectl wait --for=condition=Established --timeout=60s \
        crd/inferencepools.inference.networking.k8s.io
    local p
    for p in $(kinference_plurals); do
        check "CRD $p.kinference.io established" kubectl wait --for=condition=Established \
            --timeout=60s "crd/$p.kinference.io"
    done
}

inferencepool() { # NAME PORTS-JSON [EXTRA-SPEC-JSON]
    printf '{"apiVersion":"inference.networking.k8s.io/v1","kind":"InferencePool","metadata":{"name":"%s","namespace":"models"},"spec":{"selector":{"matchLabels":{"app":"vllm"}},"targetPorts":%s%s}}' \
        "$1" "$2" "${3:+,$3}"
}

inferencepool_validation() {
    echo "== InferencePool objects against the installed CRD"
    check "a valid pool is accepted" kubectl create -f - <<<"$(inferencepool qwen '[{"number":8000}]' \
        '"endpointPickerRef":{"name":"kinference","port":{"number":9002}}')"
    equal "defaulted appProtocol" http "$(jp -n models inferencepool qwen -o jsonpath='{.spec.appProtocol}')"
    equal "defaulted failureMode" FailClose \
        "$(jp -n models inferencepool qwen -o jsonpath='{.spec.endpointPickerRef.failureMode}')"
    refuse "duplicate target ports (CEL rule)" kubectl create --dry-run=server -f - \
        <<<"$(inferencepool dup '[{"number":8000},{"number":8000}]')"
    refuse "endpointPickerRef Service without port (CEL rule)" kubectl create --dry-run=server -f - \
        <<<"$(inferencepool noport '[{"number":8000}]' '"endpointPickerRef":{"name":"epp"}')"
    refuse "nine target ports" kubectl create --dry-run=server -f - <<<"$(inferencepool nine \
        '[{"number":1},{"number":2},{"number":3},{"number":4},{"number":5},{"number":6},{"number":7},{"number":8},{"number":9}]')"
    refuse "unknown appProtocol" kubectl create --dry-run=server -f - \
        <<<"$(inferencepool proto '[{"number":8000}]' '"appProtocol":"grpc"')"
}

install_router() {
    echo "== helm install kinference (ci/default-values.yaml) into namespace kinference"
    check "install kinference" helm install kinference "$CHART" -n kinference --create-namespace \
        --no-hooks -f "$CHART/ci/default-values.yaml" --set inferencePool.namespace=models
    local d=(-n kinference deployment kinference)
    equal "replicas" 2 "$(jp "${d[@]}" -o jsonpath='{.spec.replicas}')"
    equal "service account" kinference "$(jp "${d[@]}" -o jsonpath='{.spec.template.spec.serviceAccountName}')"
    equal "runAsNonRoot" true "$(jp "${d[@]}" -o jsonpath='{.spec.template.spec.securityContext.runAsNonRoot}')"
    local c='{.spec.template.spec.containers[0]'
    equal "readOnlyRootFilesystem" true "$(jp "${d[@]}" -o jsonpath="$c.securityContext.readOnlyRootFilesystem}")"
    equal "allowPrivilegeEscalation" false "$(jp "${d[@]}" -o jsonpath="$c.securityContext.allowPrivilegeEscalation}")"
    equal "dropped capabilities" '["ALL"]' "$(jp "${d[@]}" -o jsonpath="$c.securityContext.capabilities.drop}")"
    equal "liveness probe" "/healthz admin" "$(jp "${d[@]}" -o jsonpath="$c.livenessProbe.httpGet.path} $c.livenessProbe.httpGet.port}")"
    equal "readiness probe" "/readyz admin" "$(jp "${d[@]}" -o jsonpath="$c.readinessProbe.httpGet.path} $c.readinessProbe.httpGet.port}")"
    equal "memory limit" 2Gi "$(jp "${d[@]}" -o jsonpath="$c.resources.limits.memory}")"
    local args
    args=$(jp "${d[@]}" -o jsonpath="$c.args}")
    case $args in
        *'"--namespace=models"'*'"--inference-pool=llama"'*'"--block-size=16"'*) ok "serve arguments name the pool" ;;
        *) bad "serve arguments: $args" ;;
    esac
    equal "service ports" "http:8080 admin:9090" \
        "$(jp -n kinference service kinference -o jsonpath='{range .spec.ports[*]}{.name}:{.port} {end}' | sed 's/ $//')"
    equal "PDB maxUnavailable" 1 "$(jp -n kinference pdb kinference -o jsonpath='{.spec.maxUnavailable}')"
    equal "Role in the pool's namespace" kinference "$(jp -n models role kinference -o jsonpath='{.metadata.name}')"
    equal "RoleBinding subject" "kinference/kinference" \
        "$(jp -n models rolebinding kinference -o jsonpath='{.subjects[0].namespace}/{.subjects[0].name}')"
    refuse "no ClusterRole" kubectl get clusterrole kinference
}

# can_i WANT VERB RESOURCE [ARGS...]: `kubectl auth can-i` as the router's ServiceAccount.
can_i() {
    local want=$1 got
    shift
    got=$(kubectl auth can-i --as=system:serviceaccount:kinference:kinference "$@" 2>/dev/null || true)
    equal "can-i $*" "$want" "$got"
}

# sar WANT VERB GROUP RESOURCE [SUBRESOURCE]: a SubjectAccessReview for the router's ServiceAccount
# in namespace models. Unlike `kubectl auth can-i` it names the group itself, so it also answers
# for resources whose CRD is not installed (can-i then sends the whole name as a core resource).
sar() {
    local want=$1 verb=$2 group=$3 res=$4 sub=${5:-} got
    got=$(kubectl create -o jsonpath='{.status.allowed}' -f - 2>&1 <<EOF
{"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
  "user": "system:serviceaccount:kinference:kinference",
  "groups": ["system:serviceaccounts", "system:serviceaccounts:kinference", "system:authenticated"],
  "resourceAttributes": {"namespace": "models", "verb": "$verb", "group": "$group",
    "resource": "$res", "subresource": "$sub"}}}
EOF
    )
    case $got in true) got=yes ;; "" | false) got=no ;; esac
    equal "SubjectAccessReview $verb $res${sub:+/$sub}.$group -n models" "$want" "$got"
}

rbac() {
    echo "== RBAC of the router's ServiceAccount (kubectl auth can-i)"
    local v r
    for v in get list watch; do
        can_i yes "$v" pods -n models
        can_i yes "$v" inferencepools.inference.networking.k8s.io -n models
    done
    for r in $({ kinference_plurals; granted_plurals; } | sort -u); do
        for v in get list watch; do sar yes "$v" kinference.io "$r"; done
        for v in update patch; do sar yes "$v" kinference.io "$r" status; done
        for v in create update patch delete; do sar no "$v" kinference.io "$r"; done
    done
    for v in create update patch delete; do can_i no "$v" pods -n models; done
    can_i no patch pods --subresource=status -n models
    can_i no create pods --subresource=eviction -n models
    for v in get list watch; do can_i no "$v" secrets -n models; done
    can_i no get secrets -n kinference
    can_i no list configmaps -n models
    for v in create update patch delete; do can_i no "$v" inferencepools.inference.networking.k8s.io -n models; done
    can_i no patch inferencepools.inference.networking.k8s.io --subresource=status -n models
    can_i no list pods -n kube-system
    can_i no list pods -n kinference
    can_i no list pods --all-namespaces
    can_i no get nodes
    can_i no create deployments.apps -n models
    can_i no create events -n models
    can_i no create leases.coordination.k8s.io -n models
    kinference_in_sync
}

# The kinference.io resources the router chart's Role grants by default.
granted_plurals() {
    "$PY" -c 'import sys, yaml
print("\n".join(yaml.safe_load(open(sys.argv[1]))["rbac"]["kinferenceResources"]))' "$CHART/values.yaml"
}

# Every CRD of the kinference-crds chart must be granted by the router chart's Role.
kinference_in_sync() {
    local p granted
    granted=" $(granted_plurals | tr '\n' ' ') "
    for p in $(kinference_plurals); do
        case $granted in *" $p "*) ok "rbac.kinferenceResources has $p" ;; *) bad "rbac.kinferenceResources lacks $p (crds/)" ;; esac
    done
}

# The path the router takes in a pod: a ServiceAccount token, real requests.
rbac_with_token() {
    echo "== requests with a token of the router's ServiceAccount"
    local token server
    token=$(kubectl -n kinference create token kinference --duration=10m)
    server=$(kubectl config view --raw -o jsonpath='{.clusters[0].cluster.server}')
    kubectl config view --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}' |
        base64 -d >"$WORK/ca.crt"
    local as=(kubectl --kubeconfig=/dev/null --server="$server" --certificate-authority="$WORK/ca.crt" --token="$token")
    check "list pods in models" "${as[@]}" -n models get pods
    check "watch inferencepools in models" "${as[@]}" -n models get inferencepools --watch-only --request-timeout=1s
    check "get the InferencePool" "${as[@]}" -n models get inferencepool qwen
    refuse "list secrets in models" "${as[@]}" -n models get secrets
    refuse "delete a pod" "${as[@]}" -n models delete pod vllm-0 --wait=false
    refuse "label a pod" "${as[@]}" -n models label pod vllm-0 x=y
    refuse "annotate a pod (scaleIn.podDeletionCost is off)" "${as[@]}" -n models annotate pod vllm-0 controller.kubernetes.io/pod-deletion-cost=1
    refuse "list pods in kube-system" "${as[@]}" -n kube-system get pods
}

pod_ready() {
    echo "== k8s-testenv.sh pod-ready (a pod's status without a kubelet)"
    kubectl -n models create -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: vllm-0, labels: {app: vllm}}
spec:
  nodeName: testenv-node
  containers: [{name: vllm, image: vllm/vllm-openai, ports: [{containerPort: 8000}]}]
EOF
    check "pod-ready vllm-0 127.0.0.11" bash "$ROOT/scripts/k8s-testenv.sh" pod-ready "$DIR" models vllm-0 127.0.0.11
    local p=(-n models pod vllm-0)
    equal "phase podIP podIPs Ready" "Running 127.0.0.11 127.0.0.11 True" \
        "$(jp "${p[@]}" -o jsonpath='{.status.phase} {.status.podIP} {.status.podIPs[0].ip} {.status.conditions[?(@.type=="Ready")].status}')"
    check "pod-ready ... false" bash "$ROOT/scripts/k8s-testenv.sh" pod-ready "$DIR" models vllm-0 127.0.0.11 false
    equal "Ready after false" False "$(jp "${p[@]}" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')"
}

second_release() {
    echo "== a second release: existing ServiceAccount, pool in another namespace, 3 replicas"
    kubectl create namespace kinference-b >/dev/null
    kubectl -n kinference-b create serviceaccount kinference-router >/dev/null
    check "install kinference-b" helm install b "$CHART" -n kinference-b --no-hooks \
        -f "$CHART/ci/xxhash-monitoring-values.yaml" --set serviceMonitor.enabled=false
    equal "replicas" 3 "$(jp -n kinference-b deployment b-kinference -o jsonpath='{.spec.replicas}')"
    equal "service ports" "http admin" \
        "$(jp -n kinference-b service b-kinference -o jsonpath='{.spec.ports[*].name}')"
    local sa=system:serviceaccount:kinference-b:kinference-router
    equal "b can list pods in models" yes "$(kubectl auth can-i --as=$sa list pods -n models 2>/dev/null || true)"
    equal "b cannot list pods in its own namespace" no "$(kubectl auth can-i --as=$sa list pods -n kinference-b 2>/dev/null || true)"
    # Cache-aware scale-in: patch on pods (their pod-deletion-cost annotation), nothing more.
    check "upgrade b with scaleIn.podDeletionCost" helm upgrade b "$CHART" -n kinference-b --no-hooks \
        -f "$CHART/ci/xxhash-monitoring-values.yaml" --set serviceMonitor.enabled=false \
        --set scaleIn.podDeletionCost=true --set scaleIn.halfLifeSeconds=900
    equal "b can patch pods in models" yes "$(kubectl auth can-i --as=$sa patch pods -n models 2>/dev/null || true)"
    local v
    for v in create update delete; do
        equal "b cannot $v pods in models" no "$(kubectl auth can-i --as=$sa "$v" pods -n models 2>/dev/null || true)"
    done
    equal "b cannot patch pods/status" no "$(kubectl auth can-i --as=$sa patch pods --subresource=status -n models 2>/dev/null || true)"
    case $(jp -n kinference-b deployment b-kinference -o jsonpath='{.spec.template.spec.containers[0].args}') in
        *'"--scale-in={\"half_life_s\":900,\"hysteresis\":0.25,\"interval_s\":30,\"max_patches\":20,\"pod_deletion_cost\":true}"'*) ok "--scale-in argument" ;;
        *) bad "--scale-in argument missing: $(jp -n kinference-b deployment b-kinference -o jsonpath='{.spec.template.spec.containers[0].args}')" ;;
    esac
}

epp_release() {
    echo "== epp mode (ci/epp-mode-values.yaml) with the InferencePool, into namespace kinference-epp"
    check "install e" helm install e "$CHART" -n kinference-epp --create-namespace --no-hooks \
        -f "$CHART/ci/epp-mode-values.yaml"
    local d=(-n kinference-epp deployment e-kinference) c='{.spec.template.spec.containers[0]'
    local args
    args=$(jp "${d[@]}" -o jsonpath="$c.args}")
    case $args in
        '["epp","--listen=0.0.0.0:9002","--admin=0.0.0.0:9090","--namespace=kinference-epp","--inference-pool=llama",'*'"--request-body-mode=full-duplex","--response-body-mode=buffered","--keepalive-s=30"]') ok "epp arguments" ;;
        *) bad "epp arguments: $args" ;;
    esac
    equal "container ports" "epp:9002 admin:9090" \
        "$(jp "${d[@]}" -o jsonpath='{range .spec.template.spec.containers[0].ports[*]}{.name}:{.containerPort} {end}' | sed 's/ $//')"
    equal "probes on the admin port" "/healthz admin /readyz admin" \
        "$(jp "${d[@]}" -o jsonpath="$c.livenessProbe.httpGet.path} $c.livenessProbe.httpGet.port} $c.readinessProbe.httpGet.path} $c.readinessProbe.httpGet.port}")"
    equal "service ports" "epp:9002:kubernetes.io/h2c admin:9090:http" \
        "$(jp -n kinference-epp service e-kinference -o jsonpath='{range .spec.ports[*]}{.name}:{.port}:{.appProtocol} {end}' | sed 's/ $//')"
    local p=(-n kinference-epp inferencepool llama)
    equal "InferencePool selector, ports, protocol" '{"app":"vllm-llama"} 8000,8001 http' \
        "$(jp "${p[@]}" -o jsonpath='{.spec.selector.matchLabels} {.spec.targetPorts[0].number},{.spec.targetPorts[1].number} {.spec.appProtocol}')"
    equal "endpointPickerRef" "/Service e-kinference 9002 FailOpen" \
        "$(jp "${p[@]}" -o jsonpath='{.spec.endpointPickerRef.group}/{.spec.endpointPickerRef.kind} {.spec.endpointPickerRef.name} {.spec.endpointPickerRef.port.number} {.spec.endpointPickerRef.failureMode}')"
    equal "the Service the pool names has its port" 9002 \
        "$(jp -n kinference-epp service "$(jp "${p[@]}" -o jsonpath='{.spec.endpointPickerRef.name}')" \
            -o jsonpath="{.spec.ports[?(@.port==$(jp "${p[@]}" -o jsonpath='{.spec.endpointPickerRef.port.number}'))].port}")"
    equal "Role in the release namespace" e-kinference "$(jp -n kinference-epp role e-kinference -o jsonpath='{.metadata.name}')"
    equal "e can read its InferencePool" yes \
        "$(kubectl auth can-i --as=system:serviceaccount:kinference-epp:e-kinference get inferencepools.inference.networking.k8s.io/llama -n kinference-epp 2>/dev/null || true)"
    check "upgrade e to FailClose (the CRD's default)" helm upgrade e "$CHART" -n kinference-epp --no-hooks \
        -f "$CHART/ci/epp-mode-values.yaml" --set epp.failureMode=FailClose
    equal "failureMode after upgrade" FailClose "$(jp "${p[@]}" -o jsonpath='{.spec.endpointPickerRef.failureMode}')"
}

uninstall() {
    echo "== helm uninstall"
    check "uninstall kinference" helm uninstall kinference -n kinference
    check "uninstall b" helm uninstall b -n kinference-b
    check "uninstall e" helm uninstall e -n kinference-epp
    refuse "InferencePool of e removed" kubectl -n kinference-epp get inferencepool llama
    check "uninstall kinference-crds" helm uninstall kinference-crds
    check "InferencePool CRD kept (helm.sh/resource-policy: keep)" \
        kubectl get crd inferencepools.inference.networking.k8s.io
    refuse "Role removed" kubectl -n models get role kinference
}

main() {
    # Any python3 with PyYAML; else the project's pinned venv (scripts/python-deps.sh has PyYAML).
    PY=python3
    if ! "$PY" -c 'import yaml' 2>/dev/null; then
        bash "$ROOT/scripts/python-deps.sh" >/dev/null
        PY="${KINFERENCE_PY_VENV:-$HOME/.cache/kinference/py}/bin/python"
    fi
    kubectl version -o json | "$PY" -c 'import json, sys
v = json.load(sys.stdin); print("kubectl", v["clientVersion"]["gitVersion"], "server", v["serverVersion"]["gitVersion"])'
    helm version --short
    install_crds
    lint_and_template
    refused_values
    inferencepool_schema
    inferencepool_validation
    install_router
    rbac
    pod_ready
    rbac_with_token
    second_release
    epp_release
    uninstall
    echo
    if [ "$failures" -gt 0 ]; then
        echo "k8s-charts-check: $failures check(s) failed"
        exit 1
    fi
    echo "k8s-charts-check: all checks passed"
}

main
