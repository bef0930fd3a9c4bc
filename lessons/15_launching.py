"""Lesson 15: launching for real -- mp.spawn, torchrun, SLURM, mpirun; and DataParallel.

What you will learn
    A launcher's whole job is lesson 01: start the processes and tell each
    one its rank, the world size and where rank 0 listens. They differ in
    who starts what, and in the names of the variables:

    mp.spawn   one command starts all ranks of *one* machine; the rank is the
               function's first argument. Lessons 02-14 used it.
    torchrun   one command per machine; sets RANK, WORLD_SIZE, LOCAL_RANK,
               MASTER_ADDR, MASTER_PORT, and restarts or stops the group when
               a rank fails:
                 torchrun --nproc-per-node 2 lessons/15_launching.py
                 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
                          --rdzv-endpoint node0:29400 train.py      (on every node)
    SLURM      ``srun`` in a batch script starts ntasks-per-node tasks on each
               allocated node, with SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID;
               the master is the first host of SLURM_JOB_NODELIST. See
               scripts/slurm_multinode.sbatch.
    mpirun     OpenMPI starts the processes (OMPI_COMM_WORLD_RANK, ..._SIZE,
               ..._LOCAL_RANK); MPI has no master address, so export one:
                 mpirun -np 4 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 python train.py
               The ranks then talk over Gloo/NCCL, not MPI. See scripts/mpirun.sh.

    ``minddp.launch.detect_launch`` reads whichever of these it finds, and
    ``with minddp.distributed() as info:`` turns it into a process group.
    This very file runs under mp.spawn (the default) *and* under torchrun.

    Where ``nn.DataParallel`` fits: it is one process driving all GPUs of one
    machine with threads. Every step it copies the model to each GPU,
    scatters the batch, gathers the outputs on GPU 0 and reduces the
    gradients there; the Python GIL and GPU 0 become the bottleneck, and it
    cannot span machines. DDP runs one process per GPU, keeps a model
    replica in each for good, moves only gradients (overlapped with
    backward, lesson 06-07), and scales from one machine to many. That is
    why torch's documentation recommends DDP even on a single machine.

What to run
    python lessons/15_launching.py [--world-size 4] [--slurm-nodelist "node[1,3-4]"] [--mpi-without-master-addr]
    torchrun --nproc-per-node 2 lessons/15_launching.py

What to look at
    What detect_launch reads from each launcher's (faked) environment, then
    the ranks of a real launch reporting in.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. For SLURM with ``SLURM_JOB_NODELIST=gpu[07-08]`` predict the master
       address, then run with ``--slurm-nodelist "node[1,3-4]"`` and
       predict again.
    2. Run it under torchrun with ``--nproc-per-node 3`` and predict each
       rank's MASTER_ADDR line.
    3. ``--mpi-without-master-addr`` removes ``MASTER_ADDR`` from the
       openmpi entry: predict what detect_launch says.
"""

import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn

import minddp
from minddp.launch import detect_launch
from _common import parse_args, print0, print_ranks, run

