#!/usr/bin/env bash
# router-ab.sh - two kinference builds' router CPU per request at 32 connections, alternated:
# scripts/router-latency.sh with TARGETS=kinference and one round, run for both builds PAIRS
# times, A first in odd pairs and B first in even ones (A B, B A, A B, ...), so that the
# machine's drift over the minutes falls on both builds alike, and so does the order within a
# pair (on a 2-vCPU virtual machine the second run of a pair was the slower one in 14 pairs of
# 21, by 2.9 us on average, whichever build it was: BENCHMARKS.md, "a new machine"). Use an
# even PAIRS.
# A change of a few percent in the router's CPU per request is inside the spread of separate
# runs on a small shared machine; alternated, it shows as a difference between the builds'
# means. Prints each run's CPU per request and requests/s (the 32-connection cell, from its
# cells.jsonl), then each build's mean and B - A.
#
# Usage: scripts/router-ab.sh A_BINARY B_BINARY
#   env: PAIRS=4          runs per build
#        WORKLOAD=dev     router-latency.sh's workload (dev or chat)
#        TOKENIZER=llama3.1, DURATION=6s, WARMUP=2s, SIM_BIN, KINF_FLAGS: as router-latency.sh
#                         (both builds get the same replicas' binary: SIM_BIN, else A)
#        RESULTS=target/router-ab   (a timestamped directory is made in it)
set -euo pipefail

case ${1:-} in
  -h | --help | "")
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
esac

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
A=$(realpath "$1")
B=$(realpath "${2:?usage: router-ab.sh A_BINARY B_BINARY}")
PAIRS=${PAIRS:-4}
OUT="${RESULTS:-target/router-ab}/$(date -u +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export SIM_BIN=${SIM_BIN:-$A}

echo "[router-ab] results in $OUT"
for i in $(seq 1 "$PAIRS"); do
  order="A B"
  [ $((i % 2)) = 0 ] && order="B A"
  for side in $order; do
    bin=$A
    [ "$side" = B ] && bin=$B
    run="$OUT/$side.$i"
    TARGETS=kinference ROUNDS=1 DURATION=${DURATION:-6s} WARMUP=${WARMUP:-2s} RESULTS="$run" \
      "$HERE/router-latency.sh" "$bin" >"$run.log" 2>&1 ||
      { echo "[router-ab] $side run $i failed: $run.log" >&2; exit 1; }
  done
done

PYTHONPATH="$HERE/lib${PYTHONPATH:+:$PYTHONPATH}" python3 - "$OUT" "$PAIRS" <<'EOF'
import glob, json, statistics, sys
from cells import cpu_ms, rps

out, pairs = sys.argv[1], int(sys.argv[2])
def cell(side, i):
    for path in glob.glob(f"{out}/{side}.{i}/*/cells.jsonl"):
        for line in open(path):
            r = json.loads(line)
            if r["target"] == "kinference" and r["cell"] == "c32":
                return 1000.0 * cpu_ms(r), rps(r)
    sys.exit(f"no 32-connection cell for {side} run {i} under {out}")

runs = {s: [cell(s, i) for i in range(1, pairs + 1)] for s in "AB"}
for i in range(pairs):
    for s in "AB":
        cpu, rps = runs[s][i]
        first = "A" if i % 2 == 0 else "B"
        print(f"run {i + 1} {s}: router CPU per request {cpu:.2f} us, {rps:,.0f} requests/s" + (" (first)" if s == first else ""))
mean = {s: statistics.mean(c for c, _ in runs[s]) for s in "AB"}
for s in "AB":
    print(f"{s}: mean {mean[s]:.2f} us per request over {pairs} runs")
d = mean["B"] - mean["A"]
print(f"B - A: {d:+.2f} us per request ({100 * d / mean['A']:+.1f} %)")
EOF
