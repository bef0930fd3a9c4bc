"""Lesson 18: failure modes -- what breaks data parallelism, what it looks like, what to do.

What you will learn
    Data parallelism fails in a few typical ways, and most of them do not
    raise an error where the mistake is: a rank waits in a collective that
    its partners will never join, and the job just stops. This lesson makes
    each failure happen, on a process group with a short timeout (here a few
    seconds; torch's default is 30 minutes for Gloo and 10 for NCCL --
    ``torch.distributed.constants.default_pg_timeout`` and
    ``default_pg_nccl_timeout`` -- and ``minddp.init_distributed``'s is 10,
    which is why a real hang looks like a frozen job, not an error), prints
    what you would see, and then the fix.

    1. Uneven inputs. Rank 0 has 3 batches, rank 1 has 2. Rank 0's third
       backward all-reduces a bucket that rank 1 never sends: it hangs until
       the timeout. Fix: ``with model.join():`` -- a rank that ran out of data
       answers the others' collectives with zeros (``minddp/ddp/parts/uneven_inputs.py``), or
       make the shards even (``DistributedSampler`` pads, lesson 09).
    2. A parameter unused on one rank. Rank 1's forward skips a layer, so
       that layer's gradient never arrives and its bucket is never sent.
       MiniDDP raises on rank 1, naming the parameter; rank 0, which did send
       that bucket, waits for it until the timeout. Fix:
       ``MiniDDP(..., find_unused_parameters=True)`` -- missing gradients
       count as zero -- or make every rank use every parameter. Mind what
       the fix averages: the layer gets the sum of its gradients over *all*
       p ranks divided by p (rank 1 counted as a zero), not the mean over
       the ranks that used it. torch's DDP does the same; the lesson checks
       both against that formula.
    3. A replica that drifts. One rank changes its weights outside the
       synchronized step (a step skipped or repeated, a ``load_state_dict``
       on rank 0 only). Nothing fails; the replicas just train apart.
       ``MiniDDP(..., check_sync_every=N)`` compares a checksum of every
       parameter and buffer every N steps and raises on *every* rank, naming
       the tensor. Fix: find the code that ran on some ranks only.

What to run
    python lessons/18_failure_modes.py [--world-size 3] [--timeout-s 1] [--extra-first]

    It needs two ranks at least (one to fail, one to wait) and says so in
    one line when given ``--world-size 1``.

What to look at
    For each failure: the error each rank saw (its first line, whole), how
    long it took to appear, and the fixed run.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Before running, predict for failure 1 which rank raises, and after
       how long.
    2. ``--timeout-s 1``: predict what changes.
    3. ``--extra-first`` registers the *unused* layer first in the model,
       so its gradients would come last in the bucket order: predict the
       error of failure 2.
"""

import datetime
import re
import sys
import textwrap
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.nn.parallel import DistributedDataParallel

from minddp import MiniDDP
from minddp.ddp.replicas import ReplicaDesyncError
from _common import c_stderr, parse_args, print0, print_ranks, run, short_group


class TwoHeads(nn.Module):
    extra_first = False  # --extra-first: register 'extra' before the others

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        if self.extra_first:
            self.extra, self.body, self.head = nn.Linear(8, 2), nn.Linear(8, 8), nn.Linear(8, 2)
        else:
            self.body, self.head, self.extra = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x, use_extra: bool = True):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.extra(h) if use_extra else 0)


