#!/usr/bin/env bash
# router-latency.sh - what a router adds to a request: latency and throughput of kinference's
# precise routing (tokenization, block hashing, index lookup, forwarding) against going straight
# to a replica, measured in the same run as vllm-router 0.1.17 and sglang-router 0.3.2
# (cache_aware), all in front of the same 4 simulated replicas.
#
# Workload (wrk, scripts/router-latency.lua), WORKLOAD=dev (default): 8 shared ~4,000-character
# prefixes + a unique suffix per request, max_tokens=8. WORKLOAD=chat: real conversations, the
# last 1,000 of ../shared's ShareGPT sample (the trace benchmarks read from its start), each
# human turn with its whole history as one chat request (bodies up to 16 kB, 4,461 requests,
# mean 3.6 kB), taken in turn order across conversations as a live service sees them, with a
# unique tag at the end of the last message; the cells are then chat requests throughout. The replicas are `kinference sim` at a speedup of 100,000
# simulated seconds per second, so they answer in a fraction of a millisecond and the router is
# what is measured. Per target, each round runs three cells:
#   c1      /v1/completions (chat: /v1/chat/completions), not streamed, 1 connection
#   c32     the same, 32 connections (2 wrk threads)
#   chat1   /v1/chat/completions, streamed (SSE), 1 connection
# and direct has a fourth, c32all: the same 32 connections spread over all 4 replicas (4 wrk
# threads, one replica each). The routers spread their load the same way, and the simulator
# spends more CPU per request on 4 replicas with 8 requests each than on one with 32, so
# c32all is the baseline that leaves only the router's own cost in the ratio.
# Targets: direct (replica 0 alone: wrk talks to one address, so the 32-connection baseline is
# one replica of the same simulator process), kinference (`kinference serve --policy precise`),
# vllm-router and sglang-router (`--policy cache_aware`, the thresholds of ../shared/spec/peers.md),
# and nginx (Debian's, round-robin over the 4 replicas with upstream keep-alive, no buffering,
# TCP_NODELAY): an HTTP hop with no routing logic at all, the floor any L7 router is judged
# against on the same host.
# Direct is measured again just before each router, and each router's ratios use that baseline.
# Before its cells each target gets a 32-connection warm-up (not recorded), which also fills the
# routers' prefix trees and kinference's index. CPU per request is a process tree's utime+stime
# (/proc/PID/stat) over a cell divided by the requests wrk completed, for the router and for
# the simulator process (all 4 replicas).
#
# Prints a markdown table (per round, then ranges over rounds when ROUNDS > 1) and writes every
# raw output under the results directory, kinference's /metrics before and after each of its
# cells among them (the page after a round's last cell, `kinference.rN.chat1.metrics1.txt`, holds
# all the round counted); from those, a last line gives the router's own request duration at one
# connection (its histogram) beside wrk's. Another line splits each router's CPU per request at
# 32 connections into user and system time (/proc/PID/stat's utime and stime). Every process it
# starts is stopped on exit.
#
# usage: scripts/router-latency.sh [BINARY]
#   BINARY is a built `kinference`; without it, `cargo build --release -p kinference` builds
#   target/release/kinference.
# env: DURATION=10s          wrk duration of each measured cell
#      WARMUP=3s             wrk warm-up per target (32 connections)
#      ROUNDS=1              repeat all targets this many times (each round restarts the routers)
#      TARGETS=direct,kinference,vllm-router,sglang-router,nginx
#                            (also `floor`: crates/proxy/examples/http_floor.rs, a bare tokio +
#                            httparse keep-alive forwarder, round-robin, no routing: what the HTTP
#                            layer alone can cost; FLOOR_BIN=its binary, else cargo builds it;
#                            and `floor-hyper`, the same through hyper and hyper-util's client; `floor-mixed`, hyper's server with the lean client)
#      CONNS=32              connections of the throughput cell
#      PREFIX_CHARS=4000     length of each shared prefix
#      MAX_TOKENS=8
#      WORKLOAD=dev          dev or chat (see above)
#      TOKENIZER=llama3.1    a directory, or the name of one in ../shared/data/tokenizers
#                            (llama3.1, qwen3, deepseek-v3, ...); router and replicas use it
#      RESULTS=target/router-latency                   (a timestamped directory is made in it)
#      PEERS_DIR=~/.cache/kinference/peers             (one venv per peer; installed when missing)
#      KINF_FLAGS=           extra `kinference serve` flags, word-split (e.g.
#                            "--tokenizer-cache-bytes 0")
#      NGINX_WORKERS=        nginx's worker processes (default: one per CPU the router may use,
#                            as kinference's data-plane threads; "--threads N" in KINF_FLAGS
#                            and NGINX_WORKERS=N compare both with N)
#      PERF_RECORD=          when set, `perf record -F 499 --call-graph dwarf` on each router's
#                            processes (nginx's workers and the peers' children included)
#                            during its 32-connection cell (RESULTS/.../TARGET.rN.perf.data; its
#                            CPU per request is then measured with perf attached)
#      PERF_CELL=c32         the cell PERF_RECORD records (c1, c32 or chat1)
#      KINF_NO_EVENTS=       when set, kinference is given the replicas without their KV-event
#                            endpoints (a diagnostic: its index then holds only its own
#                            placements, and the replicas publish to no one)
#      EVENTS_SINK=          when set, every other router's cells run with an idle `kinference
#                            serve` subscribed to the replicas' KV events beside it, so that the
#                            replicas publish to a subscriber behind every router, as a fleet with
#                            KV events enabled does (without a subscriber they send nothing);
#                            the sink's own CPU is counted in no column (it is logged)
#      SINK_CPUS=            a CPU list for the events sink (taskset; default: ROUTER_CPUS, the
#                            routers'): with LOAD_CPUS, the sink on the load's cores leaves the
#                            router's core to the router, so the subscriber's own work is
#                            separated from the replicas' publishing
#      PERF_RECORD_SIM=      when set, the same on the simulator during every router's
#                            32-connection cell (RESULTS/.../TARGET.rN.sim.perf.data): what the
#                            replicas spend behind each router
#      LOAD_CPUS=, ROUTER_CPUS=   CPU lists for taskset (e.g. LOAD_CPUS=0 ROUTER_CPUS=1): the
#                            simulator and wrk run on LOAD_CPUS, each router on ROUTER_CPUS, so
#                            a router does not take CPU from the replicas it fronts, as on a
#                            machine of its own. Set both or neither.
set -euo pipefail

