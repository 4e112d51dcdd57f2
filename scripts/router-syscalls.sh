#!/usr/bin/env bash
# router-syscalls.sh - the system calls `kinference serve` makes per request under load,
# counted by the kernel's syscall tracepoints (`perf stat`), in the setup of
# scripts/router-latency.sh: 4 simulated replicas with KV events on (one `kinference sim`
# process, --speedup 100000), the router with --policy precise in front, wrk at 32 connections
# with the developers' workload (8 shared ~4,000-character prefixes and a unique tail;
# WORKLOAD=chat: router-latency.sh's real conversations). A
# warm-up of WARMUP, then DURATION counted. Prints each counted call per request and the total,
# then page faults, context switches and CPU migrations per request.
#
# Needs perf with access to the syscalls tracepoints (root, or kernel.perf_event_paranoid
# low enough), wrk and curl.
#
# usage: scripts/router-syscalls.sh BINARY
# env: TOKENIZER=../shared/data/tokenizers/llama3.1 WARMUP=3s DURATION=4s WORKLOAD=dev (or chat)
#      RESULTS=target/router-syscalls
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

bench_setup router-syscalls "$1"

SIM_PID="" ROUTER_PID=""
cleanup() { stop "$ROUTER_PID"; stop "$SIM_PID"; }
trap cleanup EXIT

start_bench_fleet "$BIN" "$TOKENIZER" "$OUT"

CALLS=(epoll_wait recvfrom writev poll sendto futex sched_yield)
EVENTS=$(printf 'syscalls:sys_enter_%s,' "${CALLS[@]}")raw_syscalls:sys_enter
# The kernel's work for the router beyond its calls: faults (the allocator returning and
# taking back pages) and scheduling.
EVENTS+=,page-faults,context-switches,cpu-migrations
bench_count sys stat -x, -o "$OUT/perf.csv" -e "$EVENTS"
echo "binary: $BIN"
echo "requests: $REQUESTS (wrk, 32 connections, $DURATION)"
awk -F, -v n="$REQUESTS" '$3 ~ /sys_enter/ {
  name = $3; sub(/.*sys_enter_?/, "", name); if (name == "") name = "all system calls";
  printf "%-18s %8.2f per request\n", name, $1 / n }
  $3 ~ /^(page-faults|context-switches|cpu-migrations)$/ { printf "%-18s %8.2f per request\n", $3, $1 / n }' "$OUT/perf.csv"
echo "raw outputs: $OUT"
