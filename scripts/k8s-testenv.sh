#!/usr/bin/env bash
# shellcheck disable=SC2317 # build_* and *_ready are called by name (publish, wait_started)
# A real Kubernetes control plane for tests: etcd + kube-apiserver on loopback, no kubelet, no
# controller manager. Binaries are built from Go modules (scripts/k8s-testenv/{kube,etcd}, helm
# via `go install`) once, cached in ~/.cache/kinference/k8s/<name>-<version>[-<key>]/ (the key
# hashes the Go version and the wrapper module's go.mod and go.sum) and reused. The first build
# takes tens of minutes on 2 cores (docs/kubernetes.md has the measurements); `up` afterwards
# takes seconds.
#
#   scripts/k8s-testenv.sh up DIR       build what is missing, start etcd + kube-apiserver, write
#                                       DIR/kubeconfig (admin, group system:masters), DIR/bin/
#                                       {kubectl,helm,kube-apiserver,etcd} and DIR/env; returns
#                                       once /readyz is ok. Already up: returns at once.
#   scripts/k8s-testenv.sh down DIR     stop everything `up DIR` started (data stays in DIR)
#   scripts/k8s-testenv.sh build        only build/cache the binaries
#   scripts/k8s-testenv.sh env DIR      print the exports of DIR/env
#   scripts/k8s-testenv.sh apiserver-stop DIR | apiserver-start DIR
#                                       stop / restart kube-apiserver alone, on the same port
#                                       (etcd keeps the data), for tests of API-server outages
#   scripts/k8s-testenv.sh pod-ready DIR NS POD IP [true|false]
#                                       there is no kubelet: set a pod's status through the status
#                                       subresource (phase Running, podIP/podIPs = IP, Ready)
#
# After `up`, `source DIR/env` exports:
#   KUBECONFIG                  DIR/kubeconfig (kubectl, helm, kube-rs' Config::infer)
#   KINFERENCE_K8S_KUBECONFIG   the same file, as the marker for tests that need a real API
#                               server: they run when it is set and say they skip when it is not
#   KINFERENCE_K8S_DIR          DIR (pass it to `pod-ready`, `apiserver-stop`, ...)
#   PATH                        DIR/bin first
#
# Concurrency: builds hold an exclusive lock on ~/.cache/kinference/k8s/build.lock and publish
# each binary directory with one rename, so parallel `up`s of different DIRs share one build and
# never see half a binary. `up`/`down` of one DIR hold DIR/lock. Ports: each server is started on
# a random port outside the kernel's ephemeral range (so port-0 binds of tests never collide with
# it) and restarted on another port when its own log says the bind failed. Readiness is checked
# against our own process (its log, its CA), never against whatever answers on the port.
#
# Environment: KINFERENCE_K8S_CACHE (the binaries, default ~/.cache/kinference/k8s),
# K8S_TESTENV_TIMEOUT (seconds to wait for each server's readiness, default 180). Go >= 1.26,
# openssl, curl and flock must be installed.
set -euo pipefail

KUBE_VERSION=v1.37.2
ETCD_VERSION=v3.6.17
HELM_VERSION=v4.3.2

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODULES="$HERE/k8s-testenv"
CACHE="${KINFERENCE_K8S_CACHE:-$HOME/.cache/kinference/k8s}"
TIMEOUT="${K8S_TESTENV_TIMEOUT:-180}"

log() { echo "k8s-testenv: $*" >&2; }
die() { log "$*"; exit 1; }

# --- builds -------------------------------------------------------------------------------------

# A key of everything that decides a build, so a changed wrapper module rebuilds.
module_key() {
    { go version; cat "$MODULES/$1/go.mod" "$MODULES/$1/go.sum"; } | sha256sum | cut -c1-12
}

kube_dir() { echo "$CACHE/kube-$KUBE_VERSION-$(module_key kube)"; }
etcd_dir() { echo "$CACHE/etcd-$ETCD_VERSION-$(module_key etcd)"; }
helm_dir() { echo "$CACHE/helm-$HELM_VERSION"; }

