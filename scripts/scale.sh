#!/usr/bin/env bash
# scale.sh - one simulator process with N replicas (KV events and replay on) and one router
# subscribed to all of them: idle CPU of each process over 10 s (from /proc), resident memory,
# how often the router scraped each replica's /metrics in that window, and how many replicas the
# router sees up. Prints one Markdown table row per N.
#
# usage: scripts/scale.sh [BINARY]
#   BINARY is a built `kinference`; without it `cargo build -p kinference` builds the debug one
#   (say which build when recording numbers: debug and release differ a lot).
# env: SCALE_NS           replica counts to run (default "96 256 1000")
#      SCALE_IDLE_SECS    the idle window measured (default 10)
#      SCALE_READY_SECS   how long to wait for every replica to be up (default 120)
#      SCALE_ROUTER_ARGS  extra `kinference serve` flags, e.g. "--scrape-interval-ms 0" to see the
#                         KV-event subscriptions' cost without /metrics scraping, or
#                         "--scrape-idle-interval-ms 0" to scrape every replica every interval
#      SCALE_REQUIRE_ALL  1: fail (exit 1) unless every replica was up and subscribed at every N
#                         (the CI short form)
#      SCALE_LOAD_REQUESTS  after the idle window, send this many completions through the router
#                         (SCALE_LOAD_CONCURRENCY at a time, default 8; each prompt unique,
#                         max_tokens 8) and print a second
#                         table: CPU per request of each process under load (default 0: none).
#                         The simulator's cost should grow with requests, not with replicas.
#                         After the passes, SCALE_SETTLE_SECS (default 6) of quiet, then the
#                         idle CPU again over SCALE_IDLE_SECS (a third table): the router
#                         now carries every replica's request series.
#      SCALE_LOAD_PASSES  passes of SCALE_LOAD_REQUESTS, back to back, one row each (default 2).
#                         Pass 1 starts from an idle fleet: at 1,000 replicas most of its
#                         requests reach a replica the router holds no connection to (a TCP
#                         connect and accept each) and touch state a replica has not used yet;
#                         pass 2 finds them connected and warm (the steady state). The "TCP
#                         accepts" column is the host's PassiveOpens (/proc/net/snmp) over the
#                         pass per request: mostly the simulator accepting the router's
#                         connections (anything else on the host counts too).
#      SCALE_ROUTE_FIRST  the router is given only the first K of the N replicas (the others
#                         idle in the same simulator process): hosting N against serving N.
#      SCALE_KEEP         keep the work directory (logs) and print its path
#      SCALE_CHURN        1: one more replica, in a simulator process of its own, beside the N;
#                         after the idle window it is killed (SIGKILL) and started again on the
#                         same ports, and a third table gives the milliseconds until the router
#                         has it down (from the kill), and up again (from the moment it listens),
#                         polling /debug/replicas every 20 ms (each poll reads every replica).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
NS=${SCALE_NS:-96 256 1000}
IDLE=${SCALE_IDLE_SECS:-10}
READY=${SCALE_READY_SECS:-120}
T0=$(date +%s)
log() { echo "[scale +$(( $(date +%s) - T0 ))s] $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"

WORK=$(mktemp -d)
SIM_PID="" ROUTER_PID="" CHURN_PID=""
cleanup() {
  stop "$ROUTER_PID"
  stop "$SIM_PID"
  stop "$CHURN_PID"
  if [ -n "${SCALE_KEEP:-}" ]; then log "work directory kept: $WORK"; else rm -rf "$WORK"; fi
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BIN=$(kinference_binary "$REPO" debug "${1:-}") || die "no kinference binary"
# A thousand replicas: ~3000 listening ports in the simulator, ~3000 sockets in the router.
ulimit -n "$(ulimit -Hn)"
TCK=$(getconf CLK_TCK)

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_mib() { awk '/^VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

# passive_opens: TCP connections accepted on this host so far (PassiveOpens, /proc/net/snmp).
passive_opens() {
  awk '/^Tcp:/ { if (!h) { for (i = 1; i <= NF; i++) col[$i] = i; h = 1 } else print $col["PassiveOpens"] }' /proc/net/snmp
}

# load ADDR TOTAL PASS CONCURRENCY: TOTAL completions through the router at ADDR, CONCURRENCY
# at a time, each prompt unique (PASS is part of it); prints how many were answered 200.
load() {
  python3 - "$@" <<'PYEOF'
import http.client, json, sys, threading
addr, total, pass_ = sys.argv[1], int(sys.argv[2]), sys.argv[3]
host, port = addr.rsplit(":", 1)
lock, counts, nxt = threading.Lock(), {"ok": 0}, iter(range(total))
def worker():
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    while True:
        with lock:
            i = next(nxt, None)
        if i is None:
            return
        body = json.dumps({"model": "tiny", "prompt": f"Request {i} of pass {pass_}: a short note on fleets.", "max_tokens": 8})
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        if resp.status == 200:
            with lock:
                counts["ok"] += 1
threads = [threading.Thread(target=worker) for _ in range(int(sys.argv[4]))]
for t in threads: t.start()
for t in threads: t.join()
print(counts["ok"])
PYEOF
}

# fleet_state ADMIN: replicas the router reports up, subscribed, in all, and the scrapes
# (ok + failed) it made of all of them so far.
fleet_state() {
  python3 - "$1" <<'PYEOF'
import json, sys, urllib.request
fleet = json.load(urllib.request.urlopen(f"{sys.argv[1]}/debug/replicas", timeout=10))
reps = [r for p in fleet["pools"] for r in p["replicas"]]
up = sum(r["health"] == "up" for r in reps)
subscribed = sum(all(w["events"] and w["events"]["connected"] for w in r["workers"]) for r in reps)
scrapes = sum(r["scrapes"]["ok"] + r["scrapes"]["failed"] for r in reps)
print(up, subscribed, len(reps), scrapes)
PYEOF
}

# until_health ADMIN URL down|up T0: milliseconds from T0 (epoch seconds) until the router
# reports the replica at URL in that state (up also needs its event stream connected again).
until_health() {
  python3 - "$@" <<'PYEOF'
import json, sys, time, urllib.request
admin, url, want, t0 = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
while time.time() < t0 + 60:
    fleet = json.load(urllib.request.urlopen(f"{admin}/debug/replicas", timeout=10))
    rep = next(r for p in fleet["pools"] for r in p["replicas"] if r["url"] == url)
    connected = all(w["events"] and w["events"]["connected"] for w in rep["workers"])
    if rep["health"] == want and (want == "down" or connected):
        print(round(1000 * (time.time() - t0)))
        sys.exit(0)
    time.sleep(0.02)
print("over 60000")
PYEOF
}

echo "| replicas | router CPU idle (% of a core) | simulator CPU idle | scrapes per replica per s | router RSS MiB (KiB per replica) | simulator RSS MiB | up / subscribed / replicas |"
echo "|---|---|---|---|---|---|---|"
missing=0
LOAD_ROWS="" AFTER_ROWS="" CHURN_ROWS=""
for n in $NS; do
  # The files of the previous N go first: a reader started right after a launch could read
  # them before the new process truncates them.
  rm -f "$WORK/sim.out" "$WORK/router.err" "$WORK/churn.out"
  NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas "$n" --model tiny \
    --tokenizer "$TOKENIZER" --block-size 16 --num-gpu-blocks 1024 --speedup 1000 \
    --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0' \
    >"$WORK/sim.out" 2>"$WORK/sim.err" &
  SIM_PID=$!
  wait_sim_replicas "$WORK/sim.out" "$SIM_PID" "$n" 120 || die "the simulator did not start"
  flags=()
  while read -r line; do
    url=$(field "$line" url) ev=$(field "$line" events) rp=$(field "$line" replay)
    flags+=(--replica "$url,events=$(dial "$ev"),replay=$(dial "$rp")")
  done < <(grep '^replica=' "$WORK/sim.out" | head -n "${SCALE_ROUTE_FIRST:-$n}")
  want=$(( ${#flags[@]} / 2 ))
  if [ "${SCALE_CHURN:-0}" = 1 ]; then
    read -r CP CE CR < <(free_ports 3)
    CHURN_URL="http://127.0.0.1:$CP"
    start_churn() {
      rm -f "$WORK/churn.out"
      NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port "$CP" --replicas 1 --model tiny \
        --tokenizer "$TOKENIZER" --block-size 16 --num-gpu-blocks 1024 --speedup 1000 \
        --events-endpoint "tcp://*:$CE" --replay-endpoint "tcp://*:$CR" \
        >"$WORK/churn.out" 2>"$WORK/churn.err" &
      CHURN_PID=$!
      wait_sim_replicas "$WORK/churn.out" "$CHURN_PID" 1 60 || die "the churn replica did not start"
    }
    start_churn
    flags+=(--replica "$CHURN_URL,events=tcp://127.0.0.1:$CE,replay=tcp://127.0.0.1:$CR")
    want=$(( want + 1 ))
  fi
  NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model tiny \
    --tokenizer "$TOKENIZER" --block-size 16 ${SCALE_ROUTER_ARGS:-} "${flags[@]}" \
    >"$WORK/router.out" 2>"$WORK/router.err" &
  ROUTER_PID=$!
  read -r DATA_ADDR ADMIN_ADDR < <(router_addrs "$WORK/router.err" "$ROUTER_PID" 60) ||
    die "the router did not start"
  if ! wait_router_ready "http://$ADMIN_ADDR" "$ROUTER_PID" "$want" "$READY" 2>"$WORK/ready.err"; then
    log "n=$n: not every replica up and subscribed within ${READY}s (measuring anyway)"
  fi
  read -r _ _ _ scrapes0 < <(fleet_state "http://$ADMIN_ADDR")
  r0=$(ticks "$ROUTER_PID") s0=$(ticks "$SIM_PID")
  sleep "$IDLE"
  r1=$(ticks "$ROUTER_PID") s1=$(ticks "$SIM_PID")
  read -r up subscribed total scrapes1 < <(fleet_state "http://$ADMIN_ADDR")
  pct() { awk -v d="$1" -v t="$TCK" -v s="$IDLE" 'BEGIN {printf "%.1f", 100 * d / t / s}'; }
  rate=$(awk -v d=$(( scrapes1 - scrapes0 )) -v n="$want" -v s="$IDLE" 'BEGIN {printf "%.2f", d / n / s}')
  rss=$(rss_mib "$ROUTER_PID")
  per=$(awk -v m="$rss" -v n="$want" 'BEGIN {printf "%.0f", m * 1024 / n}')
  echo "| $n | $(pct $(( r1 - r0 ))) | $(pct $(( s1 - s0 ))) | $rate | $rss ($per) | $(rss_mib "$SIM_PID") | $up / $subscribed / $total |"
  if [ "$up" -ne "$want" ] || [ "$subscribed" -ne "$want" ] || [ "$total" -ne "$want" ]; then
    missing=1
  fi
  if [ "${SCALE_LOAD_REQUESTS:-0}" -gt 0 ]; then
    for pass in $(seq 1 "${SCALE_LOAD_PASSES:-2}"); do
      a0=$(passive_opens)
      r0=$(ticks "$ROUTER_PID") s0=$(ticks "$SIM_PID") t0=$(date +%s.%N)
      ok=$(load "$DATA_ADDR" "$SCALE_LOAD_REQUESTS" "$pass" "${SCALE_LOAD_CONCURRENCY:-8}")
      r1=$(ticks "$ROUTER_PID") s1=$(ticks "$SIM_PID") t1=$(date +%s.%N)
      a1=$(passive_opens)
      per_req() { awk -v d="$1" -v t="$TCK" -v n="$ok" 'BEGIN {printf "%.3f", n ? 1000 * d / t / n : 0}'; }
      rps=$(awk -v a="$t0" -v b="$t1" -v n="$ok" 'BEGIN {printf "%.0f", n / (b - a)}')
      accepts=$(awk -v d=$(( a1 - a0 )) -v n="$ok" 'BEGIN {printf "%.2f", n ? d / n : 0}')
      LOAD_ROWS+="| $n | $pass | $ok / $SCALE_LOAD_REQUESTS | $rps | $accepts | $(per_req $(( r1 - r0 ))) | $(per_req $(( s1 - s0 ))) |"$'\n'
    done
    # Idle again once the replicas are quiet (the adaptive scrape backs off after
    # scrape.idle_interval_ms, 5 s): every replica now has its request series, which the
    # router's /metrics page and dashboard sampler carry from then on.
    sleep "${SCALE_SETTLE_SECS:-6}"
    r0=$(ticks "$ROUTER_PID") s0=$(ticks "$SIM_PID")
    sleep "$IDLE"
    r1=$(ticks "$ROUTER_PID") s1=$(ticks "$SIM_PID")
    AFTER_ROWS+="| $n | $(pct $(( r1 - r0 ))) | $(pct $(( s1 - s0 ))) | $(rss_mib "$ROUTER_PID") |"$'\n'
  fi
  if [ "${SCALE_CHURN:-0}" = 1 ]; then
    kill -9 "$CHURN_PID"; wait "$CHURN_PID" 2>/dev/null || true
    down_ms=$(until_health "http://$ADMIN_ADDR" "$CHURN_URL" down "$(date +%s.%N)")
    start_churn
    # From the moment it listens (its replica line printed), not from the process spawn.
    up_at=$(date +%s.%N)
    up_ms=$(until_health "http://$ADMIN_ADDR" "$CHURN_URL" up "$up_at")
    CHURN_ROWS+="| $n + 1 | $down_ms | $up_ms |"$'\n'
    stop "$CHURN_PID"; CHURN_PID=""
  fi
  stop "$ROUTER_PID"; ROUTER_PID=""
  stop "$SIM_PID"; SIM_PID=""
done
if [ -n "$LOAD_ROWS" ]; then
  echo
  echo "| replicas | pass | completions ok | requests/s | TCP accepts per request (host) | router CPU ms per request | simulator CPU ms per request |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s' "$LOAD_ROWS"
fi
if [ -n "$AFTER_ROWS" ]; then
  echo
  echo "| replicas | router CPU idle after the load (% of a core) | simulator CPU idle after the load | router RSS MiB |"
  echo "|---|---|---|---|"
  printf '%s' "$AFTER_ROWS"
fi
if [ -n "$CHURN_ROWS" ]; then
  echo
  echo "| replicas | killed -> router has it down (ms) | listening again -> router has it up and subscribed (ms) |"
  echo "|---|---|---|"
  printf '%s' "$CHURN_ROWS"
fi
if [ "${SCALE_REQUIRE_ALL:-0}" = 1 ] && [ "$missing" = 1 ]; then
  die "not every replica was up and subscribed (SCALE_REQUIRE_ALL=1)"
fi
