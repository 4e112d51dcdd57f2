# epp-peers.sh - the peer endpoint pickers kinference's EPP is compared with: Envoy ext_proc
# servers as the Gateway API Inference Extension specifies, built once from pinned releases and
# started on loopback without a Kubernetes cluster (docs/epp-peers.md: what each runs and why).
# Source lib/net.sh and lib/proc.sh first.
#
#   epp_peers_install [NAME...]   builds each peer (default: all) and the ext_proc probe
#                                 (tools/extproc-probe) once into
#                                 ${KINFERENCE_EPP_PEERS_DIR:-~/.cache/kinference/epp-peers}/
#                                 <name>-<version>/bin/; later calls reuse what is there.
#   epp_peer_start NAME GRPC_PORT ENDPOINTS LOGFILE [EXTRA]
#                                 writes the peer's config into a temp dir, starts it in the
#                                 background (its pid in EPP_PEER_PIDS[NAME]) and returns once it
#                                 picks: its ext_proc port accepts and the probe gets a pick
#                                 back. ENDPOINTS: the replicas' HTTP ip:port,... Call it in the
#                                 script's own shell, not in $(...), so the pid is kept.
#   epp_peer_stop [NAME]          stops NAME (default: every peer started) and removes what its
#                                 start created.
#   epp_probe GRPC_PORT [ARGS...] runs the probe against a picker (ARGS go to extproc-probe:
#                                 -model, -prompt, -n, -body-mode, -v).
#
# Peers (NAME):
#   llm-d      llm-d's endpoint picker (github.com/llm-d/llm-d-inference-scheduler v0.7.1, the
#              newest llm-d release the Go module proxy serves), with the default profile of
#              its Helm chart (gateway-api-inference-extension v1.4.0's epplib chart: queue 2,
#              kv-cache-utilization 2, approximate prefix-cache 3, max-score picker), scraping
#              each replica's /metrics. It has no mode without a Kubernetes API server: it runs
#              against a local one like gie-lwepp (below). EXTRA: a full EndpointPickerConfig
#              YAML file to use instead of the default profile; the API server is
#              $KINFERENCE_K8S_DIR when set, else one brought up in the temp dir.
#   gie-lwepp  the Gateway API Inference Extension's reference lightweight EPP (round robin). It
#              has no mode without a Kubernetes API server: it is given a local one
#              (scripts/k8s-testenv.sh, no kubelet) holding an InferencePool and one Pod whose
#              status says Running/Ready with the replicas' IP. EXTRA: a k8s-testenv DIR that is
#              already up (default: $KINFERENCE_K8S_DIR, else one is brought up in the temp dir
#              and taken down by epp_peer_stop).
#   llm-d-0.10 opt-in, only when KINFERENCE_EPP_PEERS_LLMD_GIT is set: llm-d's router EPP
#              v0.10.0 (github.com/llm-d/llm-d-router, which the module proxy does not serve),
#              built from that git clone (its v0.10.0 tag must be the pinned commit), run in
#              file-discovery mode (an endpoints file, no API server). EXTRA: a full
#              EndpointPickerConfig YAML file; the text @ENDPOINTS_FILE@ in it is replaced by the
#              path of the endpoints file written here.
# The peers that use an API server need the replicas to share one IP and be at most 8 (one Pod,
# the replicas' ports as the pool's targetPorts).
#
# Environment: KINFERENCE_EPP_PEERS_DIR (the build cache); KINFERENCE_K8S_DIR (an API server
# that is up, shared by the peers that need one); KINFERENCE_EPP_PEERS_LLMD_GIT (enables
# llm-d-0.10). Builds use CGO_ENABLED=0, `nice` and GOFLAGS=-p=1 unless GOFLAGS is set.

EPP_PEERS_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