case ${1:-} in
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
esac

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
LUA=$HERE/router-latency.lua
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-3s}
ROUNDS=${ROUNDS:-1}
TARGETS=${TARGETS:-direct,kinference,vllm-router,sglang-router,nginx}
CONNS=${CONNS:-32}
PREFIX_CHARS=${PREFIX_CHARS:-4000}
MAX_TOKENS=${MAX_TOKENS:-8}
WORKLOAD=${WORKLOAD:-dev}
TOKENIZER=${TOKENIZER:-llama3.1}
read -r -a KINF_EXTRA <<<"${KINF_FLAGS:-}"
[ -d "$TOKENIZER" ] || TOKENIZER=$REPO/../shared/data/tokenizers/$TOKENIZER
RESULTS=${RESULTS:-$REPO/target/router-latency}
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/kinference/peers}
LOAD_CPUS=${LOAD_CPUS:-}
ROUTER_CPUS=${ROUTER_CPUS:-}
VLLM_ROUTER_VERSION=0.1.17
SGLANG_ROUTER_VERSION=0.3.2
MODEL=bench # the model lib/bench.sh's router and simulator serve
REPLICAS=4
T0=$(date +%s)
log() { echo "[router-latency +$(( $(date +%s) - T0 ))s] $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
# shellcheck source=lib/nginx.sh
source "$HERE/lib/nginx.sh"
# shellcheck source=lib/bench.sh
source "$HERE/lib/bench.sh"

# --- processes to stop on exit
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do stop_tree "$pid" 5; done
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- tools
need_apt() {
  local cmd=$1 pkg=$2
  command -v "$cmd" >/dev/null && return 0
  log "$cmd is missing; installing the Debian package $pkg"
  local sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo -n)
  "${sudo[@]}" apt-get install -y -q "$pkg" >/dev/null 2>&1 ||
    { "${sudo[@]}" apt-get update -q >/dev/null 2>&1 && "${sudo[@]}" apt-get install -y -q "$pkg" >/dev/null 2>&1; } ||
    die "could not install $pkg (apt-get install $pkg as root, then rerun)"
}
need_apt wrk wrk
need_apt curl curl
command -v python3 >/dev/null || die "python3 is needed (free ports, the results table, the peers)"
[ -f "$TOKENIZER/tokenizer.json" ] || die "no tokenizer.json in $TOKENIZER"
TOKENIZER=$(cd "$TOKENIZER" && pwd)
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"
case $WORKLOAD in
  dev) MODE=completions ;;
  chat)
    MODE=chat
    python3 "$HERE/lib/chat_bodies.py" --check || die "WORKLOAD=chat needs the ShareGPT sample"
    ;;
  *) die "WORKLOAD must be dev or chat" ;;
esac
PIN_LOAD=()
PIN_ROUTER=()
if [ -n "$LOAD_CPUS$ROUTER_CPUS" ]; then
  [ -n "$LOAD_CPUS" ] && [ -n "$ROUTER_CPUS" ] || die "set both LOAD_CPUS and ROUTER_CPUS, or neither"
  need_apt taskset util-linux
  taskset -c "$LOAD_CPUS" true 2>/dev/null || die "LOAD_CPUS=$LOAD_CPUS is not a usable CPU list"
  taskset -c "$ROUTER_CPUS" true 2>/dev/null || die "ROUTER_CPUS=$ROUTER_CPUS is not a usable CPU list"
  PIN_LOAD=(taskset -c "$LOAD_CPUS")
  PIN_ROUTER=(taskset -c "$ROUTER_CPUS")
fi

# --- kinference
BIN=$(kinference_binary "$REPO" release "${1:-}") || die "no kinference binary"
"$BIN" serve --help >/dev/null 2>&1 || die "$BIN has no working 'serve' command"

