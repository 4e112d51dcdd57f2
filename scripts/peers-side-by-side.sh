#!/usr/bin/env bash
# peers-side-by-side.sh - one live workload through kinference and the peer routers, same fleet.
#
# Starts four simulated replicas (`kinference sim --replicas 4`, free ports, KV events and
# replay on) and, in front of them:
#   kinference     `kinference serve --policy precise` (subscribed to every replica's events)
#   round-robin    `kinference serve --policy round-robin` (the cache-blind baseline)
#   vllm-router    the vLLM project's router, --policy cache_aware     (when installed)
#   sglang-router  SGLang's model gateway (`smg launch`), cache_aware  (when installed)
# then runs `kinference bench --mode live` once: the same synthetic multi-turn workload, open
# loop, against each target in turn, with every replica's prefix cache reset before each target
# and hit rates read from the replicas' own counters. Prints report.md; the folder keeps
# results.json and the plots. Every process started here is stopped on every path.
#
# A peer that is not installed, or does not answer within 30 s, is skipped with a message.
# vllm-router's cache_aware policy calls POST /v1/completions/render (or
# /v1/chat/completions/render) on a worker before every request; the simulated replicas do not
# have it (404), and vllm-router then calls POST /tokenize (which they have) and routes on those
# tokens: two extra round trips per request, included in its TTFT.
#
# usage: scripts/peers-side-by-side.sh [BINARY [OUT]]
#   BINARY  a built `kinference` (default target/release/kinference; nothing is built here)
#   OUT     the report folder (default target/peers-side-by-side)
# env: KINFERENCE_PEERS_DIR   where the peers' venvs are (default ~/.cache/kinference/peers:
#                             vllm-router/bin/vllm-router, sglang-router/bin/smg)
#      PEERS_CONVERSATIONS    multi-turn conversations of 6 turns each (default 80)
#      PEERS_SPEEDUP          the workload's own arrival times (conversations start at 2/s, 10 s
#                             between turns) divided by this (default 4: ~23 s per target)
#      PEERS_SIM_SPEEDUP      the replicas' simulated seconds per wall second (default 5)
#      PEERS_GPU_BLOCKS       KV blocks of 16 tokens per replica (default 2048: the fleet holds
#                             about 40 % of the conversations' tokens at once, so placement matters)
#      PEERS_KINFERENCE_POLICY  the first target's policy, a name or YAML (default precise)
#      PEERS_WARM_MODES       hot-prefix warming modes to add as targets, space-separated
#                             (`next`, `chosen`): one more kinference per mode, named
#                             kinference-warm-MODE, with `--warm MODE`; after the bench each
#                             kinference target's decisions and warms' cost (kinference_warm_*
#                             from its /metrics) are printed, the latter to add to the report's
#                             prefill GPU-s (which counts client requests only)
#      PEERS_WORKLOAD         multi-turn (default) or hot-prefix: groups of requests sharing a
#                             long prefix, Zipf-popular (the hottest group alone is more than one
#                             replica's share), Poisson arrivals; sized by PEERS_HOT_REQUESTS
#                             (1200), PEERS_HOT_GROUPS (16), PEERS_HOT_PREFIX_TOKENS (2048),
#                             PEERS_HOT_RATE (40 requests/s); or mooncake: the first
#                             PEERS_MOONCAKE_REQUESTS (1200) requests of the Mooncake
#                             conversation trace at its own times / PEERS_MOONCAKE_SPEEDUP
#                             (default 1.341 x PEERS_SIM_SPEEDUP: the speed-up at which
#                             `kinference bench --mode sim --replicas 4 --load 0.8` puts the
#                             whole trace at 80 % of the fleet's capacity), on replicas of
#                             1,024,000 KV tokens (PEERS_GPU_BLOCKS defaults to 64000 here) and
#                             PEERS_SIM_SPEEDUP 2 unless set (the first 1,200 prompts average
#                             14,000 tokens, which the router, the replicas and the client all
#                             tokenize)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
PEERS_DIR=${KINFERENCE_PEERS_DIR:-$HOME/.cache/kinference/peers}
CONVERSATIONS=${PEERS_CONVERSATIONS:-80}
SPEEDUP=${PEERS_SPEEDUP:-4}
KINFERENCE_POLICY=${PEERS_KINFERENCE_POLICY:-precise}
WARM_MODES=${PEERS_WARM_MODES:-}
WORKLOAD=${PEERS_WORKLOAD:-multi-turn}
HOT_REQUESTS=${PEERS_HOT_REQUESTS:-1200}
HOT_GROUPS=${PEERS_HOT_GROUPS:-16}
HOT_PREFIX_TOKENS=${PEERS_HOT_PREFIX_TOKENS:-2048}
HOT_RATE=${PEERS_HOT_RATE:-40}
MOONCAKE_REQUESTS=${PEERS_MOONCAKE_REQUESTS:-1200}
if [ "$WORKLOAD" = mooncake ]; then
  GPU_BLOCKS=${PEERS_GPU_BLOCKS:-64000}
  SIM_SPEEDUP=${PEERS_SIM_SPEEDUP:-2}
