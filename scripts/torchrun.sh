#!/usr/bin/env bash
# minddp-train under torchrun (torch.distributed.run).
#
# One machine, NPROC ranks (CPU with Gloo by default; add --backend nccl for GPUs):
#   NPROC=4 bash scripts/torchrun.sh --epochs 2
#
# Several machines: run the same command on every node, with the same
# MASTER_ADDR (a host every node can reach, usually node 0) and NNODES:
#   NNODES=2 NPROC=4 MASTER_ADDR=node0 bash scripts/torchrun.sh --backend nccl --data mnist --data-dir data
#
# What torchrun does: it starts NPROC processes per node and gives each RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which minddp's launch
# helper reads (so do not pass --nproc). If one rank fails, torchrun stops the
# others on its node, then starts them all again, up to MAX_RESTARTS times:
# with --resume auto each new attempt continues from the last checkpoint
# (losing at most --save-every steps); the first attempt starts fresh.
#
# Environment variables it reads:
#   NNODES, NPROC   nodes, and ranks per node (default 1 and 2)
#   MAX_RESTARTS    how often torchrun restarts failed ranks (default 3)
#   CKPT_DIR        checkpoint folder (default ./checkpoints/torchrun);
#                   a --checkpoint-dir of yours wins
#   SAVE_EVERY      steps between checkpoints (default 500)
#   PYTHON          the python that runs minddp-train (default: python)
set -euo pipefail
CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/torchrun}
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python}
# Your arguments come last, so they override these.
TRAIN_ARGS=(--checkpoint-dir "$CKPT_DIR" --save-every "${SAVE_EVERY:-500}" --resume auto "$@")

if [ "$NNODES" -eq 1 ]; then
    # --standalone: a private rendezvous on a free local port.
    exec "$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC" \
        --max-restarts "${MAX_RESTARTS:-3}" -m minddp_lab.train "${TRAIN_ARGS[@]}"
fi

: "${MASTER_ADDR:?set MASTER_ADDR to a host every node can reach (node 0)}"
RDZV_PORT=${RDZV_PORT:-29400}
# c10d rendezvous: the nodes meet at MASTER_ADDR:RDZV_PORT; the job id keeps
# two jobs on the same hosts apart.
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$RDZV_PORT" --rdzv-id "${RDZV_ID:-minddp}" \
    --max-restarts "${MAX_RESTARTS:-3}" -m minddp_lab.train "${TRAIN_ARGS[@]}"
