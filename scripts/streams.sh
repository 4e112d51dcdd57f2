#!/usr/bin/env bash
# streams.sh - the router's memory and CPU per open stream (issue 16): N streamed completions
# held open through one router at once (default 10,000), in front of one simulator process with
# 4 replicas slowed down so that every stream stays open until all have their response head.
# Per run: the router's RSS before and with every stream open, its CPU over the whole run, and
# how every stream ended (`data: [DONE]`, cut, refused). Two transports:
#   h1  one HTTP/1.1 connection per stream
#   h2  the streams spread over HTTP/2 connections (prior knowledge), 250 per connection
# Every stream also holds one upstream HTTP/1.1 connection from the router to its replica, so
# with h1 the router holds 2 descriptors per stream: this container's hard limit of 20,000 open
# files caps an h1 run at about 9,900 streams, and the h2 run is what reaches 10,000.
#
# usage: scripts/streams.sh [BINARY]
#   BINARY is a built `kinference`; without it `cargo build --release -p kinference` builds it.
# env: STREAMS_H1=9000   streams of the HTTP/1.1 run (0: skip)
#      STREAMS_H2=10000  streams of the HTTP/2 run (0: skip)
#      STREAMS_MAX_TOKENS=16   tokens per stream
#      STREAMS_SPEEDUP=0.05    simulated seconds per second (lower: longer streams)
#      STREAMS_MAX_KIB=64      fail when the router's RSS grew by more than this per open stream
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
T0=$(date +%s)
log() { echo "[streams +$(( $(date +%s) - T0 ))s] $*" >&2; }
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
H1=${STREAMS_H1:-9000}
H2=${STREAMS_H2:-10000}
MAX_KIB=${STREAMS_MAX_KIB:-64}
ulimit -n "$(ulimit -Hn)"
need=$(( (H1 > H2 ? H1 : H2) + 200 ))
[ "$(ulimit -n)" -ge "$need" ] || die "ulimit -n is $(ulimit -n); $need descriptors are needed"
log "building the load client"
(cd "$REPO" && cargo build --release -q -p kinference-proxy --example streams) ||
  die "the load client did not build"
LOAD=$REPO/target/release/examples/streams
[ -n "${CARGO_TARGET_DIR:-}" ] && LOAD=$CARGO_TARGET_DIR/release/examples/streams

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
fds() { find "/proc/$1/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l; }
TICK=$(getconf CLK_TCK)

# One sequence slot per stream (2,600 per replica) and KV room for all of them, so that none
# waits in a replica's queue with its head unsent.
NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas 4 --model tiny \
  --tokenizer "$TOKENIZER" --block-size 16 --max-num-seqs 2600 --num-gpu-blocks 40000 \
  --max-num-batched-tokens 65536 --speedup "${STREAMS_SPEEDUP:-0.05}" \
  >"$WORK/sim.out" 2>"$WORK/sim.err" &
SIM_PID=$!
wait_sim_replicas "$WORK/sim.out" "$SIM_PID" 4 60 || die "the simulator did not start"
flags=()
while read -r line; do
  flags+=(--replica "$(field "$line" url)")
done < <(grep '^replica=' "$WORK/sim.out")

cap=$(( (H1 > H2 ? H1 : H2) + 100 ))
# A fresh router per run, so that each run's RSS starts from a router that held no stream.
start_router() {
  stop "$ROUTER_PID"
  # The last router's log goes first: router_addrs could read it before the new one truncates it.
  rm -f "$WORK/router.err"
  NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model tiny \
    --tokenizer "$TOKENIZER" --block-size 16 --max-connections "$cap" --max-in-flight "$cap" \
    "${flags[@]}" >"$WORK/router.out" 2>"$WORK/router.err" &
  ROUTER_PID=$!
  read -r DATA_ADDR ADMIN_ADDR < <(router_addrs "$WORK/router.err" "$ROUTER_PID" 60) ||
    die "the router did not start"
  wait_http "http://$ADMIN_ADDR/readyz" "$ROUTER_PID" 60 || die "the router is not ready"
}

failed=0
run() { # name streams [load flags...]
  local name=$1 n=$2; shift 2
  [ "$n" -gt 0 ] || return 0
  log "$name: $n streams"
  start_router
  local rss0 cpu0 rss1 fds1 cpu1 out line
  rss0=$(rss_kib "$ROUTER_PID") cpu0=$(cpu_ticks "$ROUTER_PID")
  out=$WORK/$name.out
  "$LOAD" --addr "$DATA_ADDR" --model tiny --streams "$n" \
    --max-tokens "${STREAMS_MAX_TOKENS:-16}" "$@" >"$out" 2>"$WORK/$name.err" &
  local load_pid=$!
  while ! grep -q '^open ' "$out" 2>/dev/null; do
    kill -0 "$load_pid" 2>/dev/null || break
    sleep 0.2
  done
  rss1=$(rss_kib "$ROUTER_PID") fds1=$(fds "$ROUTER_PID")
  local in_flight
  in_flight=$(python3 "$HERE/lib/prom.py" "http://$ADMIN_ADDR/metrics" kinference_worker_in_flight)
  wait "$load_pid" || true
  cpu1=$(cpu_ticks "$ROUTER_PID")
  line=$(grep '^{' "$out" || echo '{}')
  python3 - "$name" "$n" "$rss0" "$rss1" "$fds1" "$in_flight" "$(( cpu1 - cpu0 ))" "$TICK" \
    "$MAX_KIB" "$line" <<'EOF' || failed=1
import json, sys
name, n, rss0, rss1, fds1, in_flight, ticks, tick, max_kib, line = sys.argv[1:]
n, rss0, rss1, ticks, tick = int(n), int(rss0), int(rss1), int(ticks), int(tick)
load = json.loads(line)
done = load.get("ends", {}).get("done", 0)
per_stream = (rss1 - rss0) / n
out = {
    "run": name, "streams": n, "heads": load.get("heads"), "done": done,
    "ends": load.get("ends"), "statuses": load.get("statuses"),
    "router_in_flight_when_open": float(in_flight), "router_fds_when_open": int(fds1),
    "router_rss_mib_before": round(rss0 / 1024, 1), "router_rss_mib_open": round(rss1 / 1024, 1),
    "router_kib_per_open_stream": round(per_stream, 1),
    "router_cpu_s": round(ticks / tick, 2),
    "router_cpu_ms_per_stream": round(1000 * ticks / tick / n, 3),
    "chunks": load.get("chunks"), "all_open_secs": load.get("all_open_secs"),
    "secs": load.get("secs"),
}
print(json.dumps(out))
problems = []
if done != n:
    problems.append(f"{n - done} of {n} streams did not end with [DONE]")
if float(in_flight) != n:
    problems.append(f"the router had {in_flight} requests in flight when all {n} were open")
if per_stream > float(max_kib):
    problems.append(f"{per_stream:.1f} KiB per open stream > {max_kib}")
for p in problems:
    print(f"{name}: {p}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
}

run h1 "$H1"
run h2 "$H2" --h2-connections $(( (H2 + 249) / 250 ))
log "router RSS after: $(( $(rss_kib "$ROUTER_PID") / 1024 )) MiB, fds $(fds "$ROUTER_PID")"
[ "$failed" -eq 0 ] || die "a check failed"
log "all checks passed"
