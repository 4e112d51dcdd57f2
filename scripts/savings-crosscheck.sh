#!/usr/bin/env bash
# savings-crosscheck.sh - the router's live savings against `kinference bench` on one workload.
#
#   1. two simulated replicas (prefix caching on) behind `kinference serve` (precise);
#      `kinference bench --mode live` replays a shared-prefix workload through the router:
#      bench reports the prefill GPU-seconds of those requests with their cached tokens (P_hit),
#      the router counts what the hits saved (kinference_saved_prefill_gpu_seconds_total, S);
#   2. the same workload straight to one simulated replica with prefix caching off: bench's
#      prefill GPU-seconds with nothing cached (P_cold), the same prompts' full price.
#   3. the same workload through a router with --policy round-robin in front of two fresh
#      replicas: the real round-robin hit rate (cached / prompt tokens, from bench), against
#      the estimate the precise router of step 1 made of it (its round-robin baseline,
#      kinference_baseline_cached_tokens_total / kinference_usage_prompt_tokens_total).
# Both use the llama-3.1-8b-h100x1 timing profile. The checks: S = P_cold - P_hit (within
# rounding), the router's saved tokens = the cached tokens bench read from usage, and the
# round-robin estimate within 10 % (relative) of the real round-robin hit rate.
#
# usage: scripts/savings-crosscheck.sh [BINARY]
# env: CROSSCHECK_REQUESTS (200), CROSSCHECK_GPU_BLOCKS (4096: KV blocks per replica; 300 holds
#      about four of the eight prefixes, so the replicas evict; from 8192 the baseline's cache
#      model is a sample of the blocks)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
MODEL=tiny
BLOCK=16
REQUESTS=${CROSSCHECK_REQUESTS:-200}
GPU_BLOCKS=${CROSSCHECK_GPU_BLOCKS:-4096}
log() { echo "[savings-crosscheck] $*"; }

