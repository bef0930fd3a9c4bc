"""Lesson 04: data parallelism by hand -- average the gradients after backward.

What you will learn
    Data parallelism in one idea: every rank holds the same model, takes a
    different slice of the batch, computes its gradients, and the ranks
    *average* them before the optimizer step. Because the loss is a mean over
    the batch, the mean of the per-slice gradients is exactly the gradient of
    the whole batch (when slices have equal size). So p ranks on slices of B/p
    compute the same step as one process on B.

    Two things make it work, and this lesson's ``HandDDP`` does both:
    1. all ranks start from the same weights (broadcast rank 0's at start),
    2. after ``backward()``, ``all_reduce`` every ``.grad`` and divide by p.
    And one switch, ``require_sync``, kept through lesson 08: set it to False
    while *accumulating* several micro-batches into one step, so that only
    the last backward pays for communication (lesson 11's ``no_sync``).

    Lessons 04 to 08 share one test bench (``_common.train_and_compare``):
    every rank starts from its *own* random weights, trains a few SGD steps
    on its slice, and is compared with one process training on the whole
    batch. Only the wrapper changes from lesson to lesson.

What to run
    python lessons/04_average_gradients.py [--world-size 4] [--no-broadcast]

What to look at
    The table: "start spread" is how far each rank's weights were from rank
    0's right after wrapping; the errors compare with one process on the
    whole batch. Without averaging each rank follows its own slice; with
    HandDDP every column is at float rounding.

Try this
    1. Predict, then run ``--no-broadcast`` (HandDDP skips step 1): which
       columns go wrong, and do the ranks ever agree again? (Answer, checked
       by the lesson: the spread stays, the weights never meet -- the same
       averaged update applied to different starting points keeps them
       apart forever.)
    2. In ``finish_gradient_synchronization`` forget ``/= self.world_size``.
       Predict the grad error. (The gradient is p times too large: a p-times
       larger learning rate in disguise.)
    3. ``--world-size 4``: the errors stay at rounding level; why does the
       step time grow?
"""

import torch.distributed as dist
import torch.nn as nn

from _common import is_exact, parse_args, print0, print_results, run, train_and_compare


class HandDDP(nn.Module):
    """The smallest data-parallel wrapper: sync weights once, gradients by hand."""

    def __init__(self, module: nn.Module, broadcast: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False while accumulating micro-batches
        # Without this, each rank would train its own model from its own
        # random start; averaging gradients of different models means nothing.
        if broadcast:
            for p in self.module.parameters():
                dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        # Called after backward, before optimizer.step().
        if not self.require_sync:
            return
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= self.world_size


class NoAveraging(HandDDP):
    """Each rank alone on its slice: what data parallelism must fix."""

    def finish_gradient_synchronization(self) -> None:
        pass


def main(rank: int, world_size: int, args) -> None:
    broadcast = not args.no_broadcast
    variants = [
        ("no averaging (each rank alone)", lambda m: NoAveraging(m, broadcast)),
        ("HandDDP" + ("" if broadcast else " without broadcast"), lambda m: HandDDP(m, broadcast)),
    ]
    results = [train_and_compare(name, wrap, rank, world_size)[0] for name, wrap in variants]
    print0(f"{world_size} ranks, 8 samples each, 3 SGD steps; one process on all {8 * world_size} samples as reference:")
    print_results(results)

    alone, hand = results
    assert alone.grad_error > 1e-3 and not alone.ranks_agree, "a slice's gradient is not the full batch's"
    if broadcast:
        assert is_exact(hand), hand
        print0("checked: the broadcast aligned the models; each slice's gradient differs from the")
        print0("         full batch's; averaged, they match it, and the trained models match.")
    else:
        assert hand.start_spread > 1e-3 and hand.weight_error > 1e-3 and not hand.ranks_agree, hand
        print0("checked (--no-broadcast): the ranks started apart and stayed apart: averaged")
        print0("         gradients applied to different weights never make them meet.")


def options(parser) -> None:
    parser.add_argument("--no-broadcast", action="store_true", help="skip the broadcast of rank 0's weights")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args)
