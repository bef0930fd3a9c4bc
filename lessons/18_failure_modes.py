"""Lesson 18: failure modes -- what breaks data parallelism, what it looks like, what to do.

What you will learn
    Data parallelism fails in a few typical ways, and most of them do not
    raise an error where the mistake is: a rank waits in a collective that
    its partners will never join, and the job just stops. This lesson makes
    each failure happen, on a process group with a short timeout (here a few
    seconds; torch's default is 30 minutes, and ``minddp.init_distributed``'s
    10 -- which is why a real hang looks like a frozen job, not an error), prints what you
    would see, and then the fix.

    1. Uneven inputs. Rank 0 has 3 batches, rank 1 has 2. Rank 0's third
       backward all-reduces a bucket that rank 1 never sends: it hangs until
       the timeout. Fix: ``with model.join():`` -- a rank that ran out of data
       answers the others' collectives with zeros (``minddp/join.py``), or
       make the shards even (``DistributedSampler`` pads, lesson 09).
    2. A parameter unused on one rank. Rank 1's forward skips a layer, so
       that layer's gradient never arrives and its bucket is never sent.
       MiniDDP raises on rank 1, naming the parameter; rank 0, which did send
       that bucket, waits for it until the timeout. Fix:
       ``MiniDDP(..., find_unused_parameters=True)`` -- missing gradients
       count as zero -- or make every rank use every parameter.
    3. A replica that drifts. One rank changes its weights outside the
       synchronized step (a step skipped or repeated, a ``load_state_dict``
       on rank 0 only). Nothing fails; the replicas just train apart.
       ``MiniDDP(..., check_sync_every=N)`` compares a checksum of every
       parameter and buffer every N steps and raises on *every* rank, naming
       the tensor. Fix: find the code that ran on some ranks only.

What to run
    python lessons/18_failure_modes.py [--world-size 3] [--timeout-s 1]

What to look at
    For each failure: the error each rank saw (first line), how long it
    took to appear, and the fixed run.

Try this
    1. Before running, predict for failure 1 which rank raises, and after
       how long. (Rank 0, the one with more data, after the timeout; rank 1
       finished its loop without noticing anything.)
    2. ``--timeout-s 1``: predict what changes. (Only the waits: each hang
       now ends after about one second.)
    3. In failure 2, predict the error if the *unused* layer came first in
       the model, i.e. its bucket would leave last. (The same: MiniDDP checks
       every bucket at the end of backward.)
"""

import datetime
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from minddp import MiniDDP
from minddp.replicas import ReplicaDesyncError
from _common import parse_args, print0, print_ranks, run


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.extra = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x, use_extra: bool = True):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.extra(h) if use_extra else 0)


def short_group(timeout_s: float):
    """A fresh group whose collectives give up after ``timeout_s`` (the default group keeps
    its long timeout, so the ranks can still meet after a failure)."""
    return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))


def attempt(fn) -> str:
    start = time.perf_counter()
    try:
        fn()
        return "finished, no error"
    except RuntimeError as error:
        first_line = re.sub(r"^\[[^\]]*\.cc:\d+\] ", "", str(error).strip().splitlines()[0])  # Gloo's source location
        return f"after {time.perf_counter() - start:4.1f} s: {type(error).__name__}: {first_line[:120]}"


def batches(n: int):
    gen = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randn(4, 8, generator=gen) for _ in range(n)]


def uneven_inputs(rank: int, timeout_s: float) -> None:
    print0("\n1. uneven inputs: rank 0 has 3 batches, every other rank 2")
    mine = batches(3 if rank == 0 else 2)
    model = MiniDDP(TwoHeads(), process_group=short_group(timeout_s))

    def train():
        for x in mine:
            model(x).sum().backward()
    outcome = attempt(train)
    print_ranks(outcome)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcome)
    assert "timed out" in everyone[0].lower() or "timeout" in everyone[0].lower(), everyone[0]
    assert all(o == "finished, no error" for o in everyone[1:])

    model = MiniDDP(TwoHeads())  # a healthy group again
    with model.join():
        for x in mine:
            model(x).sum().backward()
    weights = [None] * dist.get_world_size()
    dist.all_gather_object(weights, model.module.head.weight.sum().item())
    print0("   with model.join(): every rank finished its own batches; replicas identical afterwards:", len(set(weights)) == 1)
    assert len(set(weights)) == 1


def unused_parameter(rank: int, timeout_s: float) -> None:
    print0("\n2. a parameter unused on one rank: rank 1 skips the layer 'extra'")
    x = batches(1)[0]
    model = MiniDDP(TwoHeads(), process_group=short_group(timeout_s))
    outcome = attempt(lambda: model(x, use_extra=rank != 1).sum().backward())
    print_ranks(outcome)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcome)
    assert "extra.weight" in everyone[1] and "received no gradient" in everyone[1], everyone[1]
    assert "time" in everyone[0].lower(), everyone[0]

    model = MiniDDP(TwoHeads(), find_unused_parameters=True)
    model(x, use_extra=rank != 1).sum().backward()
    grad = torch.tensor(model.module.extra.weight.grad.abs().sum().item())
    dist.all_reduce(grad, op=dist.ReduceOp.MAX)
    print0(f"   with find_unused_parameters=True: no error; 'extra' got the average over the ranks that used it")
    assert grad.item() > 0


def drifting_replica(rank: int) -> None:
    print0("\n3. a replica that drifts: after step 1, rank 1 alone nudges a weight")
    model = MiniDDP(TwoHeads(), check_sync_every=1)
    x = batches(1)[0]
    model(x).sum().backward()
    if rank == 1:
        with torch.no_grad():
            model.module.head.bias += 1e-3  # say, an optimizer step taken twice here
    outcome = attempt(lambda: model(x).sum().backward())
    print_ranks(outcome)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcome)
    assert all("ReplicaDesyncError" in o and "head.bias" in o for o in everyone), everyone
    assert issubclass(ReplicaDesyncError, RuntimeError)
    print0("   every rank raised at the next forward, naming the tensor: nothing trained on apart")


def main(rank: int, world_size: int, timeout_s: float) -> None:
    print0(f"{world_size} ranks; the broken runs use a process group with a {timeout_s:g} s timeout")
    uneven_inputs(rank, timeout_s)
    unused_parameter(rank, timeout_s)
    drifting_replica(rank)
    print0("\nchecked: uneven inputs hung rank 0 until the timeout and join() fixed it; an unused")
    print0("         parameter raised on its rank, naming it, and hung the other until the timeout,")
    print0("         and find_unused_parameters fixed it; a drifting replica raised on every rank.")


if __name__ == "__main__":
    args = parse_args(__doc__, min_world_size=2, extra=lambda p: p.add_argument(
        "--timeout-s", type=float, default=3.0, help="timeout of the broken runs' process group"))
    run(main, args.world_size, args.timeout_s)