# publish DEST BUILDFN: run BUILDFN into a fresh directory, then move it to DEST in one rename.
publish() {
    local dest=$1 fn=$2 tmp
    [ -x "$dest/.complete" ] && return 0
    tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
    chmod 755 "$tmp"
    local t0=$SECONDS
    if ! ("$fn" "$tmp") >"$tmp.log" 2>&1; then
        tail -n 40 "$tmp.log" >&2
        rm -rf "$tmp"
        die "building $(basename "$dest") failed (full log: $tmp.log)"
    fi
    rm -f "$tmp.log"
    printf '#!/bin/sh\n# built in %ss\n' "$((SECONDS - t0))" >"$tmp/.complete"
    chmod +x "$tmp/.complete"
    rm -rf "$dest"
    mv -T "$tmp" "$dest"
    log "built $(basename "$dest") in $((SECONDS - t0))s"
}

build_kube() {
    local out=$1 ld="-s -w" pkg minor
    minor=$(echo "$KUBE_VERSION" | cut -d. -f2)
    # Both version packages: kube-apiserver reports component-base's, kubectl's client-go's.
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld="$ld -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
        ld="$ld -X $pkg.gitTreeState=clean"
    done
    cd "$MODULES/kube"
    CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$ld" -o "$out/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl
}

build_etcd() {
    cd "$MODULES/etcd"
    CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "-s -w" -o "$1/etcd" \
        go.etcd.io/etcd/server/v3
}

build_helm() {
    local v="helm.sh/helm/v4/internal/version"
    GOBIN="$1" CGO_ENABLED=0 nice -n 10 go install -trimpath \
        -ldflags "-s -w -X $v.version=$HELM_VERSION -X $v.metadata= -X $v.gitTreeState=clean" \
        "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
}

build_all() {
    command -v go >/dev/null || die "go is not installed (Go >= 1.26 builds these binaries)"
    mkdir -p "$CACHE"
    # fd 8 is closed for every server started later, so the lock ends with this function.
    exec 8>"$CACHE/build.lock"
    flock 8
    publish "$(etcd_dir)" build_etcd
    publish "$(helm_dir)" build_helm
    publish "$(kube_dir)" build_kube
    flock -u 8
    exec 8>&-
}

# --- processes ----------------------------------------------------------------------------------

# Our process, still alive: the pid file's process runs with DIR on its command line (guards
# against pid reuse after a reboot or a crash).
alive() {
    local pidfile=$1 pid
    [ -f "$pidfile" ] || return 1
    pid=$(cat "$pidfile")
    [ -r "/proc/$pid/cmdline" ] && running "$pid" &&
        tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$DIR/"
}