# --- peers: one venv each, installed with uv when missing or at another version
peer_version() { # VENV DIST
  [ -x "$1/bin/python" ] || return 1
  "$1/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$2" 2>/dev/null
}
ensure_peer() { # NAME DIST VERSION BINARY -> 0 when usable
  local name=$1 dist=$2 want=$3 exe=$4 venv=$PEERS_DIR/$1 have uv
  have=$(peer_version "$venv" "$dist" || true)
  if [ "$have" = "$want" ] && [ -x "$venv/bin/$exe" ]; then return 0; fi
  log "installing $dist==$want into $venv (found: ${have:-nothing})"
  uv=$(command -v uv || true)
  if [ -z "$uv" ]; then
    python3 -m pip install -q --user uv >/dev/null 2>&1 || true
    uv=$(command -v uv || echo "$(python3 -m site --user-base)/bin/uv")
  fi
  [ -x "$uv" ] || { log "skipping $name: uv is not available (pip install uv failed)"; return 1; }
  mkdir -p "$PEERS_DIR"
  # An existing venv at another version is upgraded in place, not recreated.
  { { [ -x "$venv/bin/python" ] || "$uv" venv -q "$venv"; } &&
    VIRTUAL_ENV=$venv "$uv" pip install -q "$dist==$want"; } >"$PEERS_DIR/$name.install.log" 2>&1 ||
    { log "skipping $name: installation failed (see $PEERS_DIR/$name.install.log)"; return 1; }
  have=$(peer_version "$venv" "$dist" || true)
  [ "$have" = "$want" ] && [ -x "$venv/bin/$exe" ] ||
    { log "skipping $name: installed ${have:-nothing}, not $want"; return 1; }
}

IFS=, read -r -a WANTED <<<"$TARGETS"
RUN_TARGETS=()
for t in "${WANTED[@]}"; do
  case $t in
    direct | kinference) RUN_TARGETS+=("$t") ;;
    vllm-router) ensure_peer vllm-router vllm-router "$VLLM_ROUTER_VERSION" vllm-router && RUN_TARGETS+=("$t") ;;
    sglang-router) ensure_peer sglang-router sglang-router "$SGLANG_ROUTER_VERSION" smg && RUN_TARGETS+=("$t") ;;
    nginx)
      # A failed install skips it.
      NGINX=$(nginx_bin 2>/dev/null || true)
      if [ -z "$NGINX" ] && (need_apt nginx nginx); then NGINX=$(nginx_bin 2>/dev/null || true); fi
      if [ -n "$NGINX" ]; then RUN_TARGETS+=("$t"); else log "skipping nginx: not installed"; fi
      ;;
    floor | floor-hyper | floor-mixed)
      if [ -z "${FLOOR_BIN:-}" ]; then
        (cd "$REPO" && cargo build -q --release -p kinference-proxy --example http_floor) || die "building http_floor failed"
        FLOOR_BIN=${CARGO_TARGET_DIR:-$REPO/target}/release/examples/http_floor
      fi
      RUN_TARGETS+=("$t")
      ;;
    *) die "unknown target '$t' (direct, kinference, vllm-router, sglang-router, nginx, floor, floor-hyper, floor-mixed)" ;;
  esac
done

# --- results directory and machine notes
OUT=$RESULTS/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
CELLS=$OUT/cells.jsonl
: >"$CELLS"
{
  echo "date: $(date -Is)"
  echo "command: $0 $*"
  echo "env: WORKLOAD=$WORKLOAD DURATION=$DURATION WARMUP=$WARMUP ROUNDS=$ROUNDS CONNS=$CONNS PREFIX_CHARS=$PREFIX_CHARS MAX_TOKENS=$MAX_TOKENS"
  echo "cpus: simulator and wrk ${LOAD_CPUS:-any}, routers ${ROUTER_CPUS:-any}"
  echo "targets: ${RUN_TARGETS[*]}"
  echo "tokenizer: $TOKENIZER"
  echo "binary: $BIN ($("$BIN" --version 2>/dev/null || true))"
  echo "git: $(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null || true) $(cd "$REPO" && git status --porcelain 2>/dev/null | grep -q . && echo '(working tree has changes)')"
  echo "nproc: $(nproc); cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "wrk: $(wrk -v 2>&1 | head -1)"
  echo "vllm-router: $(peer_version "$PEERS_DIR/vllm-router" vllm-router || echo none)"
  echo "sglang-router: $(peer_version "$PEERS_DIR/sglang-router" sglang-router || echo none)"
  echo "nginx: $({ [ -n "${NGINX:-}" ] && "$NGINX" -v 2>&1; } || echo none)"
  echo "loadavg at start: $(cat /proc/loadavg)"
} >"$OUT/machine.txt"
log "results in $OUT"

# The chat workload's requests (see the header): HEAD<TAB>TAIL lines for router-latency.lua.
CHAT_BODIES=
if [ "$WORKLOAD" = chat ]; then
  CHAT_BODIES=$OUT/chat-bodies.tsv
  python3 "$HERE/lib/chat_bodies.py" "$CHAT_BODIES" || die "could not write the chat requests"
fi

