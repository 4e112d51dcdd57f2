# proc.sh - process helpers sourced by the scripts that start processes (kinference, vLLM,
# peers, nginx). Every stop is by process id, never by name.

# stop PID [SECS]: SIGTERM (kinference drains on it), then SIGKILL if it has not exited within
# SECS seconds (default 10). Returns 0 whatever happened, so cleanup traps can call it on every
# path.
stop() {
  local pid=$1 secs=${2:-10} i
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null || return 0
  for i in $(seq 1 $(( secs * 10 ))); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  return 0
}

# descendants PID: the ids of PID's children, their children, and so on.
descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}

# stop_tree PID [SECS]: stop PID as `stop` does, then SIGKILL every process it had spawned
# (listed before the stop) that is still there: a vLLM API server's engine core, a router's
# workers, an nginx master's workers can outlive a parent that dies abruptly. Returns 0.
stop_tree() {
  local pid=$1 secs=${2:-10} kids
  [ -n "$pid" ] || return 0
  kids=$(descendants "$pid")
  stop "$pid" "$secs"
  # shellcheck disable=SC2086 # kids is a list of pids
  [ -z "$kids" ] || kill -KILL $kids 2>/dev/null || true
  return 0
}

# PIDS and stop_all: the processes a script started (it appends their ids to PIDS), each
# stopped with what it spawned, in one call (from the script's exit trap, or between runs).
# A list the script made before sourcing this file is kept.
declare -p PIDS >/dev/null 2>&1 || PIDS=()
stop_all() {
  local p
  for p in "${PIDS[@]}"; do stop_tree "$p" 5; done
  PIDS=()
}

# kinference_binary REPO PROFILE [GIVEN]: prints the `kinference` binary to run: GIVEN when
# given (it must be executable), else the one `cargo build -p kinference` makes in PROFILE
# (debug or release), under CARGO_TARGET_DIR when that is set. Fails, saying why, otherwise.
kinference_binary() {
  local repo=$1 profile=$2 bin=${3:-} flags=()
  if [ -z "$bin" ]; then
    [ "$profile" = release ] && flags=(--release)
    (cd "$repo" && cargo build -q "${flags[@]}" -p kinference) >&2 ||
      { echo "cargo build ${flags[*]} -p kinference failed" >&2; return 1; }
    bin=${CARGO_TARGET_DIR:-$repo/target}/$profile/kinference
  fi
  [ -x "$bin" ] || { echo "$bin is not an executable" >&2; return 1; }
  echo "$bin"
}