EPP_PEERS_LLMD_MODULE=github.com/llm-d/llm-d-inference-scheduler
EPP_PEERS_LLMD_VERSION=v0.7.1
EPP_PEERS_LLMD_COMMIT=2d2799ff0d719a409870bfb2164018556243f74c
# v0.7.1 pins llm-d-kv-cache v0.7.1, which the module proxy does not serve (403, as v0.7.0 and
# v0.8.0); v0.9.0 is served and v0.7.1 builds against it (docs/epp-peers.md).
EPP_PEERS_LLMD_KVCACHE=github.com/llm-d/llm-d-kv-cache@v0.9.0
EPP_PEERS_LLMD10_MODULE=github.com/llm-d/llm-d-router
EPP_PEERS_LLMD10_VERSION=v0.10.0
EPP_PEERS_LLMD10_COMMIT=71f4f0999f95b96c49a9d0c4afbd18dfdb943c26
EPP_PEERS_GIE_MODULE=sigs.k8s.io/gateway-api-inference-extension
EPP_PEERS_GIE_VERSION=v1.6.0

declare -gA EPP_PEER_PIDS=() EPP_PEER_TMPS=() EPP_PEER_K8S=() EPP_PEER_OWNS_K8S=()

epp_peers_dir() { echo "${KINFERENCE_EPP_PEERS_DIR:-$HOME/.cache/kinference/epp-peers}"; }

# epp_peer_home NAME: the cache folder of NAME's pinned version.
epp_peer_home() {
  case $1 in
    llm-d) echo "$(epp_peers_dir)/llm-d-inference-scheduler-$EPP_PEERS_LLMD_VERSION" ;;
    llm-d-0.10) echo "$(epp_peers_dir)/llm-d-router-$EPP_PEERS_LLMD10_VERSION" ;;
    gie-lwepp) echo "$(epp_peers_dir)/gie-lwepp-$EPP_PEERS_GIE_VERSION" ;;
    extproc-probe)
      local key
      key=$(cat "$EPP_PEERS_REPO"/tools/extproc-probe/{go.mod,go.sum,main.go} <(go version) |
        sha256sum | cut -c1-12)
      echo "$(epp_peers_dir)/extproc-probe-$key" ;;
    *) echo "unknown EPP peer: $1 (llm-d, gie-lwepp, llm-d-0.10)" >&2; return 1 ;;
  esac
}

_epp_go_build() { # SRC_DIR OUT PKG [LDFLAGS [GOFLAGS_EXTRA]]
  (cd "$1" && GOWORK=off CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--p=1} ${5:-}" nice go build -trimpath \
    -ldflags "${4:-}" -o "$2" "$3")
}

