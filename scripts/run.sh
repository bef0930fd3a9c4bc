#!/usr/bin/env bash
# One entry point for a fresh machine: make (or reuse) a virtual environment,
# install minddp into it, then run what was asked for.
#
#   bash scripts/run.sh compare [args...]   # MiniDDP vs torch's DDP (benchmarks/compare.py)
#   bash scripts/run.sh test [pytest args]  # the test suite
#   bash scripts/run.sh python FILE [args]  # anything else, inside the environment
#
# MINDDP_TORCH=2.13.0 bash scripts/run.sh test ...  does the same on that torch
# (with the torchvision made for it): CI runs the oldest torch minddp supports so.
# MINDDP_EXTRAS=test,frameworks also installs accelerate and Lightning (CI does).
#
# The environment lives outside the checkout, keyed by a hash of
# pyproject.toml (and of the two settings above), so a second clone (CI's)
# reuses it instead of downloading torch again. Override its place with MINDDP_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
extras=${MINDDP_EXTRAS:-test}
key=$( (cat pyproject.toml; echo "${MINDDP_TORCH:-} $extras") | sha256sum | cut -c1-12)
VENV=${MINDDP_VENV:-$HOME/.cache/minddp/venv-$key}
# "===" matches that very version, not a local build of it such as 2.13.0+cpu, whose
# CPU-only torch the registry's torchvision cannot load (see below).
torch_pin=${MINDDP_TORCH:+torch===$MINDDP_TORCH}

if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    echo "[minddp] creating $VENV (first time: downloads torch, a few minutes)" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools
    # No torch pin unless MINDDP_TORCH asks: the registry's regular torch wheel
    # runs on CPU and matches the registry's torchvision. A CPU-only torch next to the
    # registry's torchvision fails with "operator torchvision::nms does not
    # exist" (see README, "Installing on a laptop").
    "$VENV/bin/python" -m pip install -q ".[$extras]" $torch_pin
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
