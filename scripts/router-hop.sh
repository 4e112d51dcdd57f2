#!/usr/bin/env bash
# router-hop.sh - what a router's own code takes per request at one connection, read off its
# syscalls' timestamps: from the end of reading the client's request to the start of writing it
# to a replica, and from the end of reading the replica's response to the start of writing it to
# the client (scripts/lib/hop_gaps.py). A client's latency (scripts/router-paired.sh,
# router-latency.sh's one-connection cells) also holds the client's, the kernel's and the
# scheduler's time, which on a small shared machine move by more than a router's own work;
# these two gaps are the router's alone.
#
# Each target in turn gets 4 simulated replicas of its own (`kinference sim`, as in
# router-latency.sh) and one Python client on one kept-alive connection sending router-latency's
# chat requests (scripts/lib/chat_bodies.py), /v1/chat/completions, max_tokens 8, one at a time:
# WARMUP requests, then REQUESTS more under `perf record -e raw_syscalls:*`. TEXT=new (default):
# the conversations' turns in order, each sent once, so every request brings text no request
# before it had (its previous answer and new message), as router-paired.sh sends them;
# TEXT=repeat: the first 200 turns over and over with new tags, so that after the first pass
# every prompt is in kinference's tokenizer cache up to its tag, as in router-latency.sh's
# cells. A target is a `kinference` binary (`serve --policy precise`, KV events on) or `nginx`
# (scripts/lib/nginx.sh, one worker). The traced syscalls cost time themselves; both kinds of
# target pay it at the same points, outside the gaps.
#
# usage: scripts/router-hop.sh TARGET...
# env: REQUESTS=500 WARMUP=1500 TEXT=new TOKENIZER=qwen3 (a directory, or a name in
#      ../shared/data/tokenizers) SIM_BIN= (the binary that runs the replicas; default: the
#      first kinference target) RESULTS=target/router-hop
#      PROFILE=   when set, the REQUESTS are profiled instead (`perf record -F 4999
#                 --call-graph dwarf`, TARGET/profile.data; read it with `perf report -i`),
#                 and no gaps are printed
set -euo pipefail
case ${1:-} in -h | --help | "") sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
# shellcheck source=lib/nginx.sh
source "$HERE/lib/nginx.sh"
# shellcheck source=lib/bench.sh
source "$HERE/lib/bench.sh"

REQUESTS=${REQUESTS:-500}
WARMUP=${WARMUP:-1500}
TEXT=${TEXT:-new}
case $TEXT in new | repeat) ;; *) echo "TEXT must be new or repeat" >&2; exit 2 ;; esac
TOKENIZER=${TOKENIZER:-qwen3}
[ -d "$TOKENIZER" ] || TOKENIZER=$REPO/../shared/data/tokenizers/$TOKENIZER
[ -f "$TOKENIZER/tokenizer.json" ] || { echo "no tokenizer.json in $TOKENIZER" >&2; exit 1; }
TOKENIZER=$(cd "$TOKENIZER" && pwd)
OUT=${RESULTS:-$REPO/target/router-hop}/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
log() { echo "[router-hop] $*" >&2; }
die() { log "error: $*"; exit 1; }
command -v perf >/dev/null || die "perf is needed"

SIM=${SIM_BIN:-}
for t in "$@"; do
  if [ "$t" = nginx ]; then
    nginx_bin >/dev/null || die "nginx is needed"
  else
    [ -x "$t" ] || die "$t is neither a kinference binary nor nginx"
    [ -n "$SIM" ] || SIM=$t
  fi
done
[ -n "$SIM" ] || die "no kinference binary among the targets: name one in SIM_BIN to run the replicas"
python3 "$HERE/lib/chat_bodies.py" "$OUT/chat-bodies.tsv" >/dev/null || die "could not write the chat requests"
[ "$TEXT" = repeat ] || [ $((WARMUP + REQUESTS)) -le "$(wc -l <"$OUT/chat-bodies.tsv")" ] ||
  die "TEXT=new sends each turn once: WARMUP + REQUESTS is more than the turns there are"

trap stop_all EXIT
trap 'exit 130' INT TERM

# sockets PORT PID...: `PID FD ROLE` for each TCP socket of the processes, ROLE client (local
# port PORT) or upstream (remote port one of the replicas').
sockets() {
  local port=$1
  shift
  python3 - "$port" "${SIM_URLS[*]}" "$@" <<'PYEOF'
import os, sys
port, urls, pids = int(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
replicas = {int(u.rsplit(":", 1)[1]) for u in urls}
ports = {}
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).readlines()[1:]:
        f = line.split()
        ports[f[9]] = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16))