# Running, not a zombie waiting to be reaped.
running() {
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# stop_proc PIDFILE NAME: SIGTERM, then SIGKILL after 10 s, only if the process is ours. Not
# lib/proc.sh's `stop`: these servers are not children of this shell (`up` ran in another), so
# nothing here can `wait` for them, and an exited one stays a zombie until init reaps it (over a
# second here), which `kill -0` counts as running.
stop_proc() {
    local pidfile=$1 name=$2 pid deadline
    if alive "$pidfile"; then
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || true
        deadline=$((SECONDS + 10))
        while running "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
        if running "$pid"; then
            log "$name ($pid) ignored SIGTERM for 10s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        log "stopped $name ($pid)"
    fi
    rm -f "$pidfile"
}

# A port for a server: random, below the ephemeral range and above the well-known ports.
random_port() {
    local lo
    lo=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
    [ "$lo" -gt 12000 ] || lo=32768
    echo $((10000 + RANDOM % (lo - 10000)))
}

# wait_started PIDFILE LOG READY_FN: 0 once READY_FN succeeds while our process lives, 2 when
# the process died of a bind failure (caller retries on other ports), 1 otherwise.
wait_started() {
    local pidfile=$1 logf=$2 ready=$3 deadline=$((SECONDS + TIMEOUT)) pid
    pid=$(cat "$pidfile")
    while [ $SECONDS -lt $deadline ]; do
        if ! running "$pid"; then
            rm -f "$pidfile"
            grep -q "address already in use" "$logf" && return 2
            return 1
        fi
        "$ready" && return 0
        sleep 0.2
    done
    log "not ready after ${TIMEOUT}s"
    return 1
}

# --- etcd ---------------------------------------------------------------------------------------

etcd_ready() {
    # The log line proves that OUR etcd serves on the port; /health that it has a leader.
    grep -qs "serving client traffic" "$DIR/logs/etcd.log" &&
        curl -fsS --max-time 2 "http://127.0.0.1:$(cat "$DIR/run/etcd.port")/health" 2>/dev/null |
        grep -q '"health":"true"'
}

start_etcd() {
    local attempt client peer rc
    for attempt in 1 2 3 4 5 6 7 8; do
        client=$(random_port)
        peer=$(random_port)
        [ "$client" != "$peer" ] || continue
        echo "$client" >"$DIR/run/etcd.port"
        "$(etcd_dir)/etcd" --name=testenv --data-dir="$DIR/etcd" --unsafe-no-fsync \
            --listen-client-urls="http://127.0.0.1:$client" \
            --advertise-client-urls="http://127.0.0.1:$client" \
            --listen-peer-urls="http://127.0.0.1:$peer" \
            --initial-advertise-peer-urls="http://127.0.0.1:$peer" \
            --initial-cluster="testenv=http://127.0.0.1:$peer" \
            --log-outputs=stderr \
            </dev/null >"$DIR/logs/etcd.log" 2>&1 8>&- 9>&- &
        echo $! >"$DIR/run/etcd.pid"
        rc=0
        wait_started "$DIR/run/etcd.pid" "$DIR/logs/etcd.log" etcd_ready || rc=$?
        [ $rc -eq 0 ] && { log "etcd on 127.0.0.1:$client"; return 0; }
        [ $rc -eq 2 ] || { tail -n 30 "$DIR/logs/etcd.log" >&2; die "etcd did not start"; }
        log "etcd: port taken, attempt $attempt failed; trying others"
        rm -rf "$DIR/etcd"
    done
    die "etcd: no free port after 8 attempts"
}

# --- certificates -------------------------------------------------------------------------------

gen_certs() {
    local c=$DIR/pki
    [ -f "$c/admin.crt" ] && return 0
    mkdir -p "$c"
    (
        cd "$c"
        umask 077
        openssl ecparam -name prime256v1 -genkey -noout -out ca.key 2>/dev/null
        openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/CN=kinference-testenv-ca" \
            -out ca.crt 2>/dev/null
        # kube-apiserver's serving certificate: loopback only.
        openssl ecparam -name prime256v1 -genkey -noout -out apiserver.key 2>/dev/null
        openssl req -new -key apiserver.key -subj "/CN=kube-apiserver" -out apiserver.csr
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default\n%s\n' \
            'extendedKeyUsage=serverAuth' >apiserver.ext
        openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
            -sha256 -extfile apiserver.ext -out apiserver.crt 2>/dev/null
        # The admin client: group system:masters bypasses RBAC (as kubeadm's admin.conf did).
        openssl ecparam -name prime256v1 -genkey -noout -out admin.key 2>/dev/null
        openssl req -new -key admin.key -subj "/O=system:masters/CN=kinference-admin" -out admin.csr
        printf 'extendedKeyUsage=clientAuth\n' >admin.ext
        openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
            -sha256 -extfile admin.ext -out admin.crt 2>/dev/null
        # Service-account token signing (ES256).
        openssl ecparam -name prime256v1 -genkey -noout -out sa.key 2>/dev/null
        openssl ec -in sa.key -pubout -out sa.pub 2>/dev/null
        rm -f ./*.csr ./*.ext
    )
}

write_kubeconfig() {
    local port=$1 b64="base64 -w0"
    cat >"$DIR/kubeconfig.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: testenv
  cluster:
    server: https://127.0.0.1:$port
    certificate-authority-data: $($b64 <"$DIR/pki/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $($b64 <"$DIR/pki/admin.crt")
    client-key-data: $($b64 <"$DIR/pki/admin.key")
contexts:
- name: testenv
  context: {cluster: testenv, user: admin, namespace: default}
current-context: testenv
EOF
    chmod 600 "$DIR/kubeconfig.tmp"
    mv "$DIR/kubeconfig.tmp" "$DIR/kubeconfig"
}

# --- kube-apiserver -----------------------------------------------------------------------------

apiserver_ready() {
    local p=$DIR/pki
    grep -qs "Serving securely on" "$DIR/logs/kube-apiserver.log" &&
        curl -fsS --max-time 2 --cacert "$p/ca.crt" --cert "$p/admin.crt" --key "$p/admin.key" \
            "https://127.0.0.1:$(cat "$DIR/run/apiserver.port")/readyz" >/dev/null 2>&1
}

launch_apiserver() {
    local port=$1 p=$DIR/pki
    echo "$port" >"$DIR/run/apiserver.port"
    "$(kube_dir)/kube-apiserver" \
        --etcd-servers="http://127.0.0.1:$(cat "$DIR/run/etcd.port")" \
        --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$port" \
        --cert-dir="$DIR/apiserver" --tls-cert-file="$p/apiserver.crt" \
        --tls-private-key-file="$p/apiserver.key" --client-ca-file="$p/ca.crt" \
        --authorization-mode=RBAC --disable-admission-plugins=ServiceAccount \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --service-account-key-file="$p/sa.pub" --service-account-signing-key-file="$p/sa.key" \
        --service-cluster-ip-range=10.0.0.0/24 --allow-privileged=true \
        --endpoint-reconciler-type=none \
        </dev/null >"$DIR/logs/kube-apiserver.log" 2>&1 8>&- 9>&- &
    echo $! >"$DIR/run/apiserver.pid"
    local rc=0
    wait_started "$DIR/run/apiserver.pid" "$DIR/logs/kube-apiserver.log" apiserver_ready || rc=$?
    return $rc
}

start_apiserver() {
    local attempt rc
    for attempt in 1 2 3 4 5 6 7 8; do
        rc=0
        launch_apiserver "$(random_port)" || rc=$?
        [ $rc -eq 0 ] && { log "kube-apiserver on https://127.0.0.1:$(cat "$DIR/run/apiserver.port")"; return 0; }
        [ $rc -eq 2 ] || { tail -n 30 "$DIR/logs/kube-apiserver.log" >&2; die "kube-apiserver did not start"; }
        log "kube-apiserver: port taken, attempt $attempt failed; trying another"
    done
    die "kube-apiserver: no free port after 8 attempts"
}

write_env() {
    cat >"$DIR/env" <<EOF
export KUBECONFIG="$DIR/kubeconfig"
export KINFERENCE_K8S_KUBECONFIG="$DIR/kubeconfig"
export KINFERENCE_K8S_DIR="$DIR"
export PATH="$DIR/bin:\$PATH"
EOF
}

link_bins() {
    mkdir -p "$DIR/bin"
    ln -sfn "$(kube_dir)/kubectl" "$DIR/bin/kubectl"
    ln -sfn "$(kube_dir)/kube-apiserver" "$DIR/bin/kube-apiserver"
    ln -sfn "$(etcd_dir)/etcd" "$DIR/bin/etcd"
    ln -sfn "$(helm_dir)/helm" "$DIR/bin/helm"
}

# --- commands -----------------------------------------------------------------------------------

lock_dir() {
    mkdir -p "$DIR"
    exec 9>"$DIR/lock"
    flock 9
}

cmd_up() {
    local t0=$SECONDS
    build_all
    lock_dir
    if alive "$DIR/run/apiserver.pid" && alive "$DIR/run/etcd.pid" && apiserver_ready; then
        log "already up (KUBECONFIG=$DIR/kubeconfig)"
        return 0
    fi
    # Leftovers of a run that died: stop what still runs and start from empty data.
    stop_proc "$DIR/run/apiserver.pid" kube-apiserver
    stop_proc "$DIR/run/etcd.pid" etcd
    # An `up` that fails or is interrupted leaves nothing running.
    trap 'exit 143' INT TERM
    trap 'stop_proc "$DIR/run/apiserver.pid" kube-apiserver; stop_proc "$DIR/run/etcd.pid" etcd' EXIT
    rm -rf "$DIR/etcd" "$DIR/apiserver" "$DIR/run"
    mkdir -p "$DIR/run" "$DIR/logs" "$DIR/apiserver"
    command -v openssl >/dev/null || die "openssl is not installed"
    command -v curl >/dev/null || die "curl is not installed"
    gen_certs
    link_bins
    start_etcd
    start_apiserver
    write_kubeconfig "$(cat "$DIR/run/apiserver.port")"
    write_env
    trap - EXIT INT TERM
    log "up in $((SECONDS - t0))s: source $DIR/env"
}

cmd_down() {
    lock_dir
    stop_proc "$DIR/run/apiserver.pid" kube-apiserver
    stop_proc "$DIR/run/etcd.pid" etcd
}

cmd_apiserver_stop() {
    lock_dir
    stop_proc "$DIR/run/apiserver.pid" kube-apiserver
}

cmd_apiserver_start() {
    lock_dir
    alive "$DIR/run/etcd.pid" || die "etcd is not running in $DIR: run 'up' first"
    alive "$DIR/run/apiserver.pid" && return 0
    # Same port, so clients keep their kubeconfig; a port taken meanwhile is an error, not a retry.
    launch_apiserver "$(cat "$DIR/run/apiserver.port")" ||
        { tail -n 30 "$DIR/logs/kube-apiserver.log" >&2; die "kube-apiserver did not restart"; }
    log "kube-apiserver restarted on https://127.0.0.1:$(cat "$DIR/run/apiserver.port")"
}

cmd_pod_ready() {
    local ns=$1 pod=$2 ip=$3 ready=${4:-true} status now
    case $ready in true) status=True ;; false) status=False ;; *) die "pod-ready: READY is true or false" ;; esac
    now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    KUBECONFIG="$DIR/kubeconfig" "$DIR/bin/kubectl" -n "$ns" patch pod "$pod" \
        --subresource=status --type=merge -p "{\"status\":{\"phase\":\"Running\",
        \"podIP\":\"$ip\",\"podIPs\":[{\"ip\":\"$ip\"}],\"conditions\":[
        {\"type\":\"Ready\",\"status\":\"$status\",\"lastTransitionTime\":\"$now\"},
        {\"type\":\"ContainersReady\",\"status\":\"$status\",\"lastTransitionTime\":\"$now\"}]}}"
}

usage() { sed -n '3,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

main() {
    local cmd=${1:-}
    [ -n "$cmd" ] || usage
    shift
    case $cmd in
        build) build_all; echo "$(kube_dir) $(etcd_dir) $(helm_dir)" ;;
        up | down | env | apiserver-stop | apiserver-start | pod-ready)
            [ $# -ge 1 ] || usage
            [ "$cmd" != up ] || mkdir -p "$1"
            [ -d "$1" ] || { [ "$cmd" = down ] && exit 0; die "$1: no such directory"; }
            DIR=$(cd "$1" && pwd)
            shift
            case $cmd in
                up) cmd_up ;;
                down) cmd_down ;;
                env) cat "$DIR/env" ;;
                apiserver-stop) cmd_apiserver_stop ;;
                apiserver-start) cmd_apiserver_start ;;
                pod-ready) [ $# -ge 3 ] || usage; cmd_pod_ready "$@" ;;
            esac
            ;;
        *) usage ;;
    esac
}

# `exit` on the same line: bash reads a script while running it, and a checkout that changes this
# file during a long build would otherwise run whatever text ends up after this line.
main "$@"; exit
