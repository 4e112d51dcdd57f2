#!/usr/bin/env bash
# epp-side-by-side.sh - endpoint pickers side by side: one gateway, one fleet, one workload.
#
# Starts four simulated replicas (`kinference sim --replicas 4`, KV events and replay on) and,
# one at a time, an endpoint picker with the Envoy-like test gateway (`kinference-testgw`,
# full-duplex request and response bodies, as GIE gateways run ext_proc) in front of it:
#   kinference   `kinference epp --policy precise` (the replicas' KV events, their /metrics)
#   llm-d        llm-d's endpoint picker, default profile (scripts/lib/epp-peers.sh: version,
#                scorers, and why not precise prefix scoring: docs/epp-peers.md)
#   gie-lwepp    the Gateway API Inference Extension's reference lightweight picker (round robin)
# and runs `kinference bench --mode live` against the gateway, the replicas' prefix caches reset
# first and hit rates read from the replicas' own counters. Per picker it records the bench's
# report (TTFT, hit rate), the gateway's measure of the picker's latency (from the last request
# message to the answer naming the endpoint) and the picker process's CPU time over its run,
# per request. Prints table.md; every process started here is stopped on every path.
#
# A peer that cannot be built or started is skipped with a message (the table says so).
#
# usage: scripts/epp-side-by-side.sh [OUT]
#   OUT  the report folder (default target/epp-side-by-side)
# env: EPP_WORKLOAD        multi-turn (default) or mooncake: as PEERS_WORKLOAD in
#                          scripts/peers-side-by-side.sh (mooncake: the first
#                          EPP_MOONCAKE_REQUESTS (1200) requests of the Mooncake conversation trace
#                          at 80 % of the fleet's capacity)
#      EPP_CONVERSATIONS   multi-turn conversations of 6 turns (default 80)
#      EPP_SPEEDUP         multi-turn: the workload's own times divided by this (default 4)
#      EPP_PICKERS         which pickers, in order (default "kinference llm-d gie-lwepp")
#      CARGO_TARGET_DIR    where the release binaries are (built here when missing)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
WORKLOAD=${EPP_WORKLOAD:-multi-turn}
CONVERSATIONS=${EPP_CONVERSATIONS:-80}
SPEEDUP=${EPP_SPEEDUP:-4}
MOONCAKE_REQUESTS=${EPP_MOONCAKE_REQUESTS:-1200}
PICKERS=${EPP_PICKERS:-kinference llm-d gie-lwepp}
if [ "$WORKLOAD" = mooncake ]; then
  GPU_BLOCKS=64000 SIM_SPEEDUP=2
else
  GPU_BLOCKS=2048 SIM_SPEEDUP=5
fi
MOONCAKE_SPEEDUP=$(python3 -c 'import sys; print(round(1.341 * float(sys.argv[1]), 3))' "$SIM_SPEEDUP")
REPLICAS=4
MODEL=sim
BLOCK=16
T0=$(date +%s)
log() { echo "[epp +$(( $(date +%s) - T0 ))s] $*"; }