for pid in pids:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if not link.startswith("socket:["):
            continue
        local, remote = ports.get(link[8:-1], (0, 0))
        role = "client" if local == port else "upstream" if remote in replicas else None
        if role:
            print(pid, fd, role)
PYEOF
}

for t in "$@"; do
  dir=$OUT/$(basename "$t")
  mkdir -p "$dir"
  start_sim "$SIM" "$TOKENIZER" "$dir" || { stop_tree "$SIM_PID" 5; die "the simulator did not start"; }
  PIDS+=("$SIM_PID")
  if [ "$t" = nginx ]; then
    failed=
    start_nginx "$dir/nginx" 1 "$dir/router" "${SIM_URLS[@]}" || failed=1
    pid=$NGINX_PID
    PIDS+=("$pid")
    [ -z "${failed:-}" ] || die "nginx did not start"
    url=$NGINX_URL
    port=${url##*:}
  else
    bench_serve "$t" "$dir/router"
    pid=$!
    PIDS+=("$pid")
    read -r data admin < <(router_addrs "$dir/router.err" "$pid" 120) || die "$t did not start (see $dir/router.err)"
    wait_router_ready "http://$admin" "$pid" 4 60 || die "$t was not ready (see $dir/router.err)"
    url=http://$data
    port=${data##*:}
  fi
  traced="$pid $(descendants "$pid" | tr '\n' ' ')"
  python3 - "$url" "$OUT/chat-bodies.tsv" "$TEXT" "$WARMUP" "$REQUESTS" "$dir" "$traced" "${PROFILE:-}" <<'PYEOF' &
import http.client, signal, subprocess, sys, time, urllib.parse
url, bodies, text, warmup, n, out, pids, profile = sys.argv[1:9]
warmup, n = int(warmup), int(n)
u = urllib.parse.urlparse(url)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
lines = [l.rstrip("\n").split("\t") for l in open(bodies, encoding="utf-8") if "\t" in l]
def send(i):
    head, tail = lines[i % 200 if text == "repeat" else i]
    conn.request("POST", "/v1/chat/completions",
                 f'{{"model":"bench",{head} [hop-{i}]{tail},"max_tokens":8,"temperature":0}}'.encode(),
                 {"content-type": "application/json"})
    r = conn.getresponse()
    r.read()
    if r.status != 200:
        sys.exit(f"request {i}: HTTP {r.status}")
for i in range(warmup):
    send(i)
events = (["-F", "4999", "--call-graph", "dwarf", "-o", f"{out}/profile.data"] if profile else
          ["-e", "raw_syscalls:sys_enter,raw_syscalls:sys_exit", "-o", f"{out}/syscalls.data"])
perf = subprocess.Popen(["perf", "record", "-q", *events, "-p", ",".join(pids.split())],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1)
if perf.poll() is not None:
    sys.exit(f"perf record stopped at once (exit {perf.returncode}): is perf allowed here "
             "(/proc/sys/kernel/perf_event_paranoid)?")
for i in range(warmup, warmup + n):
    send(i)
# The connections are still open: map their sockets before perf stops.
open(f"{out}/ready", "w").close()
deadline = time.monotonic() + 120
while True:
    try:
        open(f"{out}/mapped").close()
        break
    except FileNotFoundError:
        if time.monotonic() > deadline:
            perf.kill()
            sys.exit("the sockets were not mapped within 120 s")
        time.sleep(0.05)
perf.send_signal(signal.SIGINT)
perf.wait()
PYEOF
  client=$!
  until [ -e "$dir/ready" ]; do
    kill -0 "$client" 2>/dev/null || die "the client failed ($t)"
    sleep 0.1
  done
  # shellcheck disable=SC2086 # one argument per PID
  sockets "$port" $traced >"$dir/sockets.txt"
  touch "$dir/mapped"
  wait "$client" || die "the client failed ($t)"
  stop_all
  if [ -n "${PROFILE:-}" ]; then
    log "$t: profile in $dir/profile.data"
    continue
  fi
  perf script --ns -F pid,tid,time,event,trace -i "$dir/syscalls.data" >"$dir/syscalls.txt" 2>/dev/null
  {
    echo "$t$([ "$t" = nginx ] || echo " ($("$t" --version 2>/dev/null))"), TEXT=$TEXT, $(basename "$TOKENIZER")"
    python3 "$HERE/lib/hop_gaps.py" "$dir/syscalls.txt" "$dir/sockets.txt"
  } | tee -a "$OUT/summary.txt"
done
log "results in $OUT"
