#!/usr/bin/env bash
# zmq-interop.sh - KV events against libzmq itself: runs crates/interop/tests/pyzmq.rs with a
# pyzmq peer (scripts/pyzmq_peer.py) required, so a missing peer fails instead of skipping.
#
# usage: scripts/zmq-interop.sh
# env: KINFERENCE_ZMQ_PY_VENV   venv for the peer (default ~/.cache/kinference/zmq-py; created
#                               with the pins of scripts/zmq-py-requirements.txt)
#      KINFERENCE_ZMQ_PY_VLLM=1 also run the tests with the real vLLM's interpreter
#                               (KINFERENCE_VLLM_CACHE/venv, default ~/.cache/kinference/real-vllm;
#                               see scripts/real-vllm.sh),
#                               so the peer encodes and decodes with vLLM's own msgspec classes
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
REQS=$HERE/zmq-py-requirements.txt
VENV=${KINFERENCE_ZMQ_PY_VENV:-$HOME/.cache/kinference/zmq-py}
PY=$VENV/bin/python
log() { echo "[zmq-interop] $*"; }

satisfied() {
  [ -x "$PY" ] && "$PY" - "$REQS" <<'PYEOF' 2>/dev/null
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
  log "installing the pinned peer packages into $VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check -r "$REQS"
  satisfied || { log "installed versions differ from $REQS" >&2; exit 1; }
fi
"$PY" -c 'import zmq; print("[zmq-interop] peer: pyzmq", zmq.__version__, "libzmq", zmq.zmq_version())'

cd "$REPO"
# `--workspace --test pyzmq` rather than `-p kinference-interop`: dependency features resolved
# over the workspace, as `cargo test --workspace` built them, so nothing is compiled again.
KINFERENCE_ZMQ_PY=$PY KINFERENCE_ZMQ_PY_REQUIRED=1 \
  cargo test --workspace --test pyzmq --locked -- --test-threads=1

if [ "${KINFERENCE_ZMQ_PY_VLLM:-0}" = 1 ]; then
  VLLM_PY=${KINFERENCE_VLLM_CACHE:-$HOME/.cache/kinference/real-vllm}/venv/bin/python
  [ -x "$VLLM_PY" ] || { log "no real vLLM at $VLLM_PY (scripts/real-vllm.sh installs it)" >&2; exit 1; }
  log "again with vLLM's own msgspec classes ($VLLM_PY)"
  KINFERENCE_ZMQ_PY=$VLLM_PY KINFERENCE_ZMQ_PY_REQUIRED=1 \
    cargo test --workspace --test pyzmq --locked -- --test-threads=1
fi
log "ok"
