#!/usr/bin/env bash
# router-clients.sh - the official openai Python SDK, unmodified, against the router.
#
# Starts two simulated replicas (`kinference sim --replicas 2`, ports they pick, KV events and
# replay on) and `kinference serve` in front of them, subscribed to both event streams; waits
# until the router is ready and subscribed; then runs, against the ROUTER's port:
#   (a) scripts/sim_clients_openai.py: models, completions and chat, plain and streaming, usage
#       and cached tokens on a repeat, n, stop, logprobs, NotFoundError for an unknown model,
#       BadRequestError for an over-long prompt;
#   (b) shared long prefixes through the SDK: for each of four documents, one request, then
#       follow-ups with other questions (plain and streaming, completions and chat) that must
#       all report most of the document as cached: with two replicas, routing that ignored the
#       cache would miss about half of them.
# Exits non-zero on the first failure; the router and the replicas are always stopped.
#
# usage: scripts/router-clients.sh [BINARY]
#   BINARY is a built `kinference`; without it, `cargo build -p kinference` builds
#   target/debug/kinference.
# env: KINFERENCE_SIM_CLIENTS_VENV  the venv of scripts/sim-clients.sh (default
#                                   ~/.cache/kinference/sim-clients), used when it holds the
#                                   pinned openai; otherwise it is created as sim-clients.sh
#                                   does (Python >= 3.12), or, without such a Python, a venv
#                                   with only openai is made next to it (suffix -openai).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=$(cd "$REPO/../shared" && pwd)
TOKENIZER=$SHARED/golden/real_vllm_0.32/tiny-llama-tokenizer
REQS=$HERE/sim-clients-requirements.txt
VENV=${KINFERENCE_SIM_CLIENTS_VENV:-$HOME/.cache/kinference/sim-clients}
MODEL=tiny
BLOCK=16
T0=$(date +%s)
log() { echo "[router-clients +$(( $(date +%s) - T0 ))s] $*"; }

WORK=$(mktemp -d)
SIM_PID=""
ROUTER_PID=""
DIED=""
show_logs() {
  local f
  for f in "$WORK/router.err" "$WORK/sim.err"; do
    [ -s "$f" ] && { echo "--- last lines of $(basename "$f")" >&2; tail -20 "$f" >&2; }
  done
  return 0
}
die() { DIED=1; log "error: $*"; show_logs; exit 1; }
# shellcheck source=lib/proc.sh
source "$HERE/lib/proc.sh"
# shellcheck source=lib/net.sh
source "$HERE/lib/net.sh"
# shellcheck source=lib/python.sh
source "$HERE/lib/python.sh"
cleanup() {
  local rc=$?
  # A failure that did not go through die (set -e) still shows the logs.
  [ "$rc" -ne 0 ] && [ -z "${DIED:-}" ] && show_logs
  stop "$ROUTER_PID"
  stop "$SIM_PID"
  rm -rf "$WORK"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the binary
BIN=$(kinference_binary "$REPO" debug "${1:-}") || die "no kinference binary"

# --- a venv with the pinned openai SDK
OPENAI_PIN=$(grep -E '^openai==' "$REQS") || die "no openai pin in $REQS"
has_openai() {
  [ -x "$1/bin/python" ] && "$1/bin/python" -c '
import importlib.metadata as m, sys
name, want = sys.argv[1].split("==")
sys.exit(m.version(name) != want)' "$OPENAI_PIN" 2>/dev/null
}
if ! has_openai "$VENV"; then
  if PY312=$(find_python312); then
    # The same venv and pins as sim-clients.sh, so either script can reuse it.
    log "installing the pinned clients into $VENV with $("$PY312" --version)"
    "$PY312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQS"
  else
    VENV=$VENV-openai
    if ! has_openai "$VENV"; then
      command -v python3 >/dev/null || die "no python3 on PATH"
      log "installing $OPENAI_PIN into $VENV with $(python3 --version)"
      python3 -m venv "$VENV"
      "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$OPENAI_PIN"
    fi
  fi
  has_openai "$VENV" || die "$VENV does not hold $OPENAI_PIN"
fi
PY=$VENV/bin/python

# --- two replicas, HTTP, events and replay on ports they pick (port 0)
NO_COLOR=1 "$BIN" sim --host 127.0.0.1 --port 0 --replicas 2 --model "$MODEL" --tokenizer "$TOKENIZER" \
  --block-size "$BLOCK" --num-gpu-blocks 2048 --max-model-len 4096 --speedup 20 \
  --events-endpoint 'tcp://*:0' --replay-endpoint 'tcp://*:0' >"$WORK/sim.out" 2>"$WORK/sim.err" &
SIM_PID=$!
wait_sim_replicas "$WORK/sim.out" "$SIM_PID" 2 30 || die "the simulator did not start"

REPLICA_FLAGS=()
URLS=()
for i in 0 1; do
  line=$(grep "^replica=$i " "$WORK/sim.out")
  url=$(field "$line" url) ev=$(field "$line" events) rp=$(field "$line" replay)
  case "$ev$rp" in *-*|*,*|"") die "replica $i: expected one events and one replay endpoint: $line";; esac
  log "replica $i: $line"
  URLS+=("$url")
  REPLICA_FLAGS+=(--replica "$url,events=$(dial "$ev"),replay=$(dial "$rp")")
