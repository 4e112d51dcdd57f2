#!/usr/bin/env bash
# python-deps.sh - create (idempotently) the Python virtual environment that
# scripts/tokenizer_expectations.py runs in, with the pinned packages of
# scripts/tokenizer-requirements.txt (transformers without torch).
#
# usage: scripts/python-deps.sh [VENV_DIR]
#   VENV_DIR defaults to $KINFERENCE_PY_VENV or ~/.cache/kinference/py.
#   The interpreter is then VENV_DIR/bin/python: point KINFERENCE_PYTHON at it
#   when VENV_DIR is not the default.
# Does nothing (beyond one version check) when the venv already has the pins.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQS="$HERE/tokenizer-requirements.txt"
VENV=${1:-${KINFERENCE_PY_VENV:-$HOME/.cache/kinference/py}}
PY="$VENV/bin/python"

satisfied() {
  [ -x "$PY" ] && "$PY" - "$REQS" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, want = line.split("==")
    if m.version(name) != want:
        sys.exit(1)
PYEOF
}

if satisfied; then
  echo "python-deps: $VENV already has the pinned packages"
  exit 0
fi

echo "python-deps: installing pinned packages into $VENV"
python3 -m venv "$VENV"
"$PY" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$PY" -m pip install --quiet --disable-pip-version-check -r "$REQS"
satisfied || { echo "python-deps: installed versions differ from $REQS" >&2; exit 1; }
echo "python-deps: ready ($PY)"