# "TOTAL SYS": utime+stime and stime alone (the kernel's share: socket work, wake-ups,
# scheduling), in clock ticks, of a process and its descendants, read in one pass
proc_ticks() {
  local pid total=0 sys=0 stat f
  # shellcheck disable=SC2046 # descendants prints a list of pids
  for pid in "$1" $(descendants "$1"); do
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
    stat=${stat##*) }
    read -r -a f <<<"$stat"
    total=$(( total + f[11] + f[12] )) sys=$(( sys + f[12] ))
  done
  echo "$total $sys"
}
CLK_TCK=$(getconf CLK_TCK)

# a process and its descendants, comma-separated (perf's -p list)
# shellcheck disable=SC2046 # descendants prints a list of pids
tree_pids() { echo "$1" $(descendants "$1") | tr ' ' ,; }

wait_for() { # WHAT PID SECONDS COMMAND... : polls COMMAND until it succeeds
  local what=$1 pid=$2 secs=$3 i
  shift 3
  for i in $(seq 1 $(( secs * 10 ))); do
    "$@" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  log "$what: not ready after ${secs}s"
  return 1
}

# one ~PREFIX_CHARS request, as the smoke check of a target
PROMPT=$(python3 -c 'import sys; print(("shared prefix words " * (int(sys.argv[1]) // 20))[:int(sys.argv[1])])' "$PREFIX_CHARS")
completion_ok() { # BASE_URL
  curl -sf -m 10 "$1/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"prompt\":\"$PROMPT smoke\",\"max_tokens\":$MAX_TOKENS}" | grep -q '"choices"'
}
chat_stream_ok() { # BASE_URL
  curl -sfN -m 10 "$1/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"$PROMPT smoke\"}],\"max_tokens\":$MAX_TOKENS,\"stream\":true}" |
    grep -q '^data: \[DONE\]'
}

# --- the replicas: one simulator process, 4 replicas on free loopback ports
log "starting $REPLICAS simulated replicas (tokenizer $TOKENIZER)"
"${PIN_LOAD[@]}" "$BIN" sim --host 127.0.0.1 --port 0 --replicas "$REPLICAS" --model "$MODEL" --tokenizer "$TOKENIZER" \
  --block-size 16 --speedup 100000 \
  --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://127.0.0.1:0' \
  >"$OUT/sim.out" 2>"$OUT/sim.err" &
SIM_PID=$!
PIDS+=("$SIM_PID")
for _ in $(seq 1 600); do
  [ "$(grep -c '^replica=' "$OUT/sim.out" 2>/dev/null)" = "$REPLICAS" ] && break
  kill -0 "$SIM_PID" 2>/dev/null || { tail -20 "$OUT/sim.err" >&2; die "the simulator exited"; }
  sleep 0.1
done
[ "$(grep -c '^replica=' "$OUT/sim.out")" = "$REPLICAS" ] || die "the simulator did not start $REPLICAS replicas in 60 s"
URLS=()
KINF_REPLICAS=()
while read -r line; do
  url=$(field "$line" url)
  ev=$(dial "$(field "$line" events)")
  rp=$(field "$line" replay)
  URLS+=("$url")
  if [ -n "${KINF_NO_EVENTS:-}" ]; then
    KINF_REPLICAS+=(--replica "$url")
  else
    KINF_REPLICAS+=(--replica "$url,events=$ev,replay=$rp")
  fi
done < <(grep '^replica=' "$OUT/sim.out")
for u in "${URLS[@]}"; do
  completion_ok "$u" || die "replica $u does not answer /v1/completions"
done
chat_stream_ok "${URLS[0]}" || die "replica ${URLS[0]} does not stream /v1/chat/completions"
log "replicas: ${URLS[*]}"

# --- targets
ROUTER_PID=""
# The kinference target's admin address while it runs (empty for every other target).
ADMIN_URL=""
# `kinference serve` in front of the replicas as every router benchmark starts it (lib/bench.sh),
# pinned like the other routers, in the background ($! is its PID), its output in PREFIX.out and
# PREFIX.err.
SIM_REPLICAS=("${KINF_REPLICAS[@]}")
BENCH_WRAP=("${PIN_ROUTER[@]}")
kinference_serve() { # PREFIX
  bench_serve "$BIN" "$1" "${KINF_EXTRA[@]}"
}

start_target() { # TARGET ROUND -> sets TARGET_URL, ROUTER_PID
  local t=$1 round=$2 port admin prom
  ROUTER_PID=""
  ADMIN_URL=""
  case $t in
    direct)
      TARGET_URL=${URLS[0]}
      return 0
      ;;
    kinference)
      kinference_serve "$OUT/$t.r$round"
      ;;
    vllm-router)
      read -r port prom < <(free_ports 2)
      "${PIN_ROUTER[@]}" "$PEERS_DIR/vllm-router/bin/vllm-router" --host 127.0.0.1 --port "$port" --worker-urls "${URLS[@]}" \
        --policy cache_aware --cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5 \
        --eviction-interval-secs 120 --max-tree-size 33554432 \
        --prometheus-host 127.0.0.1 --prometheus-port "$prom" --log-level warning \
        >"$OUT/$t.r$round.out" 2>"$OUT/$t.r$round.err" &
      ;;
    sglang-router)
      read -r port prom < <(free_ports 2)
      HF_HUB_OFFLINE=1 "${PIN_ROUTER[@]}" "$PEERS_DIR/sglang-router/bin/smg" launch --host 127.0.0.1 --port "$port" --worker-urls "${URLS[@]}" \
        --policy cache_aware --cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5 \
        --eviction-interval-secs 120 --max-tree-size 33554432 \
        --prometheus-host 127.0.0.1 --prometheus-port "$prom" --log-level warn \
        >"$OUT/$t.r$round.out" 2>"$OUT/$t.r$round.err" &
      ;;
    floor | floor-hyper | floor-mixed)
      port=$(free_ports 1)
      local stack=${t#floor-}
      [ "$t" = floor ] && stack=lean
      "${PIN_ROUTER[@]}" "$FLOOR_BIN" --stack "$stack" "127.0.0.1:$port" "${URLS[@]}" >"$OUT/$t.r$round.out" 2>"$OUT/$t.r$round.err" &
      ;;
    nginx)
      port=$(free_ports 1)
      # Its workers on the router's CPUs.
      nginx_conf "$OUT/nginx.r$round" "$port" "${NGINX_WORKERS:-$("${PIN_ROUTER[@]}" nproc)}" "${URLS[@]}"
      "${PIN_ROUTER[@]}" "$NGINX" -p "$OUT/nginx.r$round" -c "$OUT/nginx.r$round/nginx.conf" \
        -e "$OUT/nginx.r$round/error.log" >"$OUT/$t.r$round.out" 2>"$OUT/$t.r$round.err" &
      ;;
  esac
  ROUTER_PID=$!
  PIDS+=("$ROUTER_PID")
  if [ "$t" = kinference ]; then
    read -r port admin < <(router_addrs "$OUT/$t.r$round.err" "$ROUTER_PID" 120) || return 1
    port=${port##*:} admin=${admin##*:}
  fi
  TARGET_URL=http://127.0.0.1:$port
  if ! wait_for "$t" "$ROUTER_PID" 120 completion_ok "$TARGET_URL"; then
    tail -20 "$OUT/$t.r$round.err" >&2
    return 1
  fi
  if [ "$t" = kinference ]; then
    ADMIN_URL=http://127.0.0.1:$admin
    echo "admin=$ADMIN_URL" >>"$OUT/$t.r$round.out"
  fi
}

