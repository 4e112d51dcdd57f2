#!/usr/bin/env bash
# router-paired.sh - what two routers add at one connection, compared request by request: the
# same chat requests sent to both in turn (scripts/lib/paired_client.py), so that the machine's
# drift, which on a small shared machine moves router-latency.sh's one-connection p50 between
# runs by more than a change to the router does, falls on both sides alike.
#
# Each side is a router in front of 4 simulated replicas of its own (`kinference sim`, as in
# scripts/router-latency.sh: speedup 100,000, KV events on), so neither side's requests warm the
# other's replicas. A side is:
#   a `kinference` binary   `kinference serve --policy precise` (KINF_FLAGS added), subscribed
#                           to its replicas' KV events, started after they are up and ready
#                           before the first request (every event stream subscribed)
#   nginx                   Debian's nginx, round-robin, keep-alive both ways (scripts/lib/nginx.sh)
#   direct                  no router: replica 0 of its simulator
#   nginx+sink, direct+sink nginx or direct, with an idle `kinference serve` (SIM_BIN) subscribed
#                           to the replicas' KV events, as a kinference side's replicas are to
#                           their router: replicas publish only to a subscriber, so without one
#                           a kinference side's replicas do work on the shared cores that the
#                           other side's do not (router-latency.sh's EVENTS_SINK)
# `direct direct` measures the method itself: its median difference should be about zero. The
# client is Python: its own time per request is in both sides' latencies, not in their
# difference.
#
# The requests are router-latency.sh's chat workload (scripts/lib/chat_bodies.py: real
# conversations, each turn with its history, a unique tag at the end), /v1/chat/completions,
# max_tokens 8, not streamed (STREAM=1: streamed). Runs WINDOWS times, the sides swapping
# positions between runs (see the end), and prints per run each side's median and p90 and the
# median of the per-pair differences with its 95 % interval, then B - A over the runs with its
# standard error; writes every latency under the results directory.
#
# usage: scripts/router-paired.sh A B
#   A, B: a kinference binary, `nginx`, `direct`, `nginx+sink` or `direct+sink`; the replicas
#   are run by SIM_BIN (default: the first of A and B that is a binary).
# env: REQUESTS=5000    recorded pairs per run
#      WARMUP=500       pairs sent first in each run, not recorded
#      WINDOWS=6        runs (even: each side is first in half of them)
#      STREAM=          when set, the requests are streamed (SSE)
#      TOKENIZER=qwen3  a directory, or the name of one in ../shared/data/tokenizers
#      KINF_FLAGS=      extra `kinference serve` flags, word-split (both kinference sides)
#      SIM_BIN=         the `kinference` binary that runs the replicas
#      RESULTS=target/router-paired   (a timestamped directory is made in it)
set -euo pipefail
case ${1:-} in -h | --help | "") sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
[ $# -eq 2 ] || { echo "usage: $0 A B (see --help)" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
# shellcheck source=lib/nginx.sh
source "$HERE/lib/nginx.sh"
# shellcheck source=lib/bench.sh
source "$HERE/lib/bench.sh"

SIDES=("$1" "$2")
REQUESTS=${REQUESTS:-5000}
WARMUP=${WARMUP:-500}
WINDOWS=${WINDOWS:-6}
[[ "$WINDOWS" =~ ^[1-9][0-9]*$ ]] && [ $(( WINDOWS % 2 )) = 0 ] || { echo "WINDOWS must be a positive even number" >&2; exit 2; }
TOKENIZER=${TOKENIZER:-qwen3}
[ -d "$TOKENIZER" ] || TOKENIZER=$REPO/../shared/data/tokenizers/$TOKENIZER
[ -f "$TOKENIZER/tokenizer.json" ] || { echo "no tokenizer.json in $TOKENIZER" >&2; exit 1; }
TOKENIZER=$(cd "$TOKENIZER" && pwd)
read -r -a KINF_EXTRA <<<"${KINF_FLAGS:-}"
OUT=${RESULTS:-$REPO/target/router-paired}/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
log() { echo "[router-paired] $*" >&2; }
die() { log "error: $*"; exit 1; }

SIM=${SIM_BIN:-}
for s in "${SIDES[@]}"; do
  case $s in
    nginx | nginx+sink)
      nginx_bin >/dev/null || die "nginx is needed"
      ;;
    direct | direct+sink) ;;
    *)
      [ -x "$s" ] || die "$s is neither a kinference binary, nginx, direct nor one of them +sink"
      [ -n "$SIM" ] || SIM=$s
      ;;
  esac
done
[ -n "$SIM" ] || die "no kinference binary among the sides: name one in SIM_BIN to run the replicas"
python3 "$HERE/lib/chat_bodies.py" "$OUT/chat-bodies.tsv" || die "could not write the chat requests"

