#!/usr/bin/env bash
# Set up a virtual environment (Python >= 3.12) and run the demo or the test suite.
#   ./run.sh demo            generate with the default model and print speed-up and accept length
#   ./run.sh test [args]     the whole test suite (pytest args pass through)
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  local c
  for c in "${DSPARK_PYTHON:-}" python3.12 python3.13 python3.14 python3 \
           "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  echo "error: no Python >= 3.12 found (set DSPARK_PYTHON to one)" >&2
  return 1
}

VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python)
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -e ".[test,train]"

cmd=${1:-demo}
shift || true
case "$cmd" in
  demo) exec "$VENV/bin/python" examples/quickstart.py "$@" ;;
  test) exec "$VENV/bin/python" -m pytest -n 2 --dist loadfile --max-worker-restart=0 "$@" ;;
  *) echo "usage: ./run.sh demo | test [pytest args]" >&2; exit 2 ;;
esac