cell_json() { # TARGET ROUND PAIR CELL CONNS RAWFILE ROUTER_TICKS SIM_TICKS LOAD ROUTER_SYS_TICKS
  local res
  res=$(sed -n 's/^RESULT //p' "$6")
  [ -n "$res" ] || die "wrk printed no RESULT line in $6"
  printf '{"target":"%s","round":%d,"pair":"%s","cell":"%s","conns":%d,"router_ticks":%d,"router_sys_ticks":%d,"sim_ticks":%d,"clk_tck":%d,"load":%s,"wrk":%s}\n' \
    "$1" "$2" "$3" "$4" "$5" "$7" "${10}" "$8" "$CLK_TCK" "$9" "$res"
}

run_wrk() { # URL CONNS DURATION MODE TAG RAWFILE [ADDRS]
  local threads=1
  [ "$2" -ge 2 ] && threads=2
  [ -n "${7:-}" ] && threads=$REPLICAS
  WRK_ADDRS=${7:-} CHAT_BODIES=$CHAT_BODIES "${PIN_LOAD[@]}" wrk -t"$threads" -c"$2" -d"$3" --timeout 10s --latency -s "$LUA" "$1" -- \
    "$4" "$MODEL" "$MAX_TOKENS" "$5" "$PREFIX_CHARS" >"$6" 2>&1 ||
    { cat "$6" >&2; die "wrk failed against $1"; }
}

run_cell() { # TARGET ROUND PAIR FILE_PREFIX CELL CONNS MODE [ADDRS]
  local t=$1 round=$2 pair=$3 prefix=$4 cell=$5 conns=$6 mode=$7 addrs=${8:-} raw r0 s0 r1 s1 k0 k1 load
  raw=$prefix.$cell.txt
  load=$(cut -d' ' -f1 /proc/loadavg)
  r0=0 r1=0 k0=0 k1=0
  [ -n "$ROUTER_PID" ] && read -r r0 k0 < <(proc_ticks "$ROUTER_PID")
  read -r s0 _ < <(proc_ticks "$SIM_PID")
  local perf_pid=""
  if [ -n "${PERF_RECORD:-}" ] && [ -n "$ROUTER_PID" ] && [ "$cell" = "${PERF_CELL:-c32}" ]; then
    perf record -q -F 499 --call-graph dwarf -p "$(tree_pids "$ROUTER_PID")" -o "$prefix.perf.data" >/dev/null 2>&1 &
    perf_pid=$!
  fi
  local sim_perf_pid=""
  if [ -n "${PERF_RECORD_SIM:-}" ] && [ "$t" != direct ] && [ "$cell" = c32 ]; then
    perf record -q -F 499 --call-graph dwarf -p "$SIM_PID" -o "$prefix.sim.perf.data" >/dev/null 2>&1 &
    sim_perf_pid=$!
  fi
  # kinference's own view of the cell: its /metrics before and after (the summary reads its
  # request-duration histogram from them, to tell the router's time from the rest of wrk's).
  [ -n "$ADMIN_URL" ] && { curl -sf "$ADMIN_URL/metrics" >"$prefix.$cell.metrics0.txt" 2>/dev/null || true; }
  run_wrk "$TARGET_URL" "$conns" "$DURATION" "$mode" "${t//-/}r${round}${pair//-/}${cell}x$$" "$raw" "$addrs"
  [ -n "$ADMIN_URL" ] && { curl -sf "$ADMIN_URL/metrics" >"$prefix.$cell.metrics1.txt" 2>/dev/null || true; }
  [ -n "$ROUTER_PID" ] && read -r r1 k1 < <(proc_ticks "$ROUTER_PID")
  read -r s1 _ < <(proc_ticks "$SIM_PID")
  if [ -n "$perf_pid" ]; then kill -INT "$perf_pid" 2>/dev/null; wait "$perf_pid" 2>/dev/null || true; fi
  if [ -n "$sim_perf_pid" ]; then kill -INT "$sim_perf_pid" 2>/dev/null; wait "$sim_perf_pid" 2>/dev/null || true; fi
  cell_json "$t" "$round" "$pair" "$cell" "$conns" "$raw" $(( r1 - r0 )) $(( s1 - s0 )) "$load" $(( k1 - k0 )) >>"$CELLS"
  log "$t round $round $cell: $(grep -E '^Requests/sec' "$raw" | tr -s ' ') p50 $(awk '$1 == "50%" {print $2; exit}' "$raw") p99 $(awk '$1 == "99%" {print $2; exit}' "$raw")$(grep -E 'Non-2xx|Socket errors' "$raw" | tr '\n' ' ' | sed 's/^/ /')"
}