WORK=$(mktemp -d)
PIDS=()
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
cleanup() {
  local p
  for p in "${PIDS[@]}"; do stop "$p"; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
die() { log "error: $*"; for f in "$WORK"/*.err; do [ -s "$f" ] && tail -5 "$f" >&2; done; exit 1; }

BIN=$(kinference_binary "$REPO" debug "${1:-}") || die "no kinference binary"

# sim NAME N [FLAGS...]: starts N replicas; their lines in $WORK/NAME.out.
sim() {
  local name=$1 n=$2
  shift 2
  NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas "$n" --model "$MODEL" \
    --tokenizer "$TOKENIZER" --block-size "$BLOCK" --num-gpu-blocks "$GPU_BLOCKS" --max-model-len 4096 \
    --speedup 20 "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PIDS+=($!)
  wait_sim_replicas "$WORK/$name.out" "$!" "$n" 30 || die "the simulator $name did not start"
}

# bench NAME URL: bench's live run of the workload against URL; prints the policy's results.
bench() {
  "$BIN" bench --mode live --workload shared-prefix --requests "$REQUESTS" --groups 8 \
    --prefix-tokens 1024 --output-tokens 8 --seed 3 --arrivals concurrency --concurrency 8 \
    --tokenizer "$TOKENIZER" --model "$MODEL" --target "$1=$2" --no-plots --no-bounds \
    --out "$WORK/bench-$1" >"$WORK/bench-$1.log" 2>&1 || die "bench $1 failed: $(tail -5 "$WORK/bench-$1.log")"
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]["policies"][sys.argv[2]]
print(json.dumps({k: r[k] for k in ("completed", "failed", "prompt_tokens", "cached_tokens", "prefill_gpu_s")}))' \
    "$WORK/bench-$1/results.json" "$1"
}

sim warm 2 --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0'
FLAGS=()
for i in 0 1; do
  line=$(grep "^replica=$i " "$WORK/warm.out")
  FLAGS+=(--replica "$(field "$line" url),events=$(dial "$(field "$line" events)"),replay=$(dial "$(field "$line" replay)")")
done
NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model "$MODEL" \
  --tokenizer "$TOKENIZER" --block-size "$BLOCK" --policy precise --scrape-interval-ms 200 \
  "${FLAGS[@]}" >"$WORK/router.out" 2>"$WORK/router.err" &
PIDS+=($!)
read -r DATA ADMIN < <(router_addrs "$WORK/router.err" "$!" 30) || die "the router did not start"
wait_router_ready "http://$ADMIN" "${PIDS[-1]}" 2 30 || die "the router never became ready"

HIT=$(bench precise "http://$DATA")
log "bench through the router: $HIT"
# In a variable first: a page that cannot be read stops the script here (set -e).
COUNTS=$(PYTHONPATH="$HERE/lib" python3 -c 'import sys, prom
page = prom.page(sys.argv[1])
rr = prom.total(page, "kinference_baseline_cached_tokens_total", policy="round-robin")
print(int(prom.total(page, "kinference_saved_prefill_tokens_total")),
      repr(prom.total(page, "kinference_saved_prefill_gpu_seconds_total")),
      repr(rr / prom.total(page, "kinference_usage_prompt_tokens_total")))' "http://$ADMIN/metrics")
read -r TOKENS GPU_S RR_EST <<<"$COUNTS"
log "router /metrics: kinference_saved_prefill_tokens_total $TOKENS, kinference_saved_prefill_gpu_seconds_total $GPU_S, round-robin hit rate estimated $RR_EST"

# 3. Real round-robin on two fresh replicas.
sim rr 2
FLAGS=()
for i in 0 1; do
  FLAGS+=(--replica "$(field "$(grep "^replica=$i " "$WORK/rr.out")" url)")
done
NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model "$MODEL" \
  --tokenizer "$TOKENIZER" --block-size "$BLOCK" --policy round-robin --scrape-interval-ms 200 \
  "${FLAGS[@]}" >"$WORK/rr-router.out" 2>"$WORK/rr-router.err" &
PIDS+=($!)
read -r RR_DATA RR_ADMIN < <(router_addrs "$WORK/rr-router.err" "$!" 30) || die "the round-robin router did not start"
wait_router_ready "http://$RR_ADMIN" "${PIDS[-1]}" 2 30 || die "the round-robin router never became ready"
RR=$(bench round-robin "http://$RR_DATA")
log "bench through a round-robin router: $RR"

sim cold 1 --no-enable-prefix-caching
COLD_URL=$(field "$(grep '^replica=0 ' "$WORK/cold.out")" url)
COLD=$(bench cold "$COLD_URL")
log "bench straight to a replica without prefix caching: $COLD"

python3 - "$HIT" "$COLD" "$TOKENS" "$GPU_S" "$RR" "$RR_EST" <<'PYEOF'
import json, sys
hit, cold, tokens, saved = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
rr, rr_est = json.loads(sys.argv[5]), float(sys.argv[6])
assert rr["prompt_tokens"] == hit["prompt_tokens"], "the round-robin run sent different prompts"
assert rr["failed"] == 0 and hit["failed"] == 0, (hit, rr)
rr_real = rr["cached_tokens"] / rr["prompt_tokens"]
err = (rr_est - rr_real) / rr_real
print(f"[savings-crosscheck] round-robin hit rate: real {rr_real:.4f} ({rr['cached_tokens']} of "
      f"{rr['prompt_tokens']} prompt tokens), estimated by the precise router {rr_est:.4f}: "
      f"error {100 * err:+.1f} % (precise measured {hit['cached_tokens'] / hit['prompt_tokens']:.4f})")
assert abs(err) <= 0.10, "the round-robin estimate is more than 10 % off the real round-robin run"
assert hit["prompt_tokens"] == cold["prompt_tokens"], "the two runs sent different prompts"
assert cold["cached_tokens"] == 0, cold
bench_saved = cold["prefill_gpu_s"] - hit["prefill_gpu_s"]
print(f"[savings-crosscheck] bench: P_cold {cold['prefill_gpu_s']:.6f} - P_hit {hit['prefill_gpu_s']:.6f} "
      f"= {bench_saved:.6f} GPU-s saved; router: {saved:.6f} GPU-s; difference {saved - bench_saved:+.2e}")
print(f"[savings-crosscheck] cached tokens: bench {hit['cached_tokens']}, router {tokens}")
assert tokens == hit["cached_tokens"], "saved tokens differ"
assert abs(saved - bench_saved) <= 1e-6 * max(1.0, bench_saved), "saved GPU-seconds differ"
print("[savings-crosscheck] ok")
PYEOF