PIDS=()
DIED=""
die() { DIED=1; log "error: $*"; exit 1; }
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
# shellcheck source=lib/epp-peers.sh
source "$HERE/lib/epp-peers.sh"
cleanup() {
  local i
  epp_peer_stop >/dev/null 2>&1 || true
  for (( i=${#PIDS[@]}-1; i>=0; i-- )); do stop "${PIDS[$i]}"; done
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

OUT=${1:-$REPO/target/epp-side-by-side}
LOGS=$OUT/logs
rm -rf "$OUT"
mkdir -p "$LOGS"

# --- binaries: kinference and the test gateway, release builds
BIN=$(kinference_binary "$REPO" release) || die "no kinference binary"
GW_BIN=$(dirname "$BIN")/kinference-testgw
if [ ! -x "$GW_BIN" ]; then
  log "building kinference-testgw (release)"
  (cd "$REPO" && cargo build --release --locked -p kinference-testgw) >"$LOGS/build.log" 2>&1 ||
    die "building kinference-testgw failed (see $LOGS/build.log)"
fi

# --- four replicas, HTTP, events and replay on ports they pick (port 0)
NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas "$REPLICAS" --served-model-name "$MODEL" \
  --tokenizer "$TOKENIZER" --block-size "$BLOCK" --num-gpu-blocks "$GPU_BLOCKS" --speedup "$SIM_SPEEDUP" \
  --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0' >"$LOGS/sim.out" 2>"$LOGS/sim.err" &
PIDS+=($!)
SIM_PID=$!
wait_sim_replicas "$LOGS/sim.out" "$SIM_PID" "$REPLICAS" 30 || die "the simulator did not start"
REPLICA_FLAGS=()
METRICS_FLAGS=()
ENDPOINTS=()
for i in $(seq 0 $((REPLICAS - 1))); do
  line=$(grep "^replica=$i " "$LOGS/sim.out")
  url=$(field "$line" url) ev=$(field "$line" events) rp=$(field "$line" replay)
  REPLICA_FLAGS+=(--replica "$url,events=$(dial "$ev"),replay=$(dial "$rp")")
  METRICS_FLAGS+=(--replica-metrics "$url/metrics")
  ENDPOINTS+=("${url#http://}")
done
EPS=$(IFS=,; echo "${ENDPOINTS[*]}")
log "replicas: $EPS"

case $WORKLOAD in
  multi-turn) WORKLOAD_FLAGS=(--workload multi-turn --requests "$CONVERSATIONS" --arrivals trace --speedup "$SPEEDUP") ;;
  mooncake) WORKLOAD_FLAGS=(--workload mooncake --max-requests "$MOONCAKE_REQUESTS" --arrivals trace --speedup "$MOONCAKE_SPEEDUP") ;;
  *) die "EPP_WORKLOAD must be multi-turn or mooncake, not $WORKLOAD" ;;
esac

# cpu_ms PID: user + system CPU time of PID so far, in ms.
cpu_ms() {
  python3 - "$1" <<'PYEOF'
import os, sys
f = open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")", 1)[1].split()
print(round((int(f[11]) + int(f[12])) * 1000 / os.sysconf("SC_CLK_TCK")))
PYEOF
}

SKIPPED=()
# run_picker NAME PID GRPC [GATEWAY FLAGS]: the gateway in front of the picker (full-duplex
# bodies unless flags say otherwise), the bench through it.
run_picker() {
  local name=$1 pid=$2 grpc=$3 gw_pid gw c0 c1 modes=(--body-mode full-duplex --response-body-mode full-duplex)
  [ $# -gt 3 ] && modes=("${@:4}")
  echo "${modes[*]}" >"$LOGS/gw-$name.modes"
  "$GW_BIN" --listen 127.0.0.1:0 --picker "$grpc" --endpoints "$EPS" \
    "${modes[@]}" >"$LOGS/gw-$name.out" 2>"$LOGS/gw-$name.err" &
  gw_pid=$!
  PIDS+=("$gw_pid")
  gw=$(python3 - "$LOGS/gw-$name.out" "$gw_pid" <<'PYEOF'
import os, sys, time
path, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the gateway exited")
    line = open(path).readline()
    if line.startswith("listening on ") and line.endswith("\n"):
        print(line.split()[-1]); sys.exit(0)
    time.sleep(0.05)
sys.exit("the gateway did not start")
PYEOF
  ) || { log "skipping $name: the gateway did not start"; SKIPPED+=("$name (gateway)"); return 0; }
  log "$name: picker pid $pid on $grpc, gateway on $gw; bench"
  c0=$(cpu_ms "$pid")
  NO_COLOR=1 nice "$BIN" bench --mode live --target "$name=http://$gw" "${METRICS_FLAGS[@]}" --reset-caches \
    --model "$MODEL" --tokenizer "$TOKENIZER" "${WORKLOAD_FLAGS[@]}" \
    --seed 1 --request-timeout 60 --out "$OUT/$name" >"$LOGS/bench-$name.out" 2>"$LOGS/bench-$name.err" ||
    { tail -n 20 "$LOGS/bench-$name.out" >&2; die "the bench failed for $name"; }
  c1=$(cpu_ms "$pid")
  python3 - "$gw" "$OUT/$name/gateway-stats.json" <<'PYEOF'
import json, sys, urllib.request
stats = json.load(urllib.request.urlopen(f"http://{sys.argv[1]}/gateway/stats", timeout=10))
json.dump(stats, open(sys.argv[2], "w"), indent=1)
PYEOF
  echo "$((c1 - c0))" >"$OUT/$name/picker-cpu-ms"
  stop "$gw_pid"
}

for name in $PICKERS; do
  case $name in
    kinference)
      NO_COLOR=1 "$BIN" epp --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model "$MODEL" \
        --tokenizer "$TOKENIZER" --block-size "$BLOCK" --policy precise --scrape-interval-ms 200 \
        "${REPLICA_FLAGS[@]}" >"$LOGS/kinference.out" 2>"$LOGS/kinference.err" &
      pid=$!
      PIDS+=("$pid")
      read -r grpc admin < <(router_addrs "$LOGS/kinference.err" "$pid" 30) || die "kinference epp did not start"
      wait_router_ready "http://$admin" "$pid" "$REPLICAS" 30 || die "kinference epp never became ready"
      run_picker kinference "$pid" "$grpc"
      curl -fsS "http://$admin/metrics" >"$OUT/kinference/picker-metrics.txt" || true
      stop "$pid"
      ;;
    *)
      if ! epp_peers_install "$name" >"$LOGS/install-$name.log" 2>&1; then
        log "skipping $name: it did not build (see $LOGS/install-$name.log)"
        SKIPPED+=("$name (build)")
        continue
      fi
      read -r port < <(free_ports 1)
      if ! epp_peer_start "$name" "$port" "$EPS" "$LOGS/$name.log" >"$LOGS/start-$name.log" 2>&1; then
        log "skipping $name: it did not start (see $LOGS/start-$name.log, $LOGS/$name.log)"
        SKIPPED+=("$name (start)")
        epp_peer_stop "$name" >/dev/null 2>&1 || true
        continue
      fi
      if [ "$name" = gie-lwepp ]; then
        # GIE's reference picker answers the request headers only once it has the body and
        # answers every body chunk: the mode its conformance gateways run (buffered body,
        # sent without waiting for the headers' answer), not full duplex.
        run_picker "$name" "${EPP_PEER_PIDS[$name]}" "127.0.0.1:$port" \
          --body-mode buffered --body-without-waiting --response-body-mode streamed
      else
        run_picker "$name" "${EPP_PEER_PIDS[$name]}" "127.0.0.1:$port"
      fi
      epp_peer_stop "$name" >/dev/null 2>&1 || true
      ;;
  esac