def attempt(fn) -> str:
    start = time.perf_counter()
    try:
        fn()
        return "finished, no error"
    except RuntimeError as error:
        first_line = re.sub(r"^\[[^\]]*\.cc:\d+\] ", "", str(error).strip().splitlines()[0])  # Gloo's source location
        said = f"after {time.perf_counter() - start:4.1f} s: {type(error).__name__}: {first_line}"
        return textwrap.fill(said, width=100, subsequent_indent=" " * 11)  # the whole line, wrapped


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

    used = rank != 1
    model = MiniDDP(TwoHeads(), find_unused_parameters=True)
    model(x, use_extra=used).sum().backward()
    # torch warns on the ranks that used every parameter ("did not find any
    # unused parameters"): its flag is per run, the unused layer per rank.
    theirs = DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    said = c_stderr(lambda: theirs(x, use_extra=used).sum().backward())
    warned = [None] * dist.get_world_size()
    dist.all_gather_object(warned, "did not find any unused parameters" in said)
    users_ranks = [r for r in range(dist.get_world_size()) if r != 1]
    assert [r for r, w in enumerate(warned) if w] == users_ranks, f"torch warned on {warned}, expected {users_ranks}"
    if rank == 0:
        print(said.rstrip(), file=sys.stderr, flush=True)  # torch's own words, as it printed them
    print0(f"   (that Warning is torch's DDP on rank(s) {users_ranks}, those that used every parameter in this backward:")
    print0("   find_unused_parameters is one flag for every rank, and there its extra walk of the autograd graph")
    print0("   found nothing unused. Harmless here: rank 1 needs the flag)")
    # The formula, from each rank's own gradient (zero where 'extra' was unused).
    alone = TwoHeads()
    alone(x, use_extra=used).sum().backward()
    total = alone.extra.weight.grad if used else torch.zeros_like(alone.extra.weight)
    dist.all_reduce(total)
    p, users = dist.get_world_size(), dist.get_world_size() - 1
    over_all, over_users = total / p, total / users
    mine, torchs = model.module.extra.weight.grad, theirs.module.extra.weight.grad
    # float32 sums of a few numbers in another order: equal to rounding.
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    print0(f"   with find_unused_parameters=True: no error; 'extra' got the sum of its gradients over all {p} ranks")
    print0(f"   divided by {p} (rank 1 counted as zero), not the mean over the {users} rank(s) that used it; torch's DDP")
    print0(f"   the same: |MiniDDP - formula| {(mine - over_all).abs().max():.1e}, |torch - formula| "
           f"{(torchs - over_all).abs().max():.1e}, |formula - mean over users| {(over_all - over_users).abs().max():.1e}")
    expected = f"sum over all ranks / {p} = {over_all.flatten()[:4].tolist()}"
    assert close(mine, over_all), f"MiniDDP: expected {expected}, saw {mine.flatten()[:4].tolist()}"
    assert close(torchs, over_all), f"torch's DDP: expected {expected}, saw {torchs.flatten()[:4].tolist()}"
    assert not close(over_all, over_users), "the two averages should differ"


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


def main(rank: int, world_size: int, timeout_s: float, extra_first: bool = False) -> None:
    TwoHeads.extra_first = extra_first
    print0(f"{world_size} ranks; the broken runs use a process group with a {timeout_s:g} s timeout")
    print0(f"(torch's defaults: {default_pg_timeout} for Gloo, {default_pg_nccl_timeout} for NCCL)")
    assert default_pg_timeout == datetime.timedelta(minutes=30), f"expected Gloo's 30 min, saw {default_pg_timeout}"
    assert default_pg_nccl_timeout in (None, datetime.timedelta(minutes=10)), f"expected NCCL's 10 min, saw {default_pg_nccl_timeout}"
    uneven_inputs(rank, timeout_s)
    unused_parameter(rank, timeout_s)
    drifting_replica(rank)
    print0("\nchecked: uneven inputs hung rank 0 until the timeout and join() fixed it; an unused")
    print0("         parameter raised on its rank, naming it, and hung the other until the timeout,")
    print0("         and find_unused_parameters fixed it; a drifting replica raised on every rank.")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--timeout-s", type=float, default=3.0, help="timeout of the broken runs' process group")
        parser.add_argument("--extra-first", action="store_true", help="register the unused layer first")
    args = parse_args(__doc__, min_world_size=2, extra=options)
    run(main, args.world_size, args.timeout_s, args.extra_first)
