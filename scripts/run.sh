#!/usr/bin/env bash
# One entry point for a fresh machine: make (or reuse) a virtual environment,
# install minddp into it, then run what was asked for.
#
#   bash scripts/run.sh compare [args...]   # MiniDDP vs torch's DDP (benchmarks/compare.py)
#   bash scripts/run.sh test [pytest args]  # the test suite
#   bash scripts/run.sh python FILE [args]  # anything else, inside the environment
#
# The environment lives outside the checkout, keyed by a hash of
# pyproject.toml, so a second clone (CI's) reuses it instead of downloading
# torch again. Override its place with MINDDP_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
key=$(sha256sum pyproject.toml | cut -c1-12)
VENV=${MINDDP_VENV:-$HOME/.cache/minddp/venv-$key}

if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    echo "[minddp] creating $VENV (first time: downloads torch, a few minutes)" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools
    # No torch pin on purpose: the registry's regular torch wheel runs on CPU
    # and matches the registry's torchvision. A CPU-only torch next to the
    # registry's torchvision fails with "operator torchvision::nms does not
    # exist" (see README, "Installing on a laptop").
    "$VENV/bin/python" -m pip install -q ".[test]"
    touch "$VENV/.complete"
fi
# Point the (editable) install at this checkout every time: the environment
# is shared between clones, and tests must import the code beside them.
if ! log=$("$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1); then
    echo "$log" >&2
    exit 1
fi

what=${1:-test}
shift || true
case "$what" in
    test)    exec "$VENV/bin/python" -m pytest "$@" ;;
    compare) exec "$VENV/bin/python" benchmarks/compare.py "$@" ;;
    train)   exec "$VENV/bin/minddp-train" "$@" ;;
    python)  exec "$VENV/bin/python" "$@" ;;
    *) echo "usage: bash scripts/run.sh test|compare|train|python [args...]" >&2; exit 2 ;;
esac