# One target's warm-up and three cells. PAIR names the router a direct measurement is the
# baseline of: direct is measured again just before each router, so that every ratio compares
# cells a minute apart on this shared machine, not the two ends of a round.
measure() { # TARGET ROUND PAIR -> 1 when the target could not be measured
  local t=$1 round=$2 pair=$3 prefix
  prefix=$OUT/$t.r$round
  [ "$t" = direct ] && prefix=$prefix.before-$pair
  if [ "$t" = direct ]; then log "round $round: direct (baseline of $pair)"; else log "round $round: $t"; fi
  if ! start_target "$t" "$round"; then
    [ -n "$ROUTER_PID" ] && stop_tree "$ROUTER_PID" 5
    ROUTER_PID=""
    return 1
  fi
  local sink_pid="" sink0=0
  if [ -n "${EVENTS_SINK:-}" ] && [ "$t" != direct ] && [ "$t" != kinference ]; then
    kinference_serve "$prefix.sink"
    sink_pid=$!
    PIDS+=("$sink_pid")
    router_addrs "$prefix.sink.err" "$sink_pid" 120 >/dev/null || die "the events sink did not start (see $prefix.sink.err)"
    # Every thread of it, once its runtimes have started them.
    [ -n "${SINK_CPUS:-}" ] && { taskset -a -p -c "$SINK_CPUS" "$sink_pid" >/dev/null || die "SINK_CPUS=$SINK_CPUS is not a usable CPU list"; }
    read -r sink0 _ < <(proc_ticks "$sink_pid")
  fi
  chat_stream_ok "$TARGET_URL" || log "warning: $t did not stream a chat completion to [DONE] in the smoke check"
  run_wrk "$TARGET_URL" "$CONNS" "$WARMUP" "$MODE" "${t//-/}r${round}${pair//-/}warm$$" "$prefix.warmup.txt"
  run_cell "$t" "$round" "$pair" "$prefix" c1 1 "$MODE"
  run_cell "$t" "$round" "$pair" "$prefix" c32 "$CONNS" "$MODE"
  run_cell "$t" "$round" "$pair" "$prefix" chat1 1 chat-stream
  if [ "$t" = direct ]; then
    run_cell "$t" "$round" "$pair" "$prefix" c32all "$CONNS" "$MODE" "$(printf '%s\n' "${URLS[@]#http://}" | paste -sd,)"
  fi
  if [ "$t" = direct ] && [ "$(awk '$1 == "50%" {print ($2 ~ /ms$/ && $2 + 0 > 20) ? 1 : 0; exit}' "$prefix.chat1.txt")" = 1 ]; then
    log "warning: streamed chat straight to a replica takes over 20 ms at p50: the backend stalls (no TCP_NODELAY?), so the streaming column measures the backend, not the routers"
  fi
  if [ -n "$sink_pid" ]; then
    local sink1
    read -r sink1 _ < <(proc_ticks "$sink_pid")
    log "$t round $round: the events sink used $(( sink1 - sink0 )) ticks over the target's cells"
    stop_tree "$sink_pid" 5
  fi
  [ -n "$ROUTER_PID" ] && stop_tree "$ROUTER_PID" 5
  ROUTER_PID=""
  return 0
}

ROUTERS=()
WITH_DIRECT=0
for t in "${RUN_TARGETS[@]}"; do
  if [ "$t" = direct ]; then WITH_DIRECT=1; else ROUTERS+=("$t"); fi
done
for round in $(seq 1 "$ROUNDS"); do
  if [ "${#ROUTERS[@]}" = 0 ]; then
    measure direct "$round" direct || die "direct measurement failed"
  fi
  for t in "${ROUTERS[@]}"; do
    if [ "$WITH_DIRECT" = 1 ]; then
      measure direct "$round" "$t" || die "direct measurement failed"
    fi
    if ! measure "$t" "$round" "$t"; then
      [ "$t" = kinference ] && die "kinference serve did not start or does not answer (see $OUT/$t.r$round.err)"
      log "skipping $t in round $round: it did not start or does not answer (see $OUT/$t.r$round.err)"
    fi
  done
done
echo "loadavg at end: $(cat /proc/loadavg)" >>"$OUT/machine.txt"
for u in "${URLS[@]}"; do curl -sf "$u/metrics" >>"$OUT/sim.metrics.txt" 2>/dev/null || true; done

# --- the table
PYTHONPATH="$HERE/lib${PYTHONPATH:+:$PYTHONPATH}" python3 - "$CELLS" "$CONNS" <<'PYEOF' | tee "$OUT/table.md"
import glob, json, os, sys
from collections import defaultdict
import prom
from cells import cpu_ms, errors, rps

cells_path, conns = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(cells_path) if l.strip()]
by = {(r["target"], r["round"], r["pair"], r["cell"]): r for r in rows}
targets = list(dict.fromkeys(r["target"] for r in rows))
rounds = sorted({r["round"] for r in rows})