# _epp_module_src MODULE VERSION DEST: the module's source, from the Go module proxy, copied to
# DEST (writable: the module cache is read-only).
_epp_module_src() {
  local dir
  dir=$(go mod download -json "$1@$2" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir","")); sys.exit(1 if d.get("Error") else 0)') ||
    return 1
  [ -d "$dir" ] || return 1
  mkdir -p "$3" && cp -r "$dir/." "$3/" && chmod -R u+w "$3"
}

_epp_build_llmd() { # TMP
  local src=$1/src gie
  _epp_module_src "$EPP_PEERS_LLMD_MODULE" "$EPP_PEERS_LLMD_VERSION" "$src" || return 1
  (cd "$src" && GOWORK=off go mod edit -require="$EPP_PEERS_LLMD_KVCACHE") || return 1
  echo "proxy $EPP_PEERS_LLMD_MODULE@$EPP_PEERS_LLMD_VERSION, go.mod: require $EPP_PEERS_LLMD_KVCACHE" >"$1/source"
  # -mod=mod: the raised requirement raises others (otel, grpc, x/*) and go.sum gains their sums.
  _epp_go_build "$src" "$1/bin/epp" ./cmd/epp \
    "-s -w -X $EPP_PEERS_GIE_MODULE/version.CommitSHA=$EPP_PEERS_LLMD_COMMIT -X $EPP_PEERS_GIE_MODULE/version.BuildRef=$EPP_PEERS_LLMD_VERSION" \
    -mod=mod || return 1
  # The InferencePool CRD of the GIE version it is built with (v1.4.0).
  gie=$(cd "$src" && GOWORK=off GOFLAGS=-mod=mod go list -m -f '{{.Dir}}' "$EPP_PEERS_GIE_MODULE") &&
    cp "$gie/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$1/inferencepools-crd.yaml"
}

_epp_build_llmd10() { # TMP
  local src=$1/src git=${KINFERENCE_EPP_PEERS_LLMD_GIT:-} commit
  [ -n "$git" ] || {
    echo "llm-d-0.10 is built from a git clone of $EPP_PEERS_LLMD10_MODULE holding tag" \
      "$EPP_PEERS_LLMD10_VERSION (the module proxy does not serve it): set KINFERENCE_EPP_PEERS_LLMD_GIT" >&2
    return 1
  }
  commit=$(git -C "$git" rev-parse "$EPP_PEERS_LLMD10_VERSION^{commit}") || return 1
  [ "$commit" = "$EPP_PEERS_LLMD10_COMMIT" ] || {
    echo "$git: tag $EPP_PEERS_LLMD10_VERSION is $commit, pinned $EPP_PEERS_LLMD10_COMMIT" >&2
    return 1
  }
  mkdir -p "$src" && git -C "$git" archive "$commit" | tar -x -C "$src" || return 1
  echo "git $git $commit" >"$1/source"
  _epp_go_build "$src" "$1/bin/epp" ./cmd/epp \
    "-s -w -X $EPP_PEERS_LLMD10_MODULE/version.CommitSHA=$EPP_PEERS_LLMD10_COMMIT -X $EPP_PEERS_LLMD10_MODULE/version.BuildRef=$EPP_PEERS_LLMD10_VERSION"
}

_epp_build_gie() { # TMP
  _epp_module_src "$EPP_PEERS_GIE_MODULE" "$EPP_PEERS_GIE_VERSION" "$1/src" || return 1
  echo "proxy $EPP_PEERS_GIE_MODULE@$EPP_PEERS_GIE_VERSION" >"$1/source"
  cp "$1/src/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$1/inferencepools-crd.yaml" &&
    _epp_go_build "$1/src" "$1/bin/lwepp" ./cmd/lwepp "-s -w"
}

_epp_build_probe() { # TMP
  _epp_go_build "$EPP_PEERS_REPO/tools/extproc-probe" "$1/bin/extproc-probe" . "-s -w"
}

epp_peers_install() {
  local names=("$@") name home tmp start rc=0
  if [ ${#names[@]} -eq 0 ]; then
    names=(llm-d gie-lwepp)
    [ -z "${KINFERENCE_EPP_PEERS_LLMD_GIT:-}" ] || names+=(llm-d-0.10)
  fi
  mkdir -p "$(epp_peers_dir)"
  for name in extproc-probe "${names[@]}"; do
    home=$(epp_peer_home "$name") || return 1
    [ -f "$home/ok" ] && continue
    (
      # One build at a time, published by one rename: a parallel install waits, then reuses.
      flock 9
      [ -f "$home/ok" ] && exit 0
      tmp=$(mktemp -d "$(epp_peers_dir)/.build-$name.XXXXXX")
      trap 'rm -rf "$tmp"' EXIT
      mkdir -p "$tmp/bin"
      echo "building $name into $home (first time only; minutes)" >&2
      start=$(date +%s)
      case $name in
        llm-d) _epp_build_llmd "$tmp" ;;
        llm-d-0.10) _epp_build_llmd10 "$tmp" ;;
        gie-lwepp) _epp_build_gie "$tmp" ;;
        extproc-probe) _epp_build_probe "$tmp" ;;
      esac >"$tmp/build.log" 2>&1 || { tail -n 30 "$tmp/build.log" >&2; echo "building $name failed" >&2; exit 1; }
      echo "$(( $(date +%s) - start ))" >"$tmp/build-seconds"
      rm -rf "$tmp/src" && touch "$tmp/ok"
      rm -rf "$home" && mv "$tmp" "$home" && trap - EXIT
      echo "built $name in $(cat "$home/build-seconds") s" >&2
    ) 9>"$(epp_peers_dir)/build.lock" || rc=1
  done
  return $rc
}

