#!/usr/bin/env bash
# The GPU acceptance run, in one command, on a machine with one CUDA GPU:
#
#     bash scripts/gpu_check.sh
#
# Needs python3 with torch, pytest and matplotlib; no package registry (the
# package itself is installed with --no-deps). Writes everything under
# docs/gpu/ and takes under 8 minutes on one H100-class GPU:
#
#   1. tests/library/test_cuda.py: NCCL at world size 1 with a communicating comm hook,
#      2 Gloo ranks on CUDA tensors sharing the GPU (the equivalence oracle),
#      streams, AMP, sparse, join, host-sync counts, device_ids, device-side
#      trace times                                       -> docs/gpu/tests.txt
#   2. minddp-train --backend nccl: train, save, resume, evaluate
#                                                        -> docs/gpu/train.txt
#   3. benchmarks/compare.py on the GPU, like for like (both wrappers with an
#      all-reduce hook at world size 1), with the overhead table
#                                                        -> docs/gpu/compare.{txt,json,png}
#   4. a traced step drawn as the overlap picture, with device-side (CUDA
#      event) times                                      -> docs/gpu/overlap-*.{json,png}
#
# Every part runs even if an earlier one failed; the summary
# (docs/gpu/summary.txt) says which passed, and the exit code is non-zero if
# any failed. Settings for a dry run elsewhere: PYTHON (default python3),
# SKIP_INSTALL=1, BACKEND=gloo DEVICE=cpu (the parts then start on a CPU;
# test_cuda.py skips, saying why).
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
BACKEND=${BACKEND:-nccl}
DEVICE=${DEVICE:-cuda}
OUT=${OUT_DIR:-docs/gpu}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/minddp-gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
STARTED=$(date +%s)
FAILED=0

# part NAME TIMEOUT_S LOG COMMAND...: run one part, log its output, note its result.
part() {
    local name=$1 limit=$2 log=$3
    shift 3
    local t0=$(date +%s)
    echo "== $name: $*" | tee "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 0 ]; then
        echo "PASS  $name (${took} s)" | tee -a "$SUMMARY"
    else
        [ "$rc" -eq 124 ] && echo "(timed out after $limit s)" | tee -a "$log"
        echo "FAIL  $name (exit $rc, ${took} s; see $log)" | tee -a "$SUMMARY"
        FAILED=1
    fi
}

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    "$PY" -m pip install --no-deps --no-build-isolation -q -e . || { echo "pip install -e . failed" >&2; exit 2; }
fi
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'gpus', torch.cuda.device_count())"
} | tee "$OUT/device.txt"

# 1. The GPU tests (and the CPU tests of the same defects, as a baseline).
part "tests" 240 "$OUT/tests.txt" "$PY" -m pytest tests/library/test_cuda.py tests/library/test_gpu_path.py -q -rs -p no:cacheprovider

# 2. Train, save, resume, evaluate with NCCL (one rank: one GPU).
TRAIN=(--backend "$BACKEND" --nproc 1 --synthetic-size 4096 --batch-size 64 --checkpoint-dir "$WORK/ckpt" --save-every 20)
part "train: 40 steps, saved" 120 "$OUT/train.txt" \
    "$PY" -m minddp_lab.train "${TRAIN[@]}" --max-steps 40
part "train: resumed to 64 steps (one epoch), evaluated" 120 "$WORK/resume.txt" \
    "$PY" -m minddp_lab.train "${TRAIN[@]}" --resume --epochs 1
cat "$WORK/resume.txt" >> "$OUT/train.txt"
cp "$WORK/ckpt/metrics.jsonl" "$OUT/train-metrics.jsonl" 2>/dev/null

# 3 and 4. The benchmark on the GPU, like for like, with the overhead table,
# then traced steps of each model drawn as the overlap picture.
part "compare + overlap trace" 300 "$OUT/compare.txt" \
    "$PY" benchmarks/compare.py --backend "$BACKEND" --device "$DEVICE" --world-size 1 \
    --models mlp,cnn,gpt --runs 3 --steps 24 --repeats 4 --warmup 3 \
    --json "$OUT/compare.json" --plot "$OUT/compare.png" --trace "$OUT/overlap.json"

echo "total: $(( $(date +%s) - STARTED )) s" | tee -a "$SUMMARY"
exit $FAILED
