#!/usr/bin/env bash
# sim-clients.sh - real clients, unmodified, against `kinference sim`.
#
# Starts one simulated replica (on ports it picks) and runs
#   (a) the official openai Python SDK (scripts/sim_clients_openai.py): completions and chat,
#       plain and streaming, usage and cached tokens, n, stop, logprobs, errors;
#   (b) inference-perf 0.7.0 with `data.type: shared_prefix`, streaming completions at a
#       constant rate, failing if any request failed.
# Exits non-zero on the first failure; the replica is always stopped.
#
# usage: scripts/sim-clients.sh [BINARY]
#   BINARY is a built `kinference` (run as `kinference sim ...`) or `kinference-sim-server`;
#   without it, `cargo build -p kinference` builds target/debug/kinference.
# env: KINFERENCE_SIM_CLIENTS_VENV  venv for the clients (default ~/.cache/kinference/sim-clients;
#                                   created with the pins of scripts/sim-clients-requirements.txt)
#      KINFERENCE_PYTHON312        a Python >= 3.12 interpreter (inference-perf needs one);
#                                   otherwise python3.13/python3.12 on PATH, pyenv's, or uv's
#      SIM_CLIENTS_SKIP_PERF=1     run only the openai checks
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
REQS=$HERE/sim-clients-requirements.txt
VENV=${KINFERENCE_SIM_CLIENTS_VENV:-$HOME/.cache/kinference/sim-clients}
MODEL=tiny
T0=$(date +%s)
log() { echo "[sim-clients +$(( $(date +%s) - T0 ))s] $*"; }
die() { log "error: $*"; exit 1; }

# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
# shellcheck source=lib/python.sh
source "$HERE/lib/python.sh"

WORK=$(mktemp -d)
SIM_PID=""
cleanup() {
  stop "$SIM_PID"
  rm -rf "$WORK"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the simulator binary
BIN=$(kinference_binary "$REPO" debug "${1:-}") || die "no kinference binary"
SUB=()
[ "$(basename "$BIN")" = kinference ] && SUB=(sim)

# --- Python >= 3.12 and the pinned clients

satisfied() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$REQS" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if line:
        name, want = line.split("==")
        if m.version(name) != want:
            sys.exit(1)
PYEOF
}

if ! satisfied; then
  PY=$(find_python312) || die "inference-perf needs Python >= 3.12 and none was found (set KINFERENCE_PYTHON312)"
  log "installing the pinned clients into $VENV with $("$PY" --version)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQS"
  satisfied || die "installed versions differ from $REQS"
fi
PY=$VENV/bin/python

# --- one replica, on ports it picks (port 0)
"$BIN" "${SUB[@]}" --host 127.0.0.1 --port 0 --model "$MODEL" --tokenizer "$TOKENIZER" \
  --block-size 16 --num-gpu-blocks 2048 --max-model-len 4096 --speedup 20 \
  --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0' >"$WORK/sim.out" 2>"$WORK/sim.err" &
SIM_PID=$!
wait_sim_replicas "$WORK/sim.out" "$SIM_PID" 1 30 || { cat "$WORK/sim.err" >&2; die "the simulator did not start"; }
LINE=$(grep '^replica=0 ' "$WORK/sim.out")
URL=$(field "$LINE" url)
log "simulator: $LINE"
curl -sf "$URL/health" >/dev/null || die "$URL/health failed"

# --- (a) the openai SDK
log "openai SDK"
"$PY" "$HERE/sim_clients_openai.py" "$URL" "$MODEL"

# --- (b) inference-perf, shared prefixes
if [ "${SIM_CLIENTS_SKIP_PERF:-0}" = 1 ]; then
  log "inference-perf skipped (SIM_CLIENTS_SKIP_PERF=1)"
  exit 0
fi
cat >"$WORK/perf.yaml" <<EOF
api:
  type: completion
  streaming: true
data:
  type: shared_prefix
  shared_prefix:
    num_groups: 4
    num_prompts_per_group: 8
    system_prompt_len: 300
    question_len: 40
    output_len: 12
    seed: 7
load:
  type: constant
  stages:
    - rate: 8
      duration: 8
  num_workers: 1
  base_seed: 7
server:
  type: vllm
  model_name: $MODEL
  base_url: $URL
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: $TOKENIZER
storage:
  local_storage:
    path: $WORK/reports
EOF
log "inference-perf $("$PY" -c 'import importlib.metadata as m; print(m.version("inference-perf"))')"
(cd "$WORK" && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/inference-perf" -c perf.yaml \
  >"$WORK/perf.log" 2>&1) || { tail -40 "$WORK/perf.log" >&2; die "inference-perf failed"; }
PYTHONPATH="$HERE/lib" "$PY" - "$WORK/reports" "$URL" <<'PYEOF'
import glob, json, os, sys
import prom
reports, url = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(os.path.join(reports, "**", "summary_lifecycle_metrics.json"), recursive=True))
assert files, f"no summary_lifecycle_metrics.json under {reports}: {os.listdir(reports)}"
s = json.load(open(files[-1]))
ok, failed = s["successes"]["count"], s["failures"]["count"]
assert failed == 0, f"{failed} requests failed: {s['failures']}"
assert ok >= 32, f"only {ok} requests succeeded"
hits = prom.total(prom.page(f"{url}/metrics"), "vllm:prefix_cache_hits_total")
assert hits > 0, "shared prefixes never hit the prefix cache"
ttft = s["successes"]["latency"]["time_to_first_token"]
print(f"inference-perf: {ok} passed, {failed} failed; ttft mean {ttft['mean']:.4f}s; "
      f"{hits:.0f} prefix-cache hit tokens")
PYEOF
log "all clients passed"
