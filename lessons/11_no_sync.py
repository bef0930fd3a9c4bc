"""Lesson 11: gradient accumulation with ``no_sync()``.

What you will learn
    To train with a global batch larger than memory allows, run k
    micro-batches forward and backward and step once: gradients add up in
    ``.grad``. Under data parallelism, averaging after every micro-batch
    would be correct (averaging is linear) but wasteful: k all-reduces where
    one suffices. ``with ddp.no_sync():`` switches communication off;
    the first backward outside it averages everything accumulated so far.
    This is the ``require_sync`` switch of lessons 04-07b, as a context
    manager. (nanoGPT instead sets torch's attribute
    ``model.require_backward_grad_sync = (last micro-batch)`` directly:
    the same switch, read at the same moment.)

    One trap, as in torch's DDP: the switch is read at *forward*. The
    forward must run inside the ``with`` block; a forward outside it and a
    backward inside still communicates.

    To count messages this lesson plugs a *communication hook* into
    MiniDDP (torch's contract: ``hook(state, bucket) -> Future[Tensor]``);
    lesson 13 uses the same door to compress gradients.

What to run
    python lessons/11_no_sync.py [--world-size 4] [--forward-outside]

What to look at
    All-reduces per optimizer step with and without ``no_sync``, and that
    both give the gradients of one process on the whole global batch.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict the number of all-reduces per optimizer step for k = 4
       micro-batches, with and without ``no_sync``.
    2. ``--forward-outside``: the forward runs before the ``with`` block,
       only the backward inside it. Predict the count and the gradients.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from minddp import MiniDDP
from _common import parse_args, print0, run


def counting_allreduce(state: dict, bucket) -> torch.futures.Future:
    """The plain average, plus a tally: what a comm hook must do at minimum."""
    state["calls"] += 1
    buffer = bucket.buffer().div_(dist.get_world_size())  # the hook does the averaging
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def accumulate(use_no_sync: bool, k: int, rank: int, world_size: int, forward_outside=False):
    torch.manual_seed(0)
    model = make_model()
    single = copy.deepcopy(model)
    # A few buckets, to count, cut at the cap from the first backward on (by default the first
    # backward sends one bucket, torch's first guess, and only then learns the order and cuts).
    ddp = MiniDDP(model, bucket_cap_mb=0.01, learn_bucket_order=False)
    state = {"calls": 0}
    ddp.register_comm_hook(state, counting_allreduce)

    per_micro = 8
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(per_micro * k * world_size, 20, generator=gen)
    y = torch.randint(0, 4, (per_micro * k * world_size,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    mine_x = x.view(world_size, k, per_micro, 20)[rank]
    mine_y = y.view(world_size, k, per_micro)[rank]

    for i in range(k):
        last = i == k - 1
        if use_no_sync and not last:
            if forward_outside:
                loss = loss_fn(ddp(mine_x[i]), mine_y[i]) / k
                with ddp.no_sync():
                    loss.backward()  # too late: the forward already decided to sync
            else:
                with ddp.no_sync():
                    (loss_fn(ddp(mine_x[i]), mine_y[i]) / k).backward()
        else:
            (loss_fn(ddp(mine_x[i]), mine_y[i]) / k).backward()

    loss_fn(single(x), y).backward()
    error = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), single.parameters()))
    return state["calls"], len(ddp.bucket_names), error


def main(rank: int, world_size: int, forward_outside: bool = False) -> None:
    k = 4
    calls_every, buckets, err_every = accumulate(False, k, rank, world_size)
    calls_once, _, err_once = accumulate(True, k, rank, world_size)
    if forward_outside:
        calls_wrong, _, err_wrong = accumulate(True, k, rank, world_size, forward_outside=True)
    else:
        calls_wrong, err_wrong = k * buckets, 0.0  # the trap is shown with --forward-outside

    print0(f"{k} micro-batches per step, {buckets} buckets; all-reduces per optimizer step:")
    print0(f"  sync after every micro-batch        {calls_every:>3}   max |grad - full batch| {err_every:.1e}")
    print0(f"  no_sync() for the first {k - 1}           {calls_once:>3}   max |grad - full batch| {err_once:.1e}")
    if forward_outside:
        print0(f"  forward outside no_sync (the trap)  {calls_wrong:>3}   max |grad - full batch| {err_wrong:.1e}")
    counts = (calls_every, calls_once, calls_wrong)
    assert counts == (k * buckets, buckets, k * buckets), f"expected all-reduces {(k * buckets, buckets, k * buckets)}, saw {counts}"
    errors = (err_every, err_once, err_wrong)
    assert max(errors) < 1e-5, f"expected every variant within 1e-5 of the full-batch gradients, saw {errors}"
    print0(f"checked: all give the full-batch gradients; no_sync cut communication {k}-fold"
           + (";\n         with the forward outside the block, no_sync did nothing." if forward_outside else "."))


if __name__ == "__main__":
    args = parse_args(__doc__, extra=lambda p: p.add_argument(
        "--forward-outside", action="store_true", help="run the forward outside no_sync (the trap)"))
    run(main, args.world_size, args.forward_outside)
