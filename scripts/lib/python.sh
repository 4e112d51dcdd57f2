# python.sh - finding a Python interpreter new enough for a pinned client.

# find_python312: prints a Python >= 3.12 (inference-perf needs one): KINFERENCE_PYTHON312 when
# set, else python3.13 / python3.12 on PATH, pyenv's (under PYENV_ROOT, default ~/.pyenv), or
# uv's; fails when there is none.
find_python312() {
  local c
  for c in "${KINFERENCE_PYTHON312:-}" python3.13 python3.12 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    [ -n "$c" ] || continue
    c=$(command -v "$c" 2>/dev/null) || continue
    "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$c"; return 0; }
  done
  if command -v uv >/dev/null; then
    c=$(uv python find '>=3.12' 2>/dev/null) && { echo "$c"; return 0; }
  fi
  return 1
}