else
  GPU_BLOCKS=${PEERS_GPU_BLOCKS:-2048}
  SIM_SPEEDUP=${PEERS_SIM_SPEEDUP:-5}
fi
MOONCAKE_SPEEDUP=${PEERS_MOONCAKE_SPEEDUP:-$(python3 -c 'import sys; print(round(1.341 * float(sys.argv[1]), 3))' "$SIM_SPEEDUP")}
REPLICAS=4
MODEL=sim
BLOCK=16
T0=$(date +%s)
log() { echo "[peers +$(( $(date +%s) - T0 ))s] $*"; }

PIDS=()
DIED=""
show_logs() {
  local f
  for f in "$LOGS"/*.err; do
    [ -s "$f" ] && { echo "--- last lines of $(basename "$f")" >&2; tail -n 15 "$f" >&2; }
  done
  return 0
}
die() { DIED=1; log "error: $*"; show_logs; exit 1; }
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
cleanup() {
  local rc=$? i
  [ "$rc" -ne 0 ] && [ -z "${DIED:-}" ] && show_logs
  # Routers first (newest first), the replicas last.
  for (( i=${#PIDS[@]}-1; i>=0; i-- )); do stop "${PIDS[$i]}"; done
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the binary and the report folder
BIN=${1:-$REPO/target/release/kinference}
[ -x "$BIN" ] || die "$BIN is not an executable (build it: cargo build --release -p kinference)"
OUT=${2:-$REPO/target/peers-side-by-side}
# Every process's stdout and stderr stay in the report folder, for reading after the run.
LOGS=$OUT/logs
mkdir -p "$OUT"
rm -rf "$LOGS"
mkdir -p "$LOGS"
command -v python3 >/dev/null || die "no python3 on PATH (used to pick free ports and wait for readiness)"

# --- four replicas, HTTP, events and replay on ports they pick (port 0)
NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas "$REPLICAS" --served-model-name "$MODEL" \
  --tokenizer "$TOKENIZER" --block-size "$BLOCK" --num-gpu-blocks "$GPU_BLOCKS" --speedup "$SIM_SPEEDUP" \
  --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0' >"$LOGS/sim.out" 2>"$LOGS/sim.err" &
PIDS+=($!)
SIM_PID=$!
LAST=$((REPLICAS - 1))
wait_sim_replicas "$LOGS/sim.out" "$SIM_PID" "$REPLICAS" 30 || die "the simulator did not start"

REPLICA_FLAGS=()
URLS=()
METRICS_FLAGS=()
for i in $(seq 0 "$LAST"); do
  line=$(grep "^replica=$i " "$LOGS/sim.out")
  url=$(field "$line" url) ev=$(field "$line" events) rp=$(field "$line" replay)
  case "$ev$rp" in *-*|*,*|"") die "replica $i: expected one events and one replay endpoint: $line";; esac
  log "replica $i: $line"
  URLS+=("$url")
  REPLICA_FLAGS+=(--replica "$url,events=$(dial "$ev"),replay=$(dial "$rp")")
  METRICS_FLAGS+=(--replica-metrics "$url/metrics")
done

# --- kinference, twice: precise (the product's default) and round-robin (the baseline)
TARGETS=()
KIN_ADMINS=()
start_kinference() {
  local name=$1 policy=$2 data admin pid
  shift 2
  NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
    --model "$MODEL" --tokenizer "$TOKENIZER" --block-size "$BLOCK" --policy "$policy" \
    --scrape-interval-ms 200 "$@" "${REPLICA_FLAGS[@]}" >"$LOGS/$name.out" 2>"$LOGS/$name.err" &
  pid=$!
  PIDS+=("$pid")
  read -r data admin < <(router_addrs "$LOGS/$name.err" "$pid" 30) || die "$name did not start"
  wait_router_ready "http://$admin" "$pid" "$REPLICAS" 30 || die "$name never became ready"
  TARGETS+=(--target "$name=http://$data")
  [ -z "$WARM_MODES" ] || [ "$policy" = round-robin ] || KIN_ADMINS+=("$name=$admin")
  log "$name: kinference serve --policy $policy $* on $data (admin $admin)"
}
start_kinference kinference "$KINFERENCE_POLICY"
for mode in $WARM_MODES; do
  start_kinference "kinference-warm-$mode" "$KINFERENCE_POLICY" --warm "$mode"
done
start_kinference round-robin round-robin

# --- the peers, cache-aware, with the flags of the shared peer notes; skipped when absent
SKIPPED=()
start_peer() {
  local name=$1 exe=$2 loglevel=$3 port mport pid why
  shift 3
  if [ ! -x "$exe" ]; then
    log "skipping $name: $exe is not installed"
    SKIPPED+=("$name (not installed)")
    return 0
  fi
  read -r port mport < <(free_ports 2)
  "$exe" "$@" --host 127.0.0.1 --port "$port" --worker-urls "${URLS[@]}" \
    --policy cache_aware --cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5 \
    --eviction-interval-secs 120 --max-tree-size 33554432 \
    --prometheus-host 127.0.0.1 --prometheus-port "$mport" --log-level "$loglevel" \
    >"$LOGS/$name.out" 2>"$LOGS/$name.err" &
  pid=$!
  PIDS+=("$pid")
  if why=$(wait_http "http://127.0.0.1:$port/v1/models" "$pid" 30 2>&1); then
    TARGETS+=(--target "$name=http://127.0.0.1:$port")
    log "$name: $exe (cache_aware) on 127.0.0.1:$port"
  else
    log "skipping $name: it did not start (${why:-no reason}); last lines of its log:"
    cat "$LOGS/$name.err" "$LOGS/$name.out" 2>/dev/null | tail -n 8 | sed 's/^/    /' || true
    SKIPPED+=("$name (did not start)")
    stop "$pid"
  fi
  return 0
}
start_peer vllm-router "$PEERS_DIR/vllm-router/bin/vllm-router" warning
# smg finds no tokenizer offline (it warns and carries on); the local one keeps it quiet.
start_peer sglang-router "$PEERS_DIR/sglang-router/bin/smg" warn launch --tokenizer-path "$TOKENIZER"

# --- one workload, every target in turn, caches reset between them
case $WORKLOAD in
  multi-turn)
    log "bench: $(( ${#TARGETS[@]} / 2 )) targets, multi-turn ($CONVERSATIONS conversations x 6 turns, its own times / $SPEEDUP)"
    WORKLOAD_FLAGS=(--workload multi-turn --requests "$CONVERSATIONS" --arrivals trace --speedup "$SPEEDUP")
    ;;
  hot-prefix)
    log "bench: $(( ${#TARGETS[@]} / 2 )) targets, hot prefixes ($HOT_REQUESTS requests, $HOT_GROUPS groups of $HOT_PREFIX_TOKENS tokens, Zipf 1.1, Poisson $HOT_RATE/s)"
    WORKLOAD_FLAGS=(--workload shared-prefix --requests "$HOT_REQUESTS" --groups "$HOT_GROUPS" --zipf 1.1
      --prefix-tokens "$HOT_PREFIX_TOKENS" --arrivals poisson --rate "$HOT_RATE")
    ;;
  mooncake)
    log "bench: $(( ${#TARGETS[@]} / 2 )) targets, the Mooncake conversation trace (first $MOONCAKE_REQUESTS requests, its own times / $MOONCAKE_SPEEDUP)"
    WORKLOAD_FLAGS=(--workload mooncake --max-requests "$MOONCAKE_REQUESTS" --arrivals trace --speedup "$MOONCAKE_SPEEDUP")
    ;;
  *) die "PEERS_WORKLOAD must be multi-turn, hot-prefix or mooncake, not $WORKLOAD" ;;
esac
# In the background, so that an interrupt stops everything at once rather than after the bench.
NO_COLOR=1 nice "$BIN" bench --mode live "${TARGETS[@]}" "${METRICS_FLAGS[@]}" --reset-caches \
  --model "$MODEL" --tokenizer "$TOKENIZER" "${WORKLOAD_FLAGS[@]}" \
  --seed 1 --request-timeout 60 --out "$OUT" >"$LOGS/bench.out" 2>"$LOGS/bench.err" &
BENCH_PID=$!
PIDS+=("$BENCH_PID")
wait "$BENCH_PID" || { tail -n 30 "$LOGS/bench.out" >&2; die "the bench failed"; }

[ -s "$OUT/report.md" ] || die "the bench wrote no $OUT/report.md"
cat "$OUT/report.md"
echo
# With warming: each router's decisions, and the warms' own cost, priced like the bench's prefill.
for wa in "${KIN_ADMINS[@]}"; do
  name=${wa%%=*}
  curl -fsS "http://${wa#*=}/metrics" >"$OUT/$name.metrics" || die "$name: /metrics did not answer"
  PYTHONPATH="$HERE/lib" python3 - "$name" "$OUT/$name.metrics" <<'PY'
import sys, prom
name, page = sys.argv[1], prom.page(sys.argv[2])
def total(metric):
    return prom.total(page, metric + "_total")
skipped = prom.by_label(page, "kinference_warms_skipped_total", "reason")
decisions = prom.by_label(page, "kinference_decisions_total", "reason")
print(f"{name}: warms sent {total('kinference_warms_sent'):.0f}, failed "
      f"{total('kinference_warms_failed'):.0f}, skipped {skipped or 0}; warm prompt tokens "
      f"{total('kinference_warm_prompt_tokens'):.0f} (cached {total('kinference_warm_cached_tokens'):.0f}), "
      f"warm prefill GPU-s {total('kinference_warm_prefill_gpu_seconds'):.2f}; decisions: "
      + ", ".join(f"{r} {v:.0f}" for r, v in sorted(decisions.items())))
PY
done
[ "${#SKIPPED[@]}" -eq 0 ] || log "skipped: ${SKIPPED[*]}"
log "report folder: $OUT (results.json, report.md, plots)"
