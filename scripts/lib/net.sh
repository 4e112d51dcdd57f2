# net.sh - ports and readiness for the scripts that start servers on loopback.
#
# Ports: a server that can bind port 0 is given port 0 and its address is read back from what
# it prints (`kinference sim` prints `replica=I url=...`, `kinference serve` logs
# `router started data_addr=... admin_addr=...`). Only programs that must be told their ports
# up front (vLLM, the peer routers, nginx) get ports from free_ports, which is racy by nature:
# another process can take a port between the choice and the bind.

# free_ports N: N distinct loopback TCP ports, free when chosen (all held at once while they
# are chosen, so they differ), on one line.
free_ports() {
  python3 - "$1" <<'PYEOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PYEOF
}

# wait_sim_replicas OUTFILE PID N [SECS]: waits until `kinference sim` (PID) has printed its
# line for each of replicas 0..N-1 into OUTFILE; fails if it exits or SECS (default 60) pass.
wait_sim_replicas() {
  local out=$1 pid=$2 n=$3 secs=${4:-60} i
  for i in $(seq 1 $(( secs * 10 ))); do
    grep -q "^replica=$(( n - 1 )) " "$out" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "the simulator exited" >&2; return 1; }
    sleep 0.1
  done
  echo "the simulator printed no line for replica $(( n - 1 )) in ${secs} s" >&2
  return 1
}

# field LINE KEY: the value of KEY=VALUE in a space-separated line.
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }

# dial ENDPOINT: a bound endpoint (`tcp://*:P`, `tcp://0.0.0.0:P`) as a loopback one to dial.
dial() { sed -E 's#^tcp://[^:]*:#tcp://127.0.0.1:#' <<<"$1"; }

# router_addrs ERRFILE PID [SECS]: waits until `kinference serve` (PID, started with port 0 for
# --listen and --admin, its log in ERRFILE) has bound its ports; prints "DATA_ADDR ADMIN_ADDR".
router_addrs() {
  local err=$1 pid=$2 secs=${3:-60} i line
  for i in $(seq 1 $(( secs * 10 ))); do
    line=$(grep -m1 'router started' "$err" 2>/dev/null) && {
      echo "$(field "$line" data_addr) $(field "$line" admin_addr)"
      return 0
    }
    kill -0 "$pid" 2>/dev/null || { echo "the router exited" >&2; return 1; }
    sleep 0.1
  done
  echo "the router did not start in ${secs} s" >&2
  return 1
}

# wait_router_ready ADMIN_URL PID WANT [SECS]: waits until the router (PID) is ready with WANT
# replicas, every one scraped up and scorable and every event stream subscribed (so the first
# requests' blocks reach the index; a replica without events has none to wait for); fails with the last state seen after SECS (default 30).
wait_router_ready() {
  python3 - "$1" "$2" "$3" "${4:-30}" <<'PYEOF'
import json, os, sys, time, urllib.error, urllib.request
admin, pid, want, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline, last = time.monotonic() + secs, "no answer"
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the router exited")
    try:
        ready = json.load(urllib.request.urlopen(f"{admin}/readyz", timeout=2))
        fleet = json.load(urllib.request.urlopen(f"{admin}/debug/replicas", timeout=2))
        reps = [r for p in fleet["pools"] for r in p["replicas"]]
        subscribed = all(r.get("events_mode") == "none"
                         or all(w["events"] and w["events"]["connected"] for w in r["workers"])
                         for r in reps)
        if ready["ready"] and len(reps) == want and all(r["scorable"] for r in reps) and subscribed:
            sys.exit(0)
        last = json.dumps(fleet)[:2000]
    except (urllib.error.URLError, ConnectionError, OSError, KeyError, TypeError) as e:
        last = f"readyz: {e.code}" if isinstance(e, urllib.error.HTTPError) else str(e)
    time.sleep(0.1)
sys.exit(f"not ready within {secs:g} s; last state: {last}")
PYEOF
}

# wait_http URL PID SECS: waits until URL answers 200 to a GET while PID lives; fails with the
# last answer after SECS seconds.
wait_http() {
  python3 - "$1" "$2" "$3" <<'PYEOF'
import os, sys, time, urllib.error, urllib.request
url, pid, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline, last = time.monotonic() + secs, "no answer"
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("exited")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
            last = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        last = f"HTTP {e.code}"
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        last = str(e)
    time.sleep(0.1)
sys.exit(f"no 200 from {url} within {secs:.0f} s (last: {last})")
PYEOF
}

# wait_port HOST:PORT PID SECS: waits until HOST:PORT accepts a TCP connection while PID lives
# (for servers that bind their port only once they can serve, e.g. llm-d's endpoint picker
# gates its ext_proc listener on its endpoint discovery); fails after SECS seconds.
wait_port() {
  python3 - "$1" "$2" "$3" <<'PYEOF'
import os, socket, sys, time
addr, pid, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
host, port = addr.rsplit(":", 1)
deadline, last = time.monotonic() + secs, "no attempt"
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("exited")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        sys.exit(0)
    except OSError as e:
        last = str(e)
    time.sleep(0.1)
sys.exit(f"{addr} did not accept within {secs:.0f} s (last: {last})")
PYEOF
}
