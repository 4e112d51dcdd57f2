#!/usr/bin/env bash
# dashboard-check.sh - the admin port's live dashboard in a real browser.
#
# Starts two simulated replicas (`kinference sim`, KV events and replay on) and `kinference
# serve` in front of them, puts them under load (conversations sharing long prefixes, so the
# replicas report cached tokens), and loads http://ADMIN/dashboard in Debian's Chromium,
# headless, three times (`--dump-dom` after a few seconds of the page's own polling):
#   1. and 2. under load: the savings, requests/s, hit rate and every replica's row are shown
#      as numbers, and the saved tokens and the page's update count change between the two;
#   3. after the load stopped and the router's counters settled: the saved prefill tokens and
#      GPU-seconds the page shows are the ones `/metrics` exposes
#      (kinference_saved_prefill_*_total).
# A screenshot of the loaded page is written to the output directory.
#
# usage: scripts/dashboard-check.sh [BINARY]
#   BINARY is a built `kinference`; without it, `cargo build -p kinference` builds
#   target/debug/kinference.
# env: DASHBOARD_OUT  where the screenshot and the pages go (default target/dashboard-check)
#      CHROMIUM       the browser (default /usr/bin/chromium; installed with apt-get when
#                     missing and this runs as root)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
OUT=${DASHBOARD_OUT:-$REPO/target/dashboard-check}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
MODEL=tiny
BLOCK=16
T0=$(date +%s)
log() { echo "[dashboard-check +$(( $(date +%s) - T0 ))s] $*"; }

