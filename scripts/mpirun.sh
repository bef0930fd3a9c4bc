#!/usr/bin/env bash
# minddp-train under OpenMPI's mpirun.
#
# One machine, NP ranks:
#   NP=4 bash scripts/mpirun.sh --epochs 2
# Several machines (HOSTS as mpirun's -H takes it, first host runs rank 0):
#   NP=8 HOSTS=node0:4,node1:4 MASTER_ADDR=node0 bash scripts/mpirun.sh --backend nccl --data mnist --data-dir data
#
# mpirun only *starts* the processes here; they talk over Gloo or NCCL, not
# MPI. Each gets OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and
# OMPI_COMM_WORLD_LOCAL_RANK, which minddp's launch helper reads. OpenMPI
# has no notion of a master address, so it is exported to every rank with -x
# (it must name the host of rank 0). Do not pass --nproc.
# When a rank exits non-zero, mpirun kills the others and exits non-zero.
# Run as root (a container), it passes --allow-run-as-root, which OpenMPI
# otherwise demands. More ranks than cores: OMPI_MCA_rmaps_base_oversubscribe=1.
set -euo pipefail
cd "$(dirname "$0")/.."

NP=${NP:-2}
PYTHON=${PYTHON:-python}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
EXTRA_ARGS=()
if [ -n "${HOSTS:-}" ]; then
    EXTRA_ARGS+=(-H "$HOSTS")
fi
if [ -n "${LD_LIBRARY_PATH:-}" ]; then
    EXTRA_ARGS+=(-x LD_LIBRARY_PATH)
fi
# OpenMPI refuses to start as root unless told; containers often run as root.
if [ "$(id -u)" -eq 0 ]; then
    EXTRA_ARGS+=(--allow-run-as-root)
fi

# --bind-to none: let each rank use several cores (torch threads, loaders).
# -x PATH (and LD_LIBRARY_PATH, when set): remote ranks find the same python environment.
exec mpirun -np "$NP" "${EXTRA_ARGS[@]}" --bind-to none \
    -x MASTER_ADDR="$MASTER_ADDR" -x MASTER_PORT="$MASTER_PORT" -x PATH \
    "$PYTHON" -m minddp_lab.train "$@"