def metrics(t, rnd, pair):
    """One target's numbers in one round; ratios against the direct cells measured just before it."""
    g = lambda c: by.get((t, rnd, pair, c))
    c1, c32, ch = g("c1"), g("c32"), g("chat1")
    d1, d32 = by.get(("direct", rnd, pair, "c1")), by.get(("direct", rnd, pair, "c32"))
    d32all = by.get(("direct", rnd, pair, "c32all"))
    m = {}
    if c1:
        m["c1_p50"] = c1["wrk"]["p50_us"] / 1000
        m["c1_p99"] = c1["wrk"]["p99_us"] / 1000
        m["c1_rps"] = rps(c1)
        if d1 and t != "direct":
            m["added"] = (c1["wrk"]["p50_us"] - d1["wrk"]["p50_us"]) / 1000
    if c32:
        m["c32_rps"] = rps(c32)
        m["c32_p50"] = c32["wrk"]["p50_us"] / 1000
        m["c32_p99"] = c32["wrk"]["p99_us"] / 1000
        if d32 and t != "direct":
            m["vs_direct"] = 100.0 * rps(c32) / rps(d32)
        if d32all and t != "direct":
            m["vs_all"] = 100.0 * rps(c32) / rps(d32all)
        if t != "direct":
            m["cpu"] = cpu_ms(c32)
        m["sim_cpu"] = cpu_ms(c32, "sim_ticks")
    if t == "direct":
        a = g("c32all")
        if a:
            m["c32_rps_all"] = rps(a)
            m["sim_cpu_all"] = cpu_ms(a, "sim_ticks")
    if ch:
        m["ch_p50"] = ch["wrk"]["p50_us"] / 1000
        m["ch_p99"] = ch["wrk"]["p99_us"] / 1000
        dch = by.get(("direct", rnd, pair, "chat1"))
        if dch and t != "direct":
            m["ch_added"] = (ch["wrk"]["p50_us"] - dch["wrk"]["p50_us"]) / 1000
    # Issue 17's yardstick: against nginx, the plain HTTP hop, in the same round.
    n32 = by.get(("nginx", rnd, "nginx", "c32"))
    if c32 and n32 and t not in ("direct", "nginx"):
        if cpu_ms(n32):
            m["cpu_x_nginx"] = cpu_ms(c32) / cpu_ms(n32)
        m["rps_vs_nginx"] = 100.0 * rps(c32) / rps(n32)
    m["errors"] = sum(errors(x) for x in (c1, c32, ch) if x)
    return m

COLS = [
    ("c1_p50", "completions 1 conn p50", "ms"), ("c1_p99", "p99", "ms"),
    ("added", "added p50 vs direct", "ms+"), ("c1_rps", "req/s", "int"),
    ("c32_rps", f"{conns} conns req/s", "int"), ("vs_direct", "% of direct", "pct"),
    ("c32_p50", "p50", "ms"), ("c32_p99", "p99", "ms"),
    ("c32_rps_all", f"direct, {conns} conns over all replicas, req/s", "int"),
    ("vs_all", "% of direct over all replicas", "pct"),
    ("ch_p50", "streaming chat 1 conn p50", "ms"), ("ch_p99", "p99", "ms"),
    ("ch_added", "added p50 vs direct", "ms+"),
    ("cpu", f"router CPU per request ({conns} conns)", "ms"),
    ("cpu_x_nginx", "router CPU per request / nginx's", "x"),
    ("rps_vs_nginx", f"{conns} conns req/s, % of nginx", "pct"),
    ("sim_cpu", "replicas' CPU per request", "ms"),
    ("sim_cpu_all", "the same, direct over all replicas", "ms"),
]

def fmt(v, kind):
    if kind == "int":
        return f"{v:,.0f}"
    if kind == "pct":
        return f"{v:.0f} %"
    if kind == "x":
        return f"{v:.2f}×"
    if kind == "ms+":
        return f"{v:+.2f} ms"
    return f"{v:.2f} ms" if v < 10 else f"{v:.1f} ms"

def cell(vals, kind):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    lo, hi = min(vals), max(vals)
    a, b = fmt(lo, kind), fmt(hi, kind)
    if a == b:
        return a
    unit = {"ms": " ms", "ms+": " ms", "pct": " %"}.get(kind, "")
    if unit and a.endswith(unit) and b.endswith(unit):
        a = a[: -len(unit)]
    if kind == "ms+" and b.startswith("+"):
        b = b[1:]
    return f"{a}–{b}"

def pairs(t, rnd):
    return sorted({r["pair"] for r in rows if r["target"] == t and r["round"] == rnd})

def table(title, rnds):
    print(f"\n{title}\n")
    print("| target | " + " | ".join(c[1] for c in COLS) + " |")
    print("|---|" + "---:|" * len(COLS))
    for t in targets:
        # direct: every baseline measurement; a router: its own cells
        ms = [metrics(t, r, p) for r in rnds for p in pairs(t, r)]
        if not any(len(m) > 1 for m in ms):
            continue
        line = [cell([m.get(k) for m in ms], kind) for k, _, kind in COLS]
        errs = sum(m["errors"] for m in ms)
        name = t + (f" ({errs} failed requests)" if errs else "")
        print(f"| {name} | " + " | ".join(line) + " |")