done

# --- the router, on ports it picks
NO_COLOR=1 "$BIN" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
  --model "$MODEL" --tokenizer "$TOKENIZER" --block-size "$BLOCK" --policy precise \
  --scrape-interval-ms 200 --expose-endpoint-header "${REPLICA_FLAGS[@]}" \
  >"$WORK/router.out" 2>"$WORK/router.err" &
ROUTER_PID=$!
read -r DATA_ADDR ADMIN_ADDR < <(router_addrs "$WORK/router.err" "$ROUTER_PID" 30) ||
  die "the router did not start"
ROUTER=http://$DATA_ADDR
ADMIN=http://$ADMIN_ADDR
wait_router_ready "$ADMIN" "$ROUTER_PID" 2 30 || die "the router never became ready"
log "router ready: 2 replicas up, scorable, subscribed"
log "router $ROUTER (admin $ADMIN) in front of ${URLS[*]}"

# --- (a) the openai SDK's checks, through the router
log "openai SDK: sim_clients_openai.py against the router"
"$PY" "$HERE/sim_clients_openai.py" "$ROUTER" "$MODEL" || { die "openai SDK checks failed against the router"; }

# --- (b) long shared prefixes: the follow-ups must find their prefix cached
log "openai SDK: shared prefixes through the router"
"$PY" - "$ROUTER" "$MODEL" <<'PYEOF' || { die "shared-prefix checks failed against the router"; }
import sys
import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

def document(d):
    return f"Document {d}. " + "".join(
        f"Paragraph {i} of document {d} says how blocks of a prompt are hashed. " for i in range(40))

def streamed_usage(stream):
    usage, text = None, []
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            piece = ch.text if hasattr(ch, "text") else ch.delta.content
            text.append(piece or "")
    assert "".join(text).strip(), "no text streamed"
    return usage

checked, served = 0, {}
for d in range(4):
    doc = document(d)
    first = client.completions.with_raw_response.create(
        model=model, prompt=doc + " Question 0?", max_tokens=2)
    endpoint = first.headers.get("x-kinference-endpoint")
    assert endpoint, "the router did not say where the request went"
    served[d] = endpoint
    first = first.parse()
    prefix = first.usage.prompt_tokens - 8  # the question's tokens are not shared
    for q in range(1, 4):
        question = f" Question {q}: which replica holds this document?"
        kind = ("completions", "completions stream", "chat stream")[q - 1]
        if q == 1:
            raw = client.completions.with_raw_response.create(
                model=model, prompt=doc + question, max_tokens=2)
            assert raw.headers.get("x-kinference-endpoint") == endpoint, (
                f"document {d}: follow-up went to {raw.headers.get('x-kinference-endpoint')}, "
                f"not to {endpoint} which holds the prefix")
            usage = raw.parse().usage
        elif q == 2:
            usage = streamed_usage(client.completions.create(
                model=model, prompt=doc + question, max_tokens=3, stream=True,
                stream_options={"include_usage": True}))
        else:
            # Chat renders its own prefix: cache it once, then ask again.
            messages = [{"role": "user", "content": doc + " Question 0?"}]
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
            messages[0]["content"] = doc + question
            usage = streamed_usage(client.chat.completions.create(
                model=model, messages=messages, max_tokens=3, stream=True,
                stream_options={"include_usage": True}))
        assert usage is not None, f"document {d}, {kind}: no usage"
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached >= prefix * 0.8, (
            f"document {d}, {kind}: {cached} of {usage.prompt_tokens} prompt tokens cached, "
            f"expected about {prefix} (the shared document)")
        checked += 1
    print(f"ok  document {d} ({first.usage.prompt_tokens} prompt tokens) on {endpoint}: "
          f"3 follow-ups cached")
print(f"shared prefixes: {checked} follow-ups all cached; documents on "
      f"{len(set(served.values()))} of 2 replicas")
PYEOF

# --- the router's own view agrees: decisions by cached prefix, predictions met
PYTHONPATH="$HERE/lib" "$PY" - "$ADMIN" <<'PYEOF' || { die "the router's metrics disagree"; }
import sys, prom
text = prom.page(f"{sys.argv[1]}/metrics")
cached = prom.total(text, "kinference_decisions_total", reason="cached_prefix")
assert cached >= 12, f"only {cached} decisions by cached prefix: " + repr(
    prom.by_label(text, "kinference_decisions_total", "reason"))
print(f"router metrics: {cached:.0f} decisions by cached prefix")
PYEOF
log "all router clients passed"