trap stop_all EXIT
trap 'exit 130' INT TERM

# start_side I SIDE DIR: SIDE's replicas and router, in DIR; sets URL.
start_side() {
  local i=$1 side=$2 dir=$3 failed=
  mkdir -p "$dir"
  start_sim "$SIM" "$TOKENIZER" "$dir" || { stop_tree "$SIM_PID" 5; die "$side's simulator did not start"; }
  PIDS+=("$SIM_PID")
  case $side in
    direct | direct+sink)
      URL=${SIM_URLS[0]}
      ;;
    nginx | nginx+sink)
      start_nginx "$dir/nginx" "$(nproc)" "$dir/router" "${SIM_URLS[@]}" || failed=1
      PIDS+=("$NGINX_PID")
      [ -z "${failed:-}" ] || die "nginx did not start"
      URL=$NGINX_URL
      ;;
    *)
      serve "$side" "$dir/router" "${KINF_EXTRA[@]}"
      URL=$SERVED
      ;;
  esac
  if [[ $side == *+sink ]]; then serve "$SIM" "$dir/sink"; fi
  echo "position $i: $side at $URL, replicas ${SIM_URLS[*]}" >>"$OUT/sides.txt"
}

# serve BIN PREFIX [FLAGS...]: `kinference serve` in front of the side's replicas (output in
# PREFIX.out and PREFIX.err), ready (every event stream subscribed); sets SERVED to its URL.
serve() {
  local bin=$1 prefix=$2 pid data admin
  shift 2
  bench_serve "$bin" "$prefix" "$@"
  pid=$!
  PIDS+=("$pid")
  read -r data admin < <(router_addrs "$prefix.err" "$pid" 120) || die "$bin did not start (see $prefix.err)"
  wait_router_ready "http://$admin" "$pid" 4 60 || die "$bin was not ready (see $prefix.err)"
  SERVED=http://$data
}

describe() { # SIDE
  case $1 in nginx | direct | *+sink) echo "$1" ;; *) echo "$1 ($("$1" --version 2>/dev/null))" ;; esac
}

{
  echo "A: $(describe "${SIDES[0]}")"
  echo "B: $(describe "${SIDES[1]}")"
  echo "tokenizer: $TOKENIZER; KINF_FLAGS: ${KINF_FLAGS:-}; $WINDOWS runs of $REQUESTS pairs"
} | tee "$OUT/summary.txt"
# WINDOWS runs of REQUESTS pairs, each with fresh replicas and routers, A in the first
# position and B in the second in even runs and the other way round in odd ones. Two processes
# of the same build differ (where their threads and memory land): seen here by a few
# microseconds per request between the positions of one run and between runs. Within a run
# the pairs cancel the machine's drift; over runs, the alternating positions cancel what the
# position costs, and the spread of the runs' figures is the measurement's own uncertainty,
# processes' differences included.
for ((w = 0; w < WINDOWS; w++)); do
  order=$(( w % 2 ))
  urls=()
  for pos in 0 1; do
    start_side "$pos" "${SIDES[$(( pos ^ order ))]}" "$OUT/run$w/pos$pos"
    urls+=("$URL")
  done
  {
    echo "--- run $w: $([ $order = 0 ] && echo "A first, B second" || echo "B first, A second")"
    python3 "$HERE/lib/paired_client.py" "${urls[0]}" "${urls[1]}" "$OUT/chat-bodies.tsv" \
      "$REQUESTS" "$WARMUP" "$OUT/run$w" ${STREAM:+--stream} |
      sed "s/^A:/position 1:/; s/^B:/position 2:/; s/B - A per pair/second - first per pair/; s/^B faster/second faster/"
  } | tee -a "$OUT/summary.txt"
  stop_all
done
python3 - "$OUT" "$WINDOWS" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}/run{w}/result.json")) for w in range(n)]
# Run w measured (second - first): B - A in even runs, A - B in odd ones.
effects = [r["diff_median_us"] * (1 if w % 2 == 0 else -1) for w, r in enumerate(runs)]
a = [r["a_median_us"] if w % 2 == 0 else r["b_median_us"] for w, r in enumerate(runs)]
b = [r["b_median_us"] if w % 2 == 0 else r["a_median_us"] for w, r in enumerate(runs)]
mean = statistics.fmean(effects)
se = statistics.stdev(effects) / len(effects) ** 0.5
print(f"B - A per run: {', '.join(f'{e:+.1f}' for e in effects)} us")
print(f"B - A: {mean:+.1f} us (standard error {se:.1f} us over {n} runs); medians per run "
      f"A {statistics.fmean(a):.1f} us, B {statistics.fmean(b):.1f} us (means of the runs')")
PYEOF
log "results in $OUT"