for r in rounds:
    table(f"Round {r}:", [r])
if len(rounds) > 1:
    table(f"Ranges over {len(rounds)} rounds:", rounds)
loads = [r["load"] for r in rows]
print(f"\n1-minute load average during the cells: {min(loads):.2f}–{max(loads):.2f}")
# Where each router's CPU at 32 connections went: its own code (user) or the kernel's socket
# work, wake-ups and scheduling on its behalf (system). Older cells.jsonl lack the split.
split = []
for r in rows:
    if r["cell"] == "c32" and r["target"] != "direct" and "router_sys_ticks" in r and r["wrk"]["requests"]:
        total, kern = cpu_ms(r), cpu_ms(r, "router_sys_ticks")
        split.append(f"{r['target']} r{r['round']} {1000 * (total - kern):.1f} + {1000 * kern:.1f}")
if split:
    print("router CPU per request at 32 connections, user + system, µs: " + "; ".join(split))
def samples(path, name, label):
    """One metric's samples in a /metrics file, summed by the value of `label` over the other
    labels; None when the file cannot be read."""
    try:
        return prom.by_label(prom.page(path), name, label)
    except OSError:
        return None

decisions = defaultdict(float)
# The page after a round's last cell: everything the router counted in that round.
for path in sorted(glob.glob(os.path.join(os.path.dirname(cells_path), "kinference.r*.chat1.metrics1.txt"))):
    for reason, n in (samples(path, "kinference_decisions_total", "reason") or {}).items():
        decisions[reason] += n
if decisions:
    total = sum(decisions.values())
    parts = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(decisions.items(), key=lambda kv: -kv[1]))
    print(f"kinference routing decisions (all rounds, warm-up included): {total:,.0f}: {parts}")
def histogram(path, name):
    """A histogram's cumulative counts by upper bound, summed over its label sets."""
    buckets = samples(path, name + "_bucket", "le")
    if buckets is None:
        return None
    return {float("inf") if le == "+Inf" else float(le): n for le, n in buckets.items()}

def bound(hist, q):
    """The smallest bucket bound at or below which a share q of the observations lie."""
    total = hist[float("inf")]
    for le in sorted(hist):
        if hist[le] >= q * total:
            return le
    return float("inf")

# The router's own time per request (kinference_request_duration_seconds: from the request's
# dispatch, its head already read, to the end of the response body), the cell's requests
# only, against what wrk measured: the part of wrk's tail that lies outside the router's request
# handling (the reading of the head, the write of the response, the machine's scheduling).
own = []
for r in rounds:
    for cell in ("c1", "chat1"):
        base = os.path.join(os.path.dirname(cells_path), f"kinference.r{r}.{cell}.metrics")
        h0 = histogram(base + "0.txt", "kinference_request_duration_seconds")
        h1 = histogram(base + "1.txt", "kinference_request_duration_seconds")
        c = by.get(("kinference", r, "kinference", cell))
        if not (h0 is not None and h1 and c):
            continue
        d = {le: h1[le] - h0.get(le, 0.0) for le in h1}
        if d[float("inf")] <= 0:
            continue
        ms = lambda le: "?" if le == float("inf") else f"{le * 1000:g} ms"
        own.append(f"round {r} {cell}: p50 ≤ {ms(bound(d, 0.5))}, p99 ≤ {ms(bound(d, 0.99))} "
                   f"(wrk: p50 {c['wrk']['p50_us'] / 1000:.2f} ms, p99 {c['wrk']['p99_us'] / 1000:.2f} ms)")
if own:
    print("kinference's own request duration at 1 connection (its histogram's bucket bounds): " + "; ".join(own))

# How much prompt text the router tokenized per request in each round's 32-connection cell, and
# how much its tokenizer's prefix cache spared it (kinference_tokenizer_cache_*): what the
# workload asks of the exact routing, next to its CPU per request.
tok = []
for r in rounds:
    base = os.path.join(os.path.dirname(cells_path), f"kinference.r{r}.c32.metrics")
    c = by.get(("kinference", r, "kinference", "c32"))
    read = lambda name, label: [samples(base + f"{i}.txt", name, label) for i in (0, 1)]
    b0, b1 = read("kinference_tokenizer_cache_text_bytes_total", "kind")
    l0, l1 = read("kinference_tokenizer_cache_lookups_total", "outcome")
    if not (b0 is not None and b1 and l0 is not None and l1 and c and c["wrk"]["requests"]):
        continue
    n = c["wrk"]["requests"]
    per = lambda a, b, k: (b.get(k, 0.0) - a.get(k, 0.0)) / n
    hits, misses = per(l0, l1, "hit"), per(l0, l1, "miss")
    reused = per(b0, b1, "reused")
    encoded = per(b0, b1, "encoded_on_hit") + per(b0, b1, "encoded_on_miss")
    tok.append(f"round {r}: {reused:,.0f} bytes reused, {encoded:,.0f} encoded "
               f"({hits:.2f} hits, {misses:.2f} misses per request)")
if tok:
    print("kinference's prompt text per request at 32 connections (its tokenizer cache): " + "; ".join(tok))
PYEOF
log "raw outputs: $OUT"
