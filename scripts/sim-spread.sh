#!/usr/bin/env bash
# sim-spread.sh - what spreading requests over many replicas of one simulator process costs it,
# without a router: `GET /health` (no engine work) and completions (max_tokens 8, each prompt
# unique) from one Python client, one request at a time, and the simulator's CPU (utime+stime
# from /proc) per request in each pattern:
#   - one kept-alive connection to one replica;
#   - kept-alive connections to the first 96 replicas, round robin;
#   - kept-alive connections to all N replicas, round robin (first round: connects; then again);
#   - a fresh connection per request (connect, request, close), to one replica and round robin;
#   - completions from SPREAD_CONCURRENCY clients at once (default 8, each with its own
#     connections, each replica used by one client), over 96 and over N replicas, and with
#     SPREAD_SUBSCRIBE=1 the same through the subscribed router (least-load over all N), in
#     rounds: a request's cost can depend on the request rate the fleet sees.
# A request that lands on a replica whose connection and tasks are out of the CPU caches costs
# more than one that lands on a recently used one; that part grows with replicas, not requests.
#
# usage: scripts/sim-spread.sh [BINARY]   (BINARY: a built `kinference`, else the debug build)
# env: SPREAD_N         replicas (default 1000)
#      SPREAD_REQUESTS  requests per pattern (default 20000; a quarter of it for completions)
#      SPREAD_CONCURRENCY clients at once in the concurrent patterns (default 8)
#      SPREAD_SUBSCRIBE 1: a router (`kinference serve`, scraping off) subscribed to every
#                       replica's KV events, as in scripts/scale.sh; requests still go straight
#                       to the replicas, so each request's events leave on its replica's own
#                       subscribed TCP connection
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
N=${SPREAD_N:-1000}
REQUESTS=${SPREAD_REQUESTS:-20000}

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

BIN=$(kinference_binary "$REPO" debug "${1:-}") || { echo "no kinference binary" >&2; exit 1; }
ulimit -n "$(ulimit -Hn)"

NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas "$N" --model tiny \
  --tokenizer "$TOKENIZER" --block-size 16 --num-gpu-blocks 1024 --speedup 1000 \
  --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0' \
  >"$WORK/sim.out" 2>"$WORK/sim.err" &
SIM_PID=$!
wait_sim_replicas "$WORK/sim.out" "$SIM_PID" "$N" 120 || exit 1
while read -r line; do
  field "$line" url | sed 's#^http://##'
done < <(grep '^replica=' "$WORK/sim.out") >"$WORK/addrs"

if [ "${SPREAD_SUBSCRIBE:-0}" = 1 ]; then
  flags=()
  while read -r line; do
    url=$(field "$line" url) ev=$(field "$line" events) rp=$(field "$line" replay)
    flags+=(--replica "$url,events=$(dial "$ev"),replay=$(dial "$rp")")
  done < <(grep '^replica=' "$WORK/sim.out")
  NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model tiny \
    --tokenizer "$TOKENIZER" --block-size 16 --scrape-interval-ms 0 "${flags[@]}" \
    >"$WORK/router.out" 2>"$WORK/router.err" &
  ROUTER_PID=$!
  read -r DATA_ADDR ADMIN_ADDR < <(router_addrs "$WORK/router.err" "$ROUTER_PID" 60) || exit 1
  # Every replica's event stream connected (health stays unknown: no scrapes).
  python3 - "http://$ADMIN_ADDR" "$N" <<'PYEOF'
import json, sys, time, urllib.request
admin, want = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    fleet = json.load(urllib.request.urlopen(f"{admin}/debug/replicas", timeout=10))
    reps = [r for p in fleet["pools"] for r in p["replicas"]]
    if len(reps) == want and all(w["events"] and w["events"]["connected"] for r in reps for w in r["workers"]):
        sys.exit(0)
    time.sleep(0.2)
sys.exit("not every replica's events subscribed within 120 s")
PYEOF
fi

