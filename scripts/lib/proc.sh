# proc.sh - process helpers sourced by the scripts that start kinference processes.

# stop PID: SIGTERM (kinference drains on it), then SIGKILL if it has not exited within 10 s.
# Returns 0 whatever happened, so cleanup traps can call it on every path.
stop() {
  local pid=$1
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  return 0
}