done

python3 - "$OUT" "$WORKLOAD" "${SKIPPED[*]:-}" <<'PYEOF' | tee "$OUT/table.md"
import json, os, sys
out, workload, skipped = sys.argv[1], sys.argv[2], sys.argv[3]
rows = []
for name in sorted(os.listdir(out)):
    d = os.path.join(out, name)
    if not os.path.exists(os.path.join(d, "results.json")):
        continue
    r = json.load(open(os.path.join(d, "results.json")))
    p = next(iter(r["runs"][0]["policies"].values()))
    g = json.load(open(os.path.join(d, "gateway-stats.json")))
    cpu = int(open(os.path.join(d, "picker-cpu-ms")).read())
    lat = g["picker_latency"]
    ms = lambda s: f"{s * 1000:.0f}" if s is not None else "-"
    modes_file = os.path.join(out, "logs", f"gw-{name}.modes")
    modes = open(modes_file).read().strip() if os.path.exists(modes_file) else ""
    if "buffered" in modes:
        name += " (buffered body)"
    rows.append((name, p["completed"], p["failed"], p["hit_rate"], ms(p["ttft_p50_s"]), ms(p["ttft_p90_s"]),
                 ms(p["ttft_p99_s"]), lat["p50_us"], lat["p90_us"], lat["p99_us"],
                 cpu * 1000 / max(1, g["requests"]), g["fallbacks"]))
print(f"workload: {workload}; gateway: kinference-testgw (full-duplex bodies unless noted)\n")
print("| picker | completed | failed | hit rate | TTFT p50 ms | p90 | p99 | picker latency p50 µs | p90 | p99 | picker CPU µs/request | fallbacks |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]} | {r[5]} | {r[6]} | {r[7]} | {r[8]} | {r[9]} | {r[10]:.0f} | {r[11]} |")
if skipped:
    print(f"\nskipped: {skipped}")
PYEOF
log "report folder: $OUT (per picker: results.json, report.md, gateway-stats.json; logs/)"