epp_probe() {
  local port=$1
  shift
  "$(epp_peer_home extproc-probe)/bin/extproc-probe" -addr "127.0.0.1:$port" "$@"
}

# _epp_wait_pick NAME GRPC_PORT SECS: waits until the peer's port accepts and a probe request
# gets a destination back (a picker can listen before it knows any endpoint).
_epp_wait_pick() {
  local name=$1 port=$2 secs=$3 pid=${EPP_PEER_PIDS[$1]} i
  wait_port "127.0.0.1:$port" "$pid" "$secs" || return 1
  for i in $(seq 1 $(( secs * 5 ))); do
    epp_probe "$port" -timeout 2s >"${EPP_PEER_TMPS[$name]}/probe.out" 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.2
  done
  cat "${EPP_PEER_TMPS[$name]}/probe.out" >&2
  return 1
}

# _epp_k8s_pool NAME GRPC ENDPOINTS K8S DIR: an InferencePool sims-GRPC (the replicas' ports as
# targetPorts) and one Pod marked Running/Ready at the replicas' IP, in namespace
# kinference-epp of the API server K8S (a k8s-testenv DIR that is up; empty: one is brought up in
# DIR/k8s and taken down by epp_peer_stop). There is no kubelet: the pod is only an API object.
_epp_k8s_pool() {
  local name=$1 grpc=$2 endpoints=$3 k8s=$4 dir=$5 ep ip="" ports=() tp=""
  local ns=kinference-epp pool="sims-$2"
  for ep in ${endpoints//,/ }; do
    [ -z "$ip" ] || [ "$ip" = "${ep%:*}" ] ||
      { echo "$name: all replicas must share one IP (one Pod, its ports as targetPorts)" >&2; return 1; }
    ip=${ep%:*}
    ports+=("${ep##*:}")
  done
  [ ${#ports[@]} -ge 1 ] && [ ${#ports[@]} -le 8 ] ||
    { echo "$name: 1 to 8 replicas (an InferencePool has at most 8 targetPorts)" >&2; return 1; }
  if [ -z "$k8s" ]; then
    k8s=$dir/k8s
    EPP_PEER_OWNS_K8S[$name]=1
    EPP_PEER_K8S[$name]=$k8s
    "$EPP_PEERS_REPO/scripts/k8s-testenv.sh" up "$k8s" >"$dir/k8s-up.log" 2>&1 ||
      { tail -n 20 "$dir/k8s-up.log" >&2; return 1; }
  fi
  EPP_PEER_K8S[$name]=$k8s
  _epp_kc() { KUBECONFIG="$k8s/kubeconfig" "$k8s/bin/kubectl" "$@"; }
  for ep in "${ports[@]}"; do tp+="{number: $ep}, "; done
  cat >"$dir/pool.yaml" <<YAML
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: $pool, namespace: $ns}
spec:
  selector: {matchLabels: {app: $pool}}
  targetPorts: [${tp%, }]
  endpointPickerRef: {name: $pool-epp, port: {number: $grpc}}
---
apiVersion: v1
kind: Pod
metadata: {name: $pool-replicas, namespace: $ns, labels: {app: $pool}}
spec:
  nodeName: loopback
  containers: [{name: sim, image: kinference-sim}]
YAML
  # The namespace is never deleted: without a controller manager it would stay Terminating.
  { _epp_kc get namespace "$ns" || _epp_kc create namespace "$ns"; } >"$dir/kubectl.log" 2>&1 &&
    _epp_kc apply -f "$(epp_peer_home "$name")/inferencepools-crd.yaml" >>"$dir/kubectl.log" 2>&1 &&
    _epp_kc wait --for condition=established --timeout=60s crd/inferencepools.inference.networking.k8s.io >>"$dir/kubectl.log" 2>&1 &&
    _epp_kc apply -f "$dir/pool.yaml" >>"$dir/kubectl.log" 2>&1 &&
    "$EPP_PEERS_REPO/scripts/k8s-testenv.sh" pod-ready "$k8s" "$ns" "$pool-replicas" "$ip" >>"$dir/kubectl.log" 2>&1 ||
    { cat "$dir/kubectl.log" >&2; return 1; }
  echo "$k8s" >"$dir/k8s-dir"
}

_epp_start_llmd() { # GRPC ENDPOINTS LOG EXTRA DIR
  local grpc=$1 endpoints=$2 log=$3 extra=$4 dir=$5 ports k8s
  if [ -n "$extra" ]; then
    cp "$extra" "$dir/config.yaml" || return 1
  else
    cat >"$dir/config.yaml" <<YAML
# The default profile of the Helm chart llm-d v0.7.x deploys its EPP with (gateway-api-inference-
# extension v1.4.0, config/charts/epplib default-plugins.yaml): queue 2, kv-cache-utilization 2,
# approximate prefix-cache 3; the loader adds the single-profile handler and max-score picker.
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: prefix-cache-scorer
        weight: 3
YAML
  fi
  _epp_k8s_pool llm-d "$grpc" "$endpoints" "${KINFERENCE_K8S_DIR:-}" "$dir" || return 1
  k8s=${EPP_PEER_K8S[llm-d]}
  read -r -a ports <<<"$(free_ports 2)"
  echo "${ports[1]}" >"$dir/metrics-port"
  # The replicas export no vllm:lora_requests_info: each scrape logs "metric family ... not
  # found" at -v=5 and still updates the other values (--lora-info-metric= is rejected as
  # deprecated; its replacement, engineConfigs, belongs to the experimental data layer).
  KUBECONFIG="$k8s/kubeconfig" "$(epp_peer_home llm-d)/bin/epp" --pool-name "sims-$grpc" \
    --pool-namespace kinference-epp --config-file "$dir/config.yaml" --grpc-port "$grpc" \
    --grpc-health-port "${ports[0]}" --metrics-port "${ports[1]}" --secure-serving=false \
    --metrics-endpoint-auth=false --tracing=false >"$log" 2>&1 &
  EPP_PEER_PIDS[llm-d]=$!
}

_epp_start_llmd10() { # GRPC ENDPOINTS LOG EXTRA DIR
  local grpc=$1 endpoints=$2 log=$3 extra=$4 dir=$5 ports i=0 ep
  {
    echo "endpoints:"
    for ep in ${endpoints//,/ }; do
      printf '  - name: replica-%d\n    address: "%s"\n    port: "%s"\n' "$i" "${ep%:*}" "${ep##*:}"
      i=$(( i + 1 ))
    done
  } >"$dir/endpoints.yaml"
  if [ -n "$extra" ]; then
    sed "s#@ENDPOINTS_FILE@#$dir/endpoints.yaml#g" "$extra" >"$dir/config.yaml" || return 1
  else
    cat >"$dir/config.yaml" <<YAML
# llm-d-router's Helm chart default profile (config/charts/routerlib: queue 2, kv-cache-
# utilization 2, approximate prefix-cache 3, max-score picker) with file discovery instead of an
# InferencePool.
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - name: file-discovery
    type: file-discovery
    parameters:
      path: $dir/endpoints.yaml
      watchFile: false
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
  - type: core-metrics-extractor
dataLayer:
  discovery:
    pluginRef: file-discovery
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: prefix-cache-scorer
        weight: 3
YAML
  fi
  read -r -a ports <<<"$(free_ports 2)"
  echo "${ports[1]}" >"$dir/metrics-port"
  "$(epp_peer_home llm-d-0.10)/bin/epp" --pool-name kinference --config-file "$dir/config.yaml" \
    --grpc-port "$grpc" --grpc-health-port "${ports[0]}" --metrics-port "${ports[1]}" \
    --secure-serving=false >"$log" 2>&1 &
  EPP_PEER_PIDS[llm-d-0.10]=$!
}

_epp_start_gie() { # GRPC ENDPOINTS LOG EXTRA DIR
  local grpc=$1 endpoints=$2 log=$3 dir=$5 ports k8s
  _epp_k8s_pool gie-lwepp "$grpc" "$endpoints" "${4:-${KINFERENCE_K8S_DIR:-}}" "$dir" || return 1
  k8s=${EPP_PEER_K8S[gie-lwepp]}
  read -r -a ports <<<"$(free_ports 2)"
  KUBECONFIG="$k8s/kubeconfig" "$(epp_peer_home gie-lwepp)/bin/lwepp" --pool-name "sims-$grpc" \
    --pool-namespace kinference-epp --grpc-port "$grpc" --grpc-health-port "${ports[0]}" \
    --metrics-port "${ports[1]}" --secure-serving=false >"$log" 2>&1 &
  EPP_PEER_PIDS[gie-lwepp]=$!
}

epp_peer_start() {
  local name=$1 grpc=$2 endpoints=$3 log=$4 extra=${5:-} dir
  [ -z "${EPP_PEER_PIDS[$name]:-}" ] || { echo "$name is already started" >&2; return 1; }
  [ "$name" != llm-d-0.10 ] || [ -n "${KINFERENCE_EPP_PEERS_LLMD_GIT:-}" ] ||
    { echo "llm-d-0.10 is opt-in: set KINFERENCE_EPP_PEERS_LLMD_GIT (docs/epp-peers.md)" >&2; return 1; }
  [ -f "$(epp_peer_home "$name")/ok" ] || epp_peers_install "$name" || return 1
  dir=$(mktemp -d "${TMPDIR:-/tmp}/epp-peer-$name.XXXXXX")
  EPP_PEER_TMPS[$name]=$dir
  case $name in
    llm-d) _epp_start_llmd "$grpc" "$endpoints" "$log" "$extra" "$dir" ;;
    llm-d-0.10) _epp_start_llmd10 "$grpc" "$endpoints" "$log" "$extra" "$dir" ;;
    gie-lwepp) _epp_start_gie "$grpc" "$endpoints" "$log" "$extra" "$dir" ;;
  esac || { epp_peer_stop "$name"; return 1; }
  _epp_wait_pick "$name" "$grpc" "${EPP_PEER_START_SECS:-60}" || {
    echo "$name did not start picking within ${EPP_PEER_START_SECS:-60} s; its log:" >&2
    tail -n 20 "$log" >&2
    epp_peer_stop "$name"
    return 1
  }
}

