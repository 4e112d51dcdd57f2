#!/usr/bin/env bash
# router-allocations.sh - the heap allocations `kinference serve` makes per request under load,
# counted by uprobes on the binary's allocator (mimalloc's aligned entry points, which Rust's
# global allocator calls), in the setup of scripts/router-syscalls.sh: 4 simulated replicas
# with KV events on, the router with --policy precise in front, wrk at 32 connections with the
# developers' workload (WORKLOAD=chat: router-latency.sh's real conversations). A warm-up of
# WARMUP, then DURATION counted. Prints allocations, reallocations and frees per request for
# the data-plane threads (kinf-data-*) and the rest (KV events, scrapes). A uprobe traps on
# every call, so the run serves far fewer requests per second than an unprobed one; the counts
# per request are what it is for.
#
# With STACKS=1, a second run then records the allocations and reallocations with their call
# stacks (perf record --call-graph dwarf on the same probes) and prints the data-plane threads'
# per request by allocation site, then the other threads': the first STACKS_DEPTH frames
# (default 2) that are not the allocator, the standard library or the collections
# (scripts/lib/alloc_sites.py).
#
# Needs perf with uprobe access (root), wrk and curl (and python3 for STACKS=1); the probes are
# removed on exit.
#
# usage: scripts/router-allocations.sh BINARY
# env: TOKENIZER=../shared/data/tokenizers/llama3.1 WARMUP=3s DURATION=4s WORKLOAD=dev (or chat)
#      RESULTS=target/router-allocations
#      STACKS=1 STACKS_DEPTH=2
set -euo pipefail
case ${1:-} in -h | --help | "") sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
# shellcheck source=lib/bench.sh
source "$HERE/lib/bench.sh"

bench_setup router-allocations "$1"

SIM_PID="" ROUTER_PID="" PROBES=()
cleanup() {
  stop "$ROUTER_PID"
  stop "$SIM_PID"
  for p in "${PROBES[@]}"; do perf probe -q -d "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# One probe per entry point, named after this run so that concurrent runs do not collide.
declare -A KIND=([mi_malloc_aligned]=alloc [mi_zalloc_aligned]=alloc [mi_realloc_aligned]=realloc [mi_free]=free)
for fn in "${!KIND[@]}"; do
  name=kinf_${fn}_$$
  perf probe -q -x "$BIN" -a "$name=$fn"
  event=$(perf probe -l 2>/dev/null | awk -v n=":$name" '{ i = index($1, n) } i && i + length(n) == length($1) + 1 {print $1; exit}')
  [ -n "$event" ] || { echo "router-allocations.sh: no uprobe $name on $fn in $BIN" >&2; exit 1; }
  PROBES+=("$event")
  KIND[$event]=${KIND[$fn]}
done

start_bench_fleet "$BIN" "$TOKENIZER" "$OUT"

bench_count al stat -x, -o "$OUT/perf.csv" --per-thread -e "$(IFS=,; echo "${PROBES[*]}")"
echo "binary: $BIN"
echo "requests: $REQUESTS (wrk, 32 connections, $DURATION, under uprobes)"
for event in "${PROBES[@]}"; do echo "$event ${KIND[$event]}"; done >"$OUT/kinds.txt"
# perf's per-thread rows: THREAD-TID,COUNT,,EVENT,...
awk -F, -v n="$REQUESTS" '
  NR == FNR { kind[$1] = $2; next }
  $2 + 0 > 0 && ($4 in kind) {
    thread = ($1 ~ /^kinf-data-/) ? "data-plane threads" : "other threads"
    count[thread SUBSEP kind[$4]] += $2
  }
  END {
    for (t = 1; t <= 2; t++) {
      thread = (t == 1) ? "data-plane threads" : "other threads"
      printf "%-20s allocations %6.1f  reallocations %5.1f  frees %6.1f  per request\n", thread,
        count[thread, "alloc"] / n, count[thread, "realloc"] / n, count[thread, "free"] / n
    }
  }' FS=' ' "$OUT/kinds.txt" FS=, "$OUT/perf.csv" | tee "$OUT/allocations.txt"

[ -n "${STACKS:-}" ] || exit 0
# Frees carry no site worth naming: the stacks are those of allocations and reallocations.
# perf drops many of them (a uprobe fires faster than dwarf stacks are copied out), at random
# with respect to the site, so each site's share of the recorded stacks is scaled to the
# data-plane threads' allocations and reallocations per request counted above.
SITES=()
for event in "${PROBES[@]}"; do [ "${KIND[$event]}" = free ] || SITES+=("$event"); done
bench_count als record -q -m 8192 -o "$OUT/perf.data" --call-graph dwarf,16384 -e "$(IFS=,; echo "${SITES[*]}")"
per_request() { awk -v t="$1" '$0 ~ "^" t " threads" {print $4 + $6}' "$OUT/allocations.txt"; }
perf script -i "$OUT/perf.data" -F comm,ip,sym 2>/dev/null >"$OUT/stacks.txt"
python3 "$HERE/lib/alloc_sites.py" "$OUT/stacks.txt" "$(per_request data-plane)" "$(per_request other)" \
  "${STACKS_DEPTH:-2}" | tee "$OUT/sites.txt"
