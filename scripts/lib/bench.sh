# bench.sh - the fleet scripts/router-syscalls.sh and scripts/router-allocations.sh count the
# router's per-request work against: 4 simulated replicas with KV events on (one `kinference
# sim` process, --speedup 100000) and `kinference serve --policy precise` in front, both on
# port 0, and the run both make against it (and the replicas alone, for scripts/router-paired.sh
# and scripts/router-instructions.sh). `bench_serve` is how every router benchmark starts the
# router, scripts/router-latency.sh's too. Needs lib/proc.sh and lib/net.sh sourced first.

# bench_setup NAME BINARY: the settings both scripts take (BIN made absolute; TOKENIZER,
# WARMUP, DURATION, WORKLOAD, and OUT, a fresh directory under RESULTS or target/NAME) and a
# check that perf, wrk and curl are there. WORKLOAD=dev (default) is router-latency.sh's
# developers' workload, WORKLOAD=chat its real conversations (their bodies written to
# OUT/chat-bodies.tsv by lib/chat_bodies.py, as router-latency.sh writes them). Needs REPO.
bench_setup() {
  local name=$1 tool
  BIN=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
  TOKENIZER=${TOKENIZER:-$REPO/../shared/data/tokenizers/llama3.1}
  WARMUP=${WARMUP:-3s}
  DURATION=${DURATION:-4s}
  WORKLOAD=${WORKLOAD:-dev}
  OUT=${RESULTS:-$REPO/target/$name}/$(date -u +%Y%m%d-%H%M%S)
  mkdir -p "$OUT"
  for tool in perf wrk curl; do
    command -v "$tool" >/dev/null || { echo "$name.sh: needs $tool" >&2; exit 1; }
  done
  case $WORKLOAD in
    dev) BENCH_MODE=completions CHAT_BODIES= ;;
    chat)
      BENCH_MODE=chat CHAT_BODIES=$OUT/chat-bodies.tsv
      python3 "$REPO/scripts/lib/chat_bodies.py" "$CHAT_BODIES" ||
        { echo "$name.sh: could not write the chat requests" >&2; exit 1; }
      ;;
    *) echo "$name.sh: WORKLOAD must be dev or chat" >&2; exit 1 ;;
  esac
}

# start_sim BIN TOKENIZER OUT: the 4 simulated replicas (one `kinference sim` process on port
# 0, --speedup 100000, KV events and replay on; its output in OUT/sim.out and OUT/sim.err),
# waited for. Sets SIM_PID as soon as the process is started (for the caller's cleanup),
# SIM_URLS (the replicas' base URLs) and SIM_REPLICAS (their `--replica URL,events=..,replay=..`
# arguments for `kinference serve`).
start_sim() {
  local bin=$1 tokenizer=$2 out=$3 line
  "$bin" sim --host 127.0.0.1 --port 0 --replicas 4 --model bench --tokenizer "$tokenizer" \
    --block-size 16 --speedup 100000 --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://127.0.0.1:0' \
    >"$out/sim.out" 2>"$out/sim.err" &
  SIM_PID=$!
  wait_sim_replicas "$out/sim.out" "$SIM_PID" 4 || { tail -20 "$out/sim.err" >&2; return 1; }
  SIM_URLS=()
  SIM_REPLICAS=()
  while read -r line; do
    SIM_URLS+=("$(field "$line" url)")
    SIM_REPLICAS+=(--replica "$(field "$line" url),events=$(dial "$(field "$line" events)"),replay=$(field "$line" replay)")
  done < <(grep '^replica=' "$out/sim.out")
}

# bench_serve BIN PREFIX [FLAGS...]: `kinference serve` as every router benchmark starts it
# (router-latency.sh, router-paired.sh, router-instructions.sh and the fleet below), so that
# their figures are of the same router: model `bench`, TOKENIZER, blocks of 16 tokens, the
# precise policy, in front of SIM_REPLICAS, then FLAGS. In the background ($! is its PID), its
# output in PREFIX.out and PREFIX.err. BENCH_WRAP (an array) goes before BIN: a CPU pinning,
# valgrind.
BENCH_WRAP=()
bench_serve() {
  local bin=$1 prefix=$2
  shift 2
  NO_COLOR=1 "${BENCH_WRAP[@]}" "$bin" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --model bench \
    --tokenizer "$TOKENIZER" --block-size 16 --policy precise "${SIM_REPLICAS[@]}" "$@" \
    >"$prefix.out" 2>"$prefix.err" &
}

# start_bench_fleet BIN TOKENIZER OUT: starts both (their output under OUT) and waits until
# the router is ready (every replica scorable, every event stream subscribed). Sets SIM_PID and
# ROUTER_PID, each as soon as its process is started (for the caller's cleanup trap), and URL,
# the router's data address.
start_bench_fleet() {
  local bin=$1 TOKENIZER=$2 out=$3 data admin
  start_sim "$bin" "$TOKENIZER" "$out" || return 1
  bench_serve "$bin" "$out/router"
  ROUTER_PID=$!
  read -r data admin < <(router_addrs "$out/router.err" "$ROUTER_PID" 60) || return 1
  wait_router_ready "http://$admin" "$ROUTER_PID" 4 60 || return 1
  URL=http://$data
}

# bench_count TAG PERF_ARGS...: wrk at 32 connections with the WORKLOAD for WARMUP, then for
# DURATION with `perf PERF_ARGS -p ROUTER_PID` attached to the router (a `stat` or a
# `record`, writing where PERF_ARGS says; wrk's report in OUT/wrk.txt). Sets REQUESTS, those
# wrk completed while perf was attached.
bench_count() {
  local tag=$1 lua=$HERE/router-latency.lua perf_pid
  shift
  CHAT_BODIES=$CHAT_BODIES wrk -t2 -c32 -d"$WARMUP" -s "$lua" "$URL" -- \
    "$BENCH_MODE" bench 8 "${tag}w$$" 4000 >/dev/null
  perf "$@" -p "$ROUTER_PID" &
  perf_pid=$!
  sleep 0.3
  CHAT_BODIES=$CHAT_BODIES wrk -t2 -c32 -d"$DURATION" -s "$lua" "$URL" -- \
    "$BENCH_MODE" bench 8 "${tag}m$$" 4000 >"$OUT/wrk.txt"
  kill -INT "$perf_pid"
  wait "$perf_pid" || true
  REQUESTS=$(awk '/requests in/ {print $1}' "$OUT/wrk.txt")
}