epp_peer_stop() {
  local names=("$@") name k8s
  [ ${#names[@]} -gt 0 ] || names=("${!EPP_PEER_TMPS[@]}")
  for name in "${names[@]}"; do
    stop "${EPP_PEER_PIDS[$name]:-}"
    k8s=${EPP_PEER_K8S[$name]:-}
    if [ -n "$k8s" ]; then
      if [ -n "${EPP_PEER_OWNS_K8S[$name]:-}" ]; then
        "$EPP_PEERS_REPO/scripts/k8s-testenv.sh" down "$k8s" >/dev/null 2>&1 || true
      elif [ -f "${EPP_PEER_TMPS[$name]:-}/pool.yaml" ]; then
        # A shared API server keeps running: take back the pool and its pod (no kubelet will).
        KUBECONFIG="$k8s/kubeconfig" "$k8s/bin/kubectl" delete --grace-period=0 --force \
          --ignore-not-found -f "${EPP_PEER_TMPS[$name]}/pool.yaml" >/dev/null 2>&1 || true
      fi
    fi
    [ -z "${EPP_PEER_TMPS[$name]:-}" ] || rm -rf "${EPP_PEER_TMPS[$name]}"
    unset "EPP_PEER_PIDS[$name]" "EPP_PEER_TMPS[$name]" "EPP_PEER_K8S[$name]" "EPP_PEER_OWNS_K8S[$name]"
  done
  return 0
}
