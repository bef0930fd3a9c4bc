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
set -euo pipefail
cd "$(dirname "$0")/.."

NP=${NP:-2}
PYTHON=${PYTHON:-python}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
HOSTS_ARGS=()
if [ -n "${HOSTS:-}" ]; then
    HOSTS_ARGS=(-H "$HOSTS")
fi

# --bind-to none: let each rank use several cores (torch threads, loaders).
# -x PATH -x LD_LIBRARY_PATH: remote ranks find the same python environment.
exec mpirun -np "$NP" "${HOSTS_ARGS[@]}" --bind-to none \
    -x MASTER_ADDR="$MASTER_ADDR" -x MASTER_PORT="$MASTER_PORT" -x PATH -x LD_LIBRARY_PATH \
    "$PYTHON" -m minddp.train "$@"
