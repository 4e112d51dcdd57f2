#!/usr/bin/env bash
# chaos.sh - the router under chaos (issue 16's soak), on loopback and bounded in time.
#
# A fleet of simulated replicas, one `kinference sim` process each (so that one can be
# SIGKILLed and restarted on its ports), publishing KV events to `kinference serve` (precise
# policy; the router binds one events port per replica, the replicas' PUBs connect, each
# replica binds its replay port) with injected event faults (--events-drop-pct, -dup-pct,
# -reorder-pct). Streamed multi-turn chat load (scripts/chaos_client.py) runs CHAOS_MINUTES
# while, in turn: a replica is SIGKILLed mid-stream and restarted on the same ports, the
# router is restarted (SIGTERM: it drains; the client goes on, and its connection errors
# meanwhile are counted apart), and once a replica is restarted with another --hash-seed (its
# block hashes then differ from the router's). Then the load stops, the fleet settles, and:
#   - every request completed or got a clean error (none hung, none truncated without an
#     error event), and requests failed only inside a kill or restart window;
#   - per replica, the router's index entries equal the replica's cached blocks
#     (/debug/cache), with the router caught up on its event stream;
#   - the replica with the other hash seed is unscorable;
#   - the router's RSS and descriptors stayed under bounds (sampled every second).
# A table of figures is printed; the exit status is 1 if a check failed.
#
# Status: in CI (short form, CHAOS_MINUTES=2, all faults on). A live sequence number that went
# back (a duplicate, or a late message after a reorder) is checked against the publisher's
# replay before anything is cleared (a copy is skipped and counted as a repeat), and a replay
# cut short after progress (a hole, a lost end marker, or a lost tail before the end marker) is
# asked again from where it stopped (BENCHMARKS.md, "Chaos soak").
#
# usage: scripts/chaos.sh [BINARY]
#   BINARY is a built `kinference`; without it `cargo build --release -p kinference` builds it.
# env: CHAOS_MINUTES     load duration (10; CI: 2)      CHAOS_REPLICAS  replicas (4)
#      CHAOS_PERIOD      seconds between chaos actions (10)
#      CHAOS_CONCURRENCY client conversations at once (12)
#      CHAOS_DROP_PCT / CHAOS_DUP_PCT / CHAOS_REORDER_PCT   event faults (2 / 0.5 / 1)
#      CHAOS_SPEEDUP     simulator speedup (2)          CHAOS_SEED  (1)
#      CHAOS_BUFFER_STEPS  replay buffer per replica (1000000: the whole run, see below)
#      CHAOS_MAX_RSS_MIB / CHAOS_MAX_FDS  router bounds (512 / 1024)
#      CHAOS_KEEP        keep the work directory (logs, results) and print its path
#      CHAOS_ROUTER_LOG  the router's RUST_LOG (info,kinference_events=debug: each replay
#                        round is logged, and the last of them are printed when a check fails)
#
# The replay buffer holds the whole run so that a router restarted late can ask for every batch
# from sequence 0. The replica's replay ROUTER socket has libzmq's default send high-water mark
# (1,000 messages, as vLLM's), so a replay longer than that arrives in parts; the router asks
# again from the first batch it lacks until it has caught up.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
T0=$(date +%s)
log() { echo "[chaos +$(( $(date +%s) - T0 ))s] $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"

MINUTES=${CHAOS_MINUTES:-10}
N=${CHAOS_REPLICAS:-4}
PERIOD=${CHAOS_PERIOD:-10}
SEED=${CHAOS_SEED:-1}
SEED_REPLICA=$(( N - 1 ))
WORK=$(mktemp -d)
declare -a SIM_PID HASH_SEED
ROUTER_PID="" LOAD_PID="" SAMPLER_PID=""
cleanup() {
  touch "$WORK/stop"
  stop "$LOAD_PID" 5
  stop "$SAMPLER_PID" 5
  stop "$ROUTER_PID" 15
  local i
  for i in "${!SIM_PID[@]}"; do stop "${SIM_PID[$i]}" 5; done
  if [ -n "${CHAOS_KEEP:-}" ]; then log "work directory kept: $WORK"; else rm -rf "$WORK"; fi
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BIN=$(kinference_binary "$REPO" release "${1:-}") || die "no kinference binary"

# Ports: per replica HTTP, events (bound by the router) and replay (bound by the replica);
# the router's data and admin ports. Fixed for the run: restarts come back on the same ones.
read -r -a PORTS <<<"$(free_ports $(( 3 * N + 2 )))"
DATA_PORT=${PORTS[$(( 3 * N ))]} ADMIN_PORT=${PORTS[$(( 3 * N + 1 ))]}
http_port() { echo "${PORTS[$1]}"; }
events_port() { echo "${PORTS[$(( N + $1 ))]}"; }
replay_port() { echo "${PORTS[$(( 2 * N + $1 ))]}"; }
chaos() { echo "$(date +%s.%N) $*" >>"$WORK/chaos.log"; }
: >"$WORK/chaos.log"

RESTARTS=0
start_sim() {
  local i=$1 seed_flag=()
  [ -z "${HASH_SEED[$i]:-}" ] || seed_flag=(--hash-seed "${HASH_SEED[$i]}")
  RESTARTS=$(( RESTARTS + 1 ))
  NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port "$(http_port "$i")" --replicas 1 --model tiny \
    --tokenizer "$TOKENIZER" --block-size 16 --num-gpu-blocks 1500 --max-num-seqs 16 \
    --speedup "${CHAOS_SPEEDUP:-2}" "${seed_flag[@]}" \
    --kv-events-config "{\"endpoint\":\"tcp://127.0.0.1:$(events_port "$i")\",\"replay_endpoint\":\"tcp://127.0.0.1:$(replay_port "$i")\",\"buffer_steps\":${CHAOS_BUFFER_STEPS:-1000000}}" \
    --events-drop-pct "${CHAOS_DROP_PCT:-2}" --events-dup-pct "${CHAOS_DUP_PCT:-0.5}" \
    --events-reorder-pct "${CHAOS_REORDER_PCT:-1}" \
    --events-fault-seed $(( SEED * 100000 + i * 1000 + RESTARTS )) \
    >"$WORK/sim$i.out" 2>>"$WORK/sim$i.err" &
  SIM_PID[$i]=$!
  wait_http "http://127.0.0.1:$(http_port "$i")/health" "${SIM_PID[$i]}" 30 ||
    die "replica $i did not start: $(tail -5 "$WORK/sim$i.err")"
}

start_router() {
  local flags=() i
  for i in $(seq 0 $(( N - 1 ))); do
    flags+=(--replica "http://127.0.0.1:$(http_port "$i"),bind=tcp://127.0.0.1:$(events_port "$i"),replay=tcp://127.0.0.1:$(replay_port "$i")")
  done
  NO_COLOR=1 RUST_LOG=${CHAOS_ROUTER_LOG:-info,kinference_events=debug} \
    "$BIN" serve --listen "127.0.0.1:$DATA_PORT" --admin "127.0.0.1:$ADMIN_PORT" \
    --model tiny --tokenizer "$TOKENIZER" --block-size 16 --policy precise \
    --expose-endpoint-header --drain-ms 15000 --scrape-interval-ms 500 \
    "${flags[@]}" >>"$WORK/router.out" 2>>"$WORK/router.err" &
  ROUTER_PID=$!
  echo "$ROUTER_PID" >"$WORK/router.pid"
  wait_http "http://127.0.0.1:$ADMIN_PORT/readyz" "$ROUTER_PID" 60 ||
    die "the router is not ready: $(tail -5 "$WORK/router.err")"
}

log "fleet: $N replicas, loads for $MINUTES min, an action every $PERIOD s"
: >"$WORK/fleet"
FLEET_ADDRS=""
for i in $(seq 0 $(( N - 1 ))); do
  start_sim "$i"
  echo "$i http://127.0.0.1:$(http_port "$i")" >>"$WORK/fleet"
  FLEET_ADDRS+="$i=127.0.0.1:$(http_port "$i"),"
done
start_router
wait_router_ready "http://127.0.0.1:$ADMIN_PORT" "$ROUTER_PID" "$N" 30 || die "the router is not ready"

DURATION=$(( MINUTES * 60 ))
python3 "$HERE/chaos_client.py" sample "$WORK/router.pid" "$WORK/samples.jsonl" "$WORK/stop" &
SAMPLER_PID=$!
python3 "$HERE/chaos_client.py" load "http://127.0.0.1:$DATA_PORT" "$WORK/results.jsonl" \
  duration="$DURATION" concurrency="${CHAOS_CONCURRENCY:-12}" seed="$SEED" timeout=30 total=90 &
LOAD_PID=$!

# The chaos: one action every PERIOD s until 20 s before the load ends. Actions cycle through
# kill-and-restart of a replica (random, mid-stream: the load is steady), and the third of
# every four a router restart (so that the short form restarts the router early, and replicas
# are then killed under the restarted router); the hash-seed flip happens once, at the first
# other action a third of the way in.
RNG=$SEED
# rand N: sets R to a number in 0..N-1 (not in a subshell, so the generator advances).
rand() { RNG=$(( (RNG * 1103515245 + 12345) % 2147483648 )); R=$(( (RNG >> 16) % $1 )); }
CHAOS_END=$(( $(date +%s) + DURATION - 20 ))
FLIP_AT=$(( $(date +%s) + DURATION / 3 ))
FLIPPED="" ACTION=0 KILLS=0 ROUTER_RESTARTS=0
sleep "$PERIOD"
while [ "$(date +%s)" -lt "$CHAOS_END" ] && kill -0 "$LOAD_PID" 2>/dev/null; do
  ACTION=$(( ACTION + 1 ))
  if [ $(( ACTION % 4 )) -eq 3 ]; then
    log "router: restart (SIGTERM, drain)"
    chaos router_down
    stop "$ROUTER_PID" 30
    start_router
    chaos router_up
    ROUTER_RESTARTS=$(( ROUTER_RESTARTS + 1 ))
  elif [ -z "$FLIPPED" ] && [ "$(date +%s)" -ge "$FLIP_AT" ]; then
    i=$SEED_REPLICA
    log "replica $i: restart with --hash-seed 4242"
    chaos replica_down "$i"; chaos seed_flip "$i"
    kill -KILL "${SIM_PID[$i]}" 2>/dev/null || true
    wait "${SIM_PID[$i]}" 2>/dev/null || true
    HASH_SEED[$i]=4242
    start_sim "$i"
    chaos replica_up "$i"
    FLIPPED=1
  else
    rand "$N"; i=$R
    rand 3; down=$(( 1 + R ))
    log "replica $i: SIGKILL, back in ${down} s"
    chaos replica_down "$i"
    kill -KILL "${SIM_PID[$i]}" 2>/dev/null || true
    wait "${SIM_PID[$i]}" 2>/dev/null || true
    sleep "$down"
    start_sim "$i"
    chaos replica_up "$i"
    KILLS=$(( KILLS + 1 ))
  fi
  sleep "$PERIOD"
done
log "chaos over: $KILLS kills, $ROUTER_RESTARTS router restarts, seed flip: ${FLIPPED:-no}; waiting for the load"
wait "$LOAD_PID" || die "the load client failed"
LOAD_PID=""

# Settle: the router must be ready with every stream connected; then compare.
log "settling"
sleep 5
python3 "$HERE/chaos_client.py" settle "127.0.0.1:$ADMIN_PORT" "$WORK/fleet" "$WORK/settle.json" flushes=15
touch "$WORK/stop"
wait "$SAMPLER_PID" 2>/dev/null || true
SAMPLER_PID=""
log "report (replica $SEED_REPLICA runs another hash seed)"
if ! python3 "$HERE/chaos_client.py" report "$WORK/results.jsonl" "$WORK/chaos.log" \
  "$WORK/samples.jsonl" "$WORK/settle.json" seed_replica="$SEED_REPLICA" \
  max_rss_mib="${CHAOS_MAX_RSS_MIB:-512}" max_fds="${CHAOS_MAX_FDS:-1024}" \
  fleet_addrs="$FLEET_ADDRS" grace=3; then
  # The work directory goes with the run (CI keeps only its output): show what the event
  # streams did, so that a failure that does not come back can still be read.
  log "a check failed; the last event-stream warnings and replay rounds (router.err):"
  grep -E "(WARN|DEBUG) kinference_events::" "$WORK/router.err" | tail -n 60 >&2 || true
  exit 1
fi
