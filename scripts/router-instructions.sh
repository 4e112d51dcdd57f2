#!/usr/bin/env bash
# router-instructions.sh - the CPU instructions `kinference serve` executes per request, counted
# by valgrind's callgrind: the same count for the same binary and inputs whatever else the
# machine is doing, so two builds can be compared on a busy machine where wall-clock figures
# (scripts/router-latency.sh) are too noisy to show a few percent.
#
# The router (--policy precise, scraping off so that time spent under valgrind does not add
# scrapes) fronts 4 simulated replicas with KV events on, as in scripts/router-latency.sh, and
# gets the same kind of request, sent one at a time: WORKLOAD=dev (default), one of 8 shared
# ~4,000-character prefixes plus a unique tail, /v1/completions, max_tokens=8; WORKLOAD=chat,
# router-latency.sh's real conversations (scripts/lib/chat_bodies.py) limited to the first
# CHAT_CONVERSATIONS of them, all sent once before the counted requests (so that, as in a
# long router-latency.sh run, earlier turns and earlier passes are in the caches), then the
# same requests again with new tags, /v1/chat/completions, max_tokens=8. The router runs twice, with N1 and with
# N2 requests; (instructions(N2) - instructions(N1)) / (N2 - N1) is the per-request figure,
# start-up (tokenizer loading) and shutdown cancelling out. Printed twice: for the whole router,
# and for its data-plane threads only (callgrind counts each thread on its own). Compare the
# second: under valgrind the router reads KV events too slowly, replays what it missed, and the
# replays add tens of thousands of instructions per request to other threads, differently each
# run. valgrind offers no SHA extensions, so the block hashes' SHA-256 runs its portable code
# here (several times the instructions it takes on a CPU that has them, as this machine's do):
# read `sha2::sha256::compress256` apart when new text brings many new blocks.
#
# usage: scripts/router-instructions.sh ROUTER_BINARY [SIM_BINARY]
#   SIM_BINARY (default ROUTER_BINARY) runs the replicas: give both runs of a comparison the
#   same one so that only the router differs.
# env: N1=20 N2=220 TOKENIZER=../shared/data/tokenizers/llama3.1 RESULTS=target/router-instructions
#      WORKLOAD=dev (or chat) CHAT_CONVERSATIONS=60
#      KEEP_ALIVE=1: every request on one kept-alive connection (default: a new connection
#      per request, so the figure includes what accepting and closing a connection costs)
#      NEW_TEXT=1 (WORKLOAD=chat): no warm-up pass; the counted requests are the first N of the
#      conversations' turns in order, each sent once, so every request brings text no request
#      before it had (a first turn whole, a later turn its previous answer and new message), as
#      scripts/router-paired.sh's client sends them. Without it nearly every counted request
#      reuses the tokenizer's cache up to its tag.
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
ROUTER=$1
SIM=${2:-$1}
N1=${N1:-20}
N2=${N2:-220}
TOKENIZER=${TOKENIZER:-$REPO/../shared/data/tokenizers/llama3.1}
WORKLOAD=${WORKLOAD:-dev}
CHAT_CONVERSATIONS=${CHAT_CONVERSATIONS:-60}
OUT=${RESULTS:-$REPO/target/router-instructions}/$(date +%Y%m%d-%H%M%S)
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
[ "$N2" -gt "$N1" ] || { echo "N2 must be greater than N1" >&2; exit 1; }
mkdir -p "$OUT"
CHAT_BODIES=
case $WORKLOAD in
  dev) ;;
  chat)
    CHAT_BODIES=$OUT/chat-bodies.tsv
    python3 "$HERE/lib/chat_bodies.py" "$CHAT_BODIES" "$CHAT_CONVERSATIONS"
    ;;
  *) echo "WORKLOAD must be dev or chat" >&2; exit 1 ;;
esac
PIDS=()
trap 'for p in "${PIDS[@]}"; do stop_tree "$p" 5; done' EXIT

start_sim "$SIM" "$TOKENIZER" "$OUT" || { stop_tree "$SIM_PID" 5; exit 1; }
PIDS+=("$SIM_PID")

