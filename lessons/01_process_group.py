"""Lesson 01: how processes find each other.

What you will learn
    Distributed training is several ordinary Python processes that agree to
    talk. Before any tensor moves, each one must know three things:

    * where to meet: ``MASTER_ADDR`` and ``MASTER_PORT``, the address of a
      small key-value store that rank 0 opens and everyone else connects to;
    * how many will come: the *world size*;
    * who it is: its *global rank*, 0 .. world_size-1.

    On a cluster you also meet the *node rank* (which machine) and the
    *local rank* (which process on that machine; it picks the GPU). With
    ``nproc_per_node`` processes on every machine:
    ``global_rank = node_rank * nproc_per_node + local_rank``.

What to run
    python lessons/01_process_group.py                 # 2 processes
    python lessons/01_process_group.py --world-size 4  # 2 pretend nodes x 2

    This file is its own launcher: it starts ``world_size`` copies of itself
    with those environment variables set, exactly as torchrun or SLURM would
    (lesson 15). You can also be the launcher yourself, in two terminals:

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2 RANK=0 python lessons/01_process_group.py --child
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2 RANK=1 python lessons/01_process_group.py --child

    and watch the first wait inside ``init_process_group`` until the second
    arrives.

What to look at
    The table rank 0 prints: every process read a different RANK, they all
    agree on the world size, and the node/local ranks recombine into the
    global rank.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. ``--world-size 6``: predict the node and local rank of global rank 4.
    2. Start only the first of the two ``--child`` commands above and
       predict what it does.
    3. Start the two children with ``WORLD_SIZE=3`` and predict.
"""

import argparse
import os
import socket
import subprocess
import sys
import time


def child() -> None:
    # torch is imported only here: the launcher needs none of it, which is
    # the point -- a launcher only starts processes and sets variables.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    start = time.perf_counter()
    # No address, rank or size in the call: with the default "env://"
    # method, init_process_group reads MASTER_ADDR, MASTER_PORT, RANK and
    # WORLD_SIZE from the environment. It blocks until all WORLD_SIZE
    # processes have connected to the store at MASTER_ADDR:MASTER_PORT.
    dist.init_process_group(backend="gloo")
    waited = time.perf_counter() - start

    rank, world_size = dist.get_rank(), dist.get_world_size()
    # LOCAL_RANK/NODE_RANK are not needed by torch.distributed itself; they
    # are for you: the local rank picks this process's GPU on its machine.
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    node_rank = int(os.environ.get("NODE_RANK", 0))
    nproc_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    assert rank == int(os.environ["RANK"]), "the group's rank is the RANK we were given"
    assert rank == node_rank * nproc_per_node + local_rank

    # The first collective of the course: everyone sends a small record and
    # everyone receives all of them, in rank order (lesson 02 has more).
    me = dict(rank=rank, world_size=world_size, node=node_rank, local=local_rank, pid=os.getpid(), waited=waited)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, me)

    if rank == 0:
        print(f"{world_size} processes joined one group:")
        print("  global rank | node rank | local rank |    pid | waited in init_process_group")
        for r in everyone:
            print(f"  {r['rank']:>11} | {r['node']:>9} | {r['local']:>10} | {r['pid']:>6} | {r['waited']:.2f} s")
        assert [r["rank"] for r in everyone] == list(range(world_size))
        assert all(r["world_size"] == world_size for r in everyone)
        assert len({r["pid"] for r in everyone}) == world_size
        print("checked: ranks are exactly 0..world_size-1, each a different process,")
        print("         all agree on the world size, and rank = node * nproc_per_node + local.")
    dist.destroy_process_group()


def free_port() -> int:
    # Port 0 asks the OS for any free port; we then hand it to every child.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int) -> None:
    # Pretend to have two machines when the processes split evenly.
    nnodes = 2 if world_size % 2 == 0 else 1
    nproc_per_node = world_size // nnodes
    port = free_port()
    print(f"launcher: {nnodes} pretend node(s) x {nproc_per_node} process(es), meeting at 127.0.0.1:{port}")
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            NODE_RANK=str(rank // nproc_per_node),
            LOCAL_RANK=str(rank % nproc_per_node),
            LOCAL_WORLD_SIZE=str(nproc_per_node),
        )
        procs.append(subprocess.Popen([sys.executable, __file__, "--child"], env=env))
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0] * world_size, f"some rank failed: exit codes {codes}"
    print("launcher: every process exited with code 0")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Lesson 01: how processes find each other")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--child", action="store_true", help="be one rank (reads RANK etc. from the environment)")
    parser.add_argument("--reveal", action="store_true", help="print the answers to this lesson's Try this, and stop")
    args = parser.parse_args()
    if args.reveal:
        from _answers import reveal

        print(reveal(__doc__))
        parser.exit(0)
    child() if args.child else launch(args.world_size)