WORK=$(mktemp -d)
SIM_PID=""
ROUTER_PID=""
LOAD_PID=""
DIED=""
show_logs() {
  local f
  for f in "$WORK/router.err" "$WORK/sim.err" "$WORK/load.err" "$WORK/chromium.err"; do
    [ -s "$f" ] && { echo "--- last lines of $(basename "$f")" >&2; tail -20 "$f" >&2; }
  done
  return 0
}
die() { DIED=1; log "error: $*"; show_logs; exit 1; }
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
cleanup() {
  local rc=$?
  [ "$rc" -ne 0 ] && [ -z "${DIED:-}" ] && show_logs
  stop "$LOAD_PID"
  stop "$ROUTER_PID"
  stop "$SIM_PID"
  rm -rf "$WORK"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the browser
if [ ! -x "$CHROMIUM" ]; then
  [ "$(id -u)" = 0 ] || die "$CHROMIUM is missing (apt-get install chromium, as root)"
  log "installing Debian's chromium"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium >"$WORK/apt.log" 2>&1 ||
    { apt-get update -q >>"$WORK/apt.log" 2>&1 && apt-get install -y -q chromium >>"$WORK/apt.log" 2>&1; } ||
    { tail -20 "$WORK/apt.log" >&2; die "apt-get install chromium failed"; }
fi
"$CHROMIUM" --version >/dev/null 2>&1 || die "$CHROMIUM does not run"
log "$("$CHROMIUM" --version 2>/dev/null)"

# --- the binary
BIN=$(kinference_binary "$REPO" debug "${1:-}") || die "no kinference binary"
mkdir -p "$OUT"

# --- two replicas and the router, on ports they pick
NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas 2 --model "$MODEL" --tokenizer "$TOKENIZER" \
  --block-size "$BLOCK" --num-gpu-blocks 2048 --max-model-len 4096 --speedup 20 \
  --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0' >"$WORK/sim.out" 2>"$WORK/sim.err" &
SIM_PID=$!
wait_sim_replicas "$WORK/sim.out" "$SIM_PID" 2 30 || die "the simulator did not start"
REPLICA_FLAGS=()
for i in 0 1; do
  line=$(grep "^replica=$i " "$WORK/sim.out")
  REPLICA_FLAGS+=(--replica "$(field "$line" url),events=$(dial "$(field "$line" events)"),replay=$(dial "$(field "$line" replay)")")
done
NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
  --model "$MODEL" --tokenizer "$TOKENIZER" --block-size "$BLOCK" --policy precise \
  --scrape-interval-ms 200 "${REPLICA_FLAGS[@]}" >"$WORK/router.out" 2>"$WORK/router.err" &
ROUTER_PID=$!
read -r DATA_ADDR ADMIN_ADDR < <(router_addrs "$WORK/router.err" "$ROUTER_PID" 30) ||
  die "the router did not start"
ROUTER=http://$DATA_ADDR
ADMIN=http://$ADMIN_ADDR
wait_router_ready "$ADMIN" "$ROUTER_PID" 2 30 || die "the router never became ready"
log "router $ROUTER, dashboard $ADMIN/dashboard"

# --- load: 8 clients, each a conversation over one of 4 long documents, until stopped
python3 - "$ROUTER" "$MODEL" >"$WORK/load.out" 2>"$WORK/load.err" <<'PYEOF' &
import json, sys, threading, urllib.request
base, model = sys.argv[1], sys.argv[2]
def doc(d):
    return f"Document {d}. " + "".join(f"Line {i} of document {d} is about caching. " for i in range(60))
def client(c):
    n = 0
    while True:
        n += 1
        body = json.dumps({"model": model, "prompt": doc(c % 4) + f" Question {c}.{n}?", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30).read()
        except Exception as e:
            print(f"client {c}: {e}", file=sys.stderr, flush=True)
for c in range(8):
    threading.Thread(target=client, args=(c,), daemon=True).start()
threading.Event().wait()
PYEOF
LOAD_PID=$!

# chrome URL OUTFILE [extra flags]: the page's DOM after 6 s of its own (virtual) time.
chrome() {
  local url=$1 out=$2 profile
  shift 2
  profile=$(mktemp -d -p "$WORK")
  timeout 60 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --disable-dev-shm-usage --user-data-dir="$profile" --virtual-time-budget=6000 \
    --window-size=1400,2000 "$@" "$url" >"$out" 2>>"$WORK/chromium.err"
}

# metric NAME: the sum of NAME's samples on the router's /metrics.
metric() {
  python3 "$HERE/lib/prom.py" "$ADMIN/metrics" "$1"
}

# read_page FILE: the numbers the page shows, as JSON (the values of its data-value attributes).
read_page() {
  python3 - "$1" <<'PYEOF'
import json, re, sys
html = open(sys.argv[1]).read()
def value(id_):
    m = re.search(r'<[^>]*id="%s"[^>]*>' % re.escape(id_), html)
    if not m:
        sys.exit(f"no element #{id_} on the page")
    v = re.search(r'data-value="([^"]*)"', m.group(0))
    return float(v.group(1)) if v and v.group(1) != "" else None
updates = re.search(r'<body[^>]*data-updates="(\d+)"', html)
rows = re.findall(r'<tr data-replica="([^"]+)">(.*?)</tr>', html)
print(json.dumps({
    "updates": int(updates.group(1)) if updates else 0,
    "saved_tokens": value("saved-tokens"),
    "saved_gpu_seconds": value("saved-gpu-seconds"),
    "saved_kwh": value("saved-kwh"),
    "saved_usd": value("saved-usd"),
    "saved_vs_baseline": value("baselines"),
    "rps": value("rps"),
    "hit": value("hit"),
    "replicas": [r[0] for r in rows],
    "index_entries": [int(m) for r in rows for m in re.findall(r'class="index-entries" data-value="(\d+)"', r[1])],
    "charts": len(re.findall(r"<polyline", html)),
}))
PYEOF
}

# The page's rates come from the router's history, sampled once a second: read the page once
# the history holds a few points under load (Chromium's virtual time runs ahead of the wall
# clock, so a page read right after the start can find one point and no rate yet).
python3 - "$ADMIN/debug/dashboard" <<'PYEOF' || die "the router's history never showed the load"
import json, sys, time, urllib.request
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    h = json.load(urllib.request.urlopen(sys.argv[1], timeout=5)).get("history", [])
    if len(h) >= 3 and any((p.get("requests_per_s") or 0) > 0 for p in h[-2:]):
        sys.exit(0)
    time.sleep(0.2)
sys.exit("no requests/s in the history after 30 s")
PYEOF
log "page under load, twice"
chrome "$ADMIN/dashboard" "$WORK/page1.html" --dump-dom || die "chromium failed (page 1)"
P1=$(read_page "$WORK/page1.html") || die "page 1 is not the dashboard"
chrome "$ADMIN/dashboard" "$WORK/page2.html" --dump-dom || die "chromium failed (page 2)"
P2=$(read_page "$WORK/page2.html") || die "page 2 is not the dashboard"
chrome "$ADMIN/dashboard" /dev/null --screenshot="$OUT/dashboard.png" || die "chromium failed (screenshot)"
[ -s "$OUT/dashboard.png" ] || die "no screenshot"
cp "$WORK/page1.html" "$WORK/page2.html" "$OUT/"
log "page 1: $P1"
log "page 2: $P2"
python3 - "$P1" "$P2" <<'PYEOF' || die "the dashboard did not show live numbers"
import json, sys
p1, p2 = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for p in (p1, p2):
    assert p["updates"] >= 2, f"the page read the router fewer than twice: {p}"
    for k in ("saved_tokens", "saved_gpu_seconds", "saved_kwh", "saved_usd", "rps", "hit"):
        assert p[k] is not None and p[k] >= 0, f"{k} shows no number: {p}"
    assert p["saved_tokens"] > 0 and p["saved_gpu_seconds"] > 0, f"nothing saved under load: {p}"
    assert p["rps"] > 0, f"no requests/s under load: {p}"
    assert len(p["replicas"]) == 2, f"expected both replicas' rows: {p}"
    assert sum(p["index_entries"]) > 0, f"no index entries shown: {p}"
    assert p["charts"] >= 3, f"charts not drawn: {p}"
assert p2["saved_tokens"] > p1["saved_tokens"], f"saved tokens did not change: {p1} {p2}"
assert p2["saved_gpu_seconds"] > p1["saved_gpu_seconds"], f"GPU-seconds did not change: {p1} {p2}"
PYEOF

log "stopping the load; the page's savings must equal /metrics once settled"
stop "$LOAD_PID" 5
LOAD_PID=""
prev=""
for _ in $(seq 1 100); do
  now=$(metric kinference_saved_prefill_tokens_total)
  inflight=$(metric kinference_worker_in_flight)
  [ "$now" = "$prev" ] && [ "$inflight" = "0.0" ] && break
  prev=$now
  sleep 0.2
done
[ "$now" = "$prev" ] || die "the router's counters never settled"
chrome "$ADMIN/dashboard" "$WORK/page3.html" --dump-dom || die "chromium failed (page 3)"
P3=$(read_page "$WORK/page3.html") || die "page 3 is not the dashboard"
cp "$WORK/page3.html" "$OUT/"
TOKENS=$(metric kinference_saved_prefill_tokens_total)
GPU_S=$(metric kinference_saved_prefill_gpu_seconds_total)
# One pool with the default baseline (round-robin): one series.
BASE_S=$(metric kinference_baseline_saved_prefill_gpu_seconds_total)
log "page 3: $P3"
log "/metrics: kinference_saved_prefill_tokens_total $TOKENS, kinference_saved_prefill_gpu_seconds_total $GPU_S, kinference_baseline_saved_prefill_gpu_seconds_total $BASE_S"
python3 - "$P3" "$TOKENS" "$GPU_S" "$BASE_S" <<'PYEOF' || die "the page's savings differ from /metrics"
import json, sys
p, tokens, gpu_s, base_s = json.loads(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
assert p["saved_vs_baseline"] is not None, f"no saving against round-robin shown: {p}"
assert abs(p["saved_vs_baseline"] - (gpu_s - base_s)) <= 1e-9 * max(1.0, gpu_s), \
    f"saved vs round-robin: page {p['saved_vs_baseline']} vs /metrics {gpu_s - base_s}"
assert p["saved_tokens"] == tokens, f"tokens: page {p['saved_tokens']} vs /metrics {tokens}"
assert abs(p["saved_gpu_seconds"] - gpu_s) <= 1e-9 * max(1.0, gpu_s), \
    f"GPU-seconds: page {p['saved_gpu_seconds']} vs /metrics {gpu_s}"
# The defaults: $2 per GPU-hour, 700 W.
assert abs(p["saved_usd"] - gpu_s / 3600 * 2.0) <= 1e-9, p
assert abs(p["saved_kwh"] - gpu_s * 700 / 3.6e6) <= 1e-12, p
PYEOF
log "ok: live numbers, changing under load, savings equal to /metrics; screenshot $OUT/dashboard.png"