FAKE_ENVIRONMENTS = {
    # What each launcher would set for global rank 5 of 8 = node 1, local rank 1, 4 per node.
    "torchrun": dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="node0", MASTER_PORT="29500",
                     TORCHELASTIC_RUN_ID="job42"),
    "slurm": dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_JOB_NODELIST="gpu[07-08]"),
    "openmpi": dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
                    MASTER_ADDR="node0", MASTER_PORT="29500"),
}
EXPECTED_MASTER = {"torchrun": "node0", "slurm": "gpu07", "openmpi": "node0"}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, worked out by hand for the simple
    shapes of exercise 1 (``gpu[07-08]``, ``node[1,3-4]``, ``a,b``)."""
    prefix, first = re.match(r"([^\[,]+)(?:\[(\d+))?", nodelist).groups()
    return prefix + (first or "")


def show_detection(slurm_nodelist: str = "gpu[07-08]", mpi_without_master_addr: bool = False) -> None:
    print("what detect_launch reads from each launcher's environment (faked, no process started):")
    print("  launcher  | rank | world | local | master")
    environments = {name: dict(env) for name, env in FAKE_ENVIRONMENTS.items()}
    environments["slurm"]["SLURM_JOB_NODELIST"] = slurm_nodelist
    expected_master = dict(EXPECTED_MASTER, slurm=first_host(slurm_nodelist))
    if mpi_without_master_addr:
        del environments["openmpi"]["MASTER_ADDR"]
        try:
            detect_launch(environments.pop("openmpi"))
            raise AssertionError("expected detect_launch to refuse an OpenMPI launch without MASTER_ADDR; it accepted it")
        except RuntimeError as error:
            print(f"  openmpi without MASTER_ADDR -> RuntimeError: {error}")
            assert "MASTER_ADDR" in str(error), f"expected the error to name MASTER_ADDR, saw: {error}"
            print("checked: the error names the missing variable.")
    for launcher, env in environments.items():
        info = detect_launch(env)
        print(f"  {launcher:<9} | {info.rank:>4} | {info.world_size:>5} | {info.local_rank:>5} | {info.master_addr}:{info.master_port}")
        seen = (info.launcher, info.rank, info.world_size, info.local_rank)
        assert seen == (launcher, 5, 8, 1), f"expected ({launcher!r}, 5, 8, 1), saw {seen}"
        assert info.master_addr == expected_master[launcher], f"expected master {expected_master[launcher]}, saw {info.master_addr}"
    try:
        detect_launch({})
        raise AssertionError("an empty environment must not look like a launch")
    except RuntimeError as error:
        print(f"  (nothing)  -> RuntimeError: {str(error)[:60]}...")
    print("checked: every launcher's variables give rank 5 of 8, local rank 1; SLURM's master")
    print(f"         is the first host of {slurm_nodelist}, {expected_master['slurm']}; an empty environment is an error.\n")


def show_data_parallel() -> None:
    # On a machine without GPUs DataParallel has nothing to spread over and
    # simply calls the module: the same output, no copies, no threads.
    model = nn.Linear(4, 2)
    dp = nn.DataParallel(model)
    x = torch.randn(3, 4)
    if not torch.cuda.is_available():
        assert dp.device_ids == [] and torch.equal(dp(x), model(x))
        print("nn.DataParallel on this CPU-only machine: no device to use, it calls the module as is.\n")
    else:
        assert dp.device_ids == list(range(torch.cuda.device_count()))
        print(f"nn.DataParallel here would drive GPUs {dp.device_ids} from this one process.\n")


def report(rank: int, world_size: int, launcher: str) -> None:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size - 1) / 2
    print0(f"a real launch through {launcher}: {world_size} ranks, backend {dist.get_backend()}")
    master = os.environ.get("MASTER_ADDR")
    print_ranks(f"rank {rank} of {world_size}, pid {os.getpid()}, MASTER_ADDR={master}")
    masters = [None] * world_size
    dist.all_gather_object(masters, master)
    assert len(set(masters)) == 1, f"expected one MASTER_ADDR for all ranks, saw {masters}"
    print0("checked: the ranks met, all with the same MASTER_ADDR, and an all_reduce over them gave")
    print0("         0 + 1 + ... + (world_size-1).")


def spawned(rank: int, world_size: int) -> None:
    report(rank, world_size, "minddp.launch.spawn (mp.spawn)")


if __name__ == "__main__":
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        # Started by torchrun, srun or mpirun: this process is one rank.
        torch.set_num_threads(1)
        with minddp.distributed(backend="gloo") as info:
            if info.rank == 0:
                show_detection()
            report(info.rank, info.world_size, info.launcher)
    else:
        def options(parser):
            parser.add_argument("--slurm-nodelist", default="gpu[07-08]", help="exercise 1: SLURM_JOB_NODELIST to detect")
            parser.add_argument("--mpi-without-master-addr", action="store_true", help="exercise 3")
        args = parse_args(__doc__, extra=options)
        show_detection(args.slurm_nodelist, args.mpi_without_master_addr)
        show_data_parallel()
        run(spawned, args.world_size)