# count N: runs the router under callgrind for N requests and prints its instruction total.
count() {
  local n=$1 dir=$OUT/n$1 pid data admin
  mkdir -p "$dir"
  # The purge delay named here as the router would set it (bins/kinference/src/main.rs): without
  # it the router starts itself again with `exec`, which valgrind does not follow, and the
  # router would run uncounted.
  BENCH_WRAP=(env MIMALLOC_PURGE_DELAY=10000 valgrind --tool=callgrind --separate-threads=yes
    --callgrind-out-file="$dir/callgrind.out")
  bench_serve "$ROUTER" "$dir/router" --scrape-interval-ms 0
  pid=$!
  PIDS+=("$pid")
  read -r data admin < <(router_addrs "$dir/router.err" "$pid" 600)
  python3 - "http://$data" "$n" "$CHAT_BODIES" <<'PYEOF'
import json, sys, urllib.request
url, n, chat = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import http.client, os, urllib.parse
u = urllib.parse.urlparse(url)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
def send(path, body, i):
    if os.environ.get("KEEP_ALIVE") == "1":
        # One kept-alive connection for every request.
        conn.request("POST", path, body.encode(), {"content-type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            sys.exit(f"request {i}: HTTP {r.status}")
        return
    # A new connection per request (urllib asks to close after each).
    req = urllib.request.Request(url + path, body.encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
        if r.status != 200:
            sys.exit(f"request {i}: HTTP {r.status}")
if chat:
    lines = [l.rstrip("\n").split("\t") for l in open(chat, encoding="utf-8") if "\t" in l]
    chat_body = lambda i, tag: (f'{{"model":"bench",{lines[i % len(lines)][0]} [{tag}-{i}]'
                                f'{lines[i % len(lines)][1]},"max_tokens":8,"temperature":0}}')
    new_text = os.environ.get("NEW_TEXT") == "1"
    if new_text and n > len(lines):
        sys.exit(f"NEW_TEXT=1 sends each turn once: {n} requests need more than the {len(lines)} "
                 "turns of CHAT_CONVERSATIONS conversations")
    if not new_text:
        for i in range(len(lines)):
            send("/v1/chat/completions", chat_body(i, "warm"), i)
    for i in range(n):
        send("/v1/chat/completions", chat_body(i, "counted"), i)
    sys.exit(0)
words = ("the router sends each request to a replica that already holds its prefix in cache "
         "blocks of sixteen tokens").split()
def prefix(k):
    s, out = 7919 * (k + 1), [f"Document {k}."]
    while sum(len(w) + 1 for w in out) < 4000:
        s = (s * 1103515245 + 12345) % 2147483648
        out.append(words[(s // 65536) % len(words)])
    return " ".join(out)
prefixes = [prefix(k) for k in range(8)]
for i in range(n):
    body = {"model": "bench", "prompt": f"{prefixes[i % 8]} request {i} unique tail", "max_tokens": 8}
    send("/v1/completions", json.dumps(body), i)
PYEOF
  stop "$pid" 120
  # One file per thread (callgrind.out-NN); a data-plane thread's file is one that ran
  # Shard::run. Prints "DATA_PLANE ALL".
  local f n dp=0 all=0
  for f in "$dir"/callgrind.out-*; do
    n=$(awk '/^(summary|totals):/ {print $2; exit}' "$f")
    all=$((all + n))
    if grep -q '^c\{0,1\}fn=([0-9]*) .*kinference_proxy::Shard::run' "$f"; then dp=$((dp + n)); fi
  done
  echo "$dp $all"
}

read -r d1 i1 < <(count "$N1")
read -r d2 i2 < <(count "$N2")
per=$(( (i2 - i1) / (N2 - N1) ))
per_data=$(( (d2 - d1) / (N2 - N1) ))
{
  echo "router: $ROUTER ($("$ROUTER" --version 2>/dev/null || true))"
  echo "simulator: $SIM"
  echo "workload: $WORKLOAD$([ "$WORKLOAD" = chat ] && echo ", $CHAT_CONVERSATIONS conversations")$([ "${NEW_TEXT:-}" = 1 ] && echo ", each turn sent once (new text)")"
  echo "instructions: $i1 for $N1 requests, $i2 for $N2 requests"
  echo "per request: $per"
  echo "data-plane threads: $d1 for $N1 requests, $d2 for $N2 requests"
  echo "data-plane threads per request: $per_data"
} | tee "$OUT/summary.txt"