python3 - "$SIM_PID" "$WORK/addrs" "$REQUESTS" "${SPREAD_CONCURRENCY:-8}" "${DATA_ADDR:-}" <<'PYEOF'
import http.client, json, os, sys, threading, time
pid, addrs, n = sys.argv[1], [l.strip() for l in open(sys.argv[2])], int(sys.argv[3])
tck = os.sysconf("SC_CLK_TCK")

def ticks():
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])

conns = {}

seq = iter(range(1 << 62))

def run(label, targets, count, fresh, completions=False):
    t0 = ticks()
    for i in range(count):
        addr = targets[i % len(targets)]
        c = None if fresh else conns.get(addr)
        if c is None:
            host, port = addr.rsplit(":", 1)
            c = http.client.HTTPConnection(host, int(port), timeout=30)
            if not fresh:
                conns[addr] = c
        if completions:
            body = json.dumps({"model": "tiny", "max_tokens": 8,
                               "prompt": f"Request {next(seq)}: a short note on fleets."})
            c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        else:
            c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        if r.status != 200:
            sys.exit(f"{addr}/health answered {r.status}")
        if fresh:
            c.close()
    us = 1e6 * (ticks() - t0) / tck / count
    print(f"| {'completions' if completions else '/health'} | {label} | {count} | {us:.0f} |")

print("| request | pattern | requests | simulator CPU us per request |")
print("|---|---|---:|---:|")
run("one kept-alive connection, 1 replica", addrs[:1], n, False)
run("kept-alive, 96 replicas round robin", addrs[:96], n, False)
run(f"kept-alive, {len(addrs)} replicas round robin, first round (connects)", addrs, len(addrs), False)
run(f"kept-alive, {len(addrs)} replicas round robin", addrs, n, False)
run("a fresh connection per request, 1 replica", addrs[:1], n, True)
run(f"a fresh connection per request, {len(addrs)} replicas round robin", addrs, n, True)
m = max(n // 4, 1)
run("one kept-alive connection, 1 replica", addrs[:1], m, False, True)
run("kept-alive, 96 replicas round robin", addrs[:96], m, False, True)
run(f"kept-alive, {len(addrs)} replicas round robin, first round", addrs, len(addrs), False, True)
run(f"kept-alive, {len(addrs)} replicas round robin", addrs, m, False, True)

conc, via = int(sys.argv[4]), sys.argv[5]
lock = threading.Lock()

def client(k, targets, count, pool, fails):
    for i in range(count):
        addr = targets[(k + i * conc) % len(targets)]
        c = pool.get(addr)
        if c is None:
            host, port = addr.rsplit(":", 1)
            c = pool[addr] = http.client.HTTPConnection(host, int(port), timeout=30)
        with lock:
            s = next(seq)
        body = json.dumps({"model": "tiny", "max_tokens": 8,
                           "prompt": f"Request {s}: a short note on fleets."})
        c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = c.getresponse()
        r.read()
        if r.status != 200:
            fails.append(r.status)

def run_conc(label, targets, rounds):
    pools = [dict() for _ in range(conc)]
    per = max(m // conc, 1)
    for rnd in range(rounds):
        fails = []
        t0, w0 = ticks(), time.monotonic()
        ts = [threading.Thread(target=client, args=(k, targets, per, pools[k], fails)) for k in range(conc)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if fails:
            sys.exit(f"{label}: {len(fails)} requests failed: {fails[:5]}")
        us = 1e6 * (ticks() - t0) / tck / (per * conc)
        rate = per * conc / (time.monotonic() - w0)
        print(f"| completions | {label}, round {rnd + 1} ({rate:,.0f} requests/s) | {per * conc} | {us:.0f} |")

run_conc(f"{conc} clients at once, kept-alive, 96 replicas round robin", addrs[:96], 2)
run_conc(f"{conc} clients at once, kept-alive, {len(addrs)} replicas round robin", addrs, 3)
if via:
    run_conc(f"{conc} clients at once through the router (least-load over {len(addrs)})", [via], 4)
PYEOF
