#!/usr/bin/env bash
# limits.sh - the router under hostile and excessive clients (issue 16): one simulator process
# with 2 replicas (8 sequences each: the fleet's capacity is 16 requests) and one router with
# --max-in-flight at that capacity. Three phases, each one JSON line (scripts/limits_load.py):
#   stalled  3,000 connections send half a request head and stall while normal requests are
#            served: the router's descriptors before, with them open, and after the head
#            timeout closed them
#   idle     6,000 kept-alive idle connections: the router's RSS before and with them open
#   burst    completions unloaded, at capacity, and in bursts of 10x capacity: statuses,
#            Retry-After, latency of admitted and shed requests
# then the router's shed/timeout/connection counters from /metrics.
#
# usage: scripts/limits.sh [BINARY]
#   BINARY is a built `kinference`; without it `cargo build --release -p kinference` builds it.
# env: LIMITS_ROUTER_ARGS  extra `kinference serve` flags (default: none)
#      LIMITS_STALLED      stalled connections (3000)     LIMITS_IDLE   idle connections (6000)
#      LIMITS_BURST        requests per burst (160)       LIMITS_WAVES  bursts, one a second (20)
#      LIMITS_QUEUE        --max-queue (0)                LIMITS_SPEEDUP simulator speedup (4)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
T0=$(date +%s)
log() { echo "[limits +$(( $(date +%s) - T0 ))s] $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"

WORK=$(mktemp -d)
SIM_PID="" ROUTER_PID=""
cleanup() {
  stop "$ROUTER_PID"
  stop "$SIM_PID"
  rm -rf "$WORK"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BIN=$(kinference_binary "$REPO" release "${1:-}") || die "no kinference binary"
# 6,000 client sockets in this shell's load process, as many in the router.
ulimit -n "$(ulimit -Hn)"
[ "$(ulimit -n)" -ge 16000 ] || die "ulimit -n is $(ulimit -n); 16000 descriptors are needed"

NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas 2 --model tiny \
  --tokenizer "$TOKENIZER" --block-size 16 --max-num-seqs 8 --speedup "${LIMITS_SPEEDUP:-4}" \
  >"$WORK/sim.out" 2>"$WORK/sim.err" &
SIM_PID=$!
wait_sim_replicas "$WORK/sim.out" "$SIM_PID" 2 60 || die "the simulator did not start"
flags=()
while read -r line; do
  flags+=(--replica "$(field "$line" url)")
done < <(grep '^replica=' "$WORK/sim.out")

# shellcheck disable=SC2086 # LIMITS_ROUTER_ARGS is a list of flags
NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model tiny \
  --tokenizer "$TOKENIZER" --block-size 16 --max-in-flight 16 --max-queue "${LIMITS_QUEUE:-0}" \
  ${LIMITS_ROUTER_ARGS:-} "${flags[@]}" >"$WORK/router.out" 2>"$WORK/router.err" &
ROUTER_PID=$!
read -r DATA_ADDR ADMIN_ADDR < <(router_addrs "$WORK/router.err" "$ROUTER_PID" 60) ||
  die "the router did not start"
wait_http "http://$ADMIN_ADDR/readyz" "$ROUTER_PID" 60 || die "the router is not ready"

load() { python3 "$HERE/limits_load.py" "$1" "$DATA_ADDR" "$ADMIN_ADDR" "$ROUTER_PID" "${@:2}"; }
log "stalled heads"
load stalled n="${LIMITS_STALLED:-3000}"
log "idle connections"
load idle n="${LIMITS_IDLE:-6000}"
log "bursts"
load burst cap=16 burst="${LIMITS_BURST:-160}" waves="${LIMITS_WAVES:-20}"
log "counters"
curl -s "http://$ADMIN_ADDR/metrics" |
  grep -E '^kinference_(shed_requests|client_timeouts|accept_pauses|accept_errors|client_connections|queued_requests)' || true
