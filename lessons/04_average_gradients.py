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
    python lessons/04_average_gradients.py [--world-size 3] [--no-broadcast] [--forget-divide]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    ``lessons/wrappers/hand_ddp.py``, this lesson's wrapper. Then the table:
    "start spread" is how far each rank's weights were from rank 0's right
    after wrapping; the errors compare with one process on the whole batch.
    Without averaging each rank follows its own slice; with HandDDP every
    column is at float rounding. The last two columns count the last step's
    communication: one all-reduce per parameter tensor, and the bytes each
    rank sends for them. (Counted, not timed: on a laptop the "network" is
    memory, and a clock shared with other programs would measure those.)

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict, then run ``--no-broadcast`` (HandDDP skips step 1): which
       columns go wrong, and do the ranks ever agree again?
    2. In ``finish_gradient_synchronization`` forget ``/= self.world_size``
       (``--forget-divide`` adds that wrapper, ``ForgotToDivide``, to the
       table). Predict the grad error.
    3. ``--world-size 3``: the errors stay at rounding level and the
       all-reduces per step stay 6. What grows, per all-reduce, that would
       make the step slower on a real network?
"""

import torch
import torch.distributed as dist

from _common import FEATURES, is_exact, make_model, parse_args, print0, print_results, run, train_and_compare
from wrappers.hand_ddp import HandDDP  # this lesson's wrapper, in a file of its own: read it first


class NoAveraging(HandDDP):
    """Each rank alone on its slice: what data parallelism must fix."""

    def finish_gradient_synchronization(self) -> None:
        pass


class ForgotToDivide(HandDDP):
    """Exercise 2: the all-reduce's sum, never divided by the world size."""

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if self.require_sync and p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def main(rank: int, world_size: int, args) -> None:
    broadcast = not args.no_broadcast
    variants = [
        ("no averaging (each rank alone)", lambda m: NoAveraging(m, broadcast)),
        ("HandDDP" + ("" if broadcast else " without broadcast"), lambda m: HandDDP(m, broadcast)),
    ]
    if args.forget_divide:
        variants.append(("HandDDP, forgot /= world_size", lambda m: ForgotToDivide(m, broadcast)))
    results = [train_and_compare(name, wrap, rank, world_size)[0] for name, wrap in variants]
    print0(f"{world_size} ranks, 8 samples each, 3 SGD steps; one process on all {8 * world_size} samples as reference:")
    print_results(results)
    print_ring_cost(results[1], world_size)

    alone, hand = results[:2]
    assert alone.grad_error > 1e-3 and not alone.ranks_agree, (
        f"a slice's gradient is not the full batch's: grad error above 1e-3 and ranks apart expected, "
        f"got {alone.grad_error:.1e}, ranks agree: {alone.ranks_agree}")
    if broadcast:
        assert is_exact(hand), f"HandDDP matches one process to float rounding (1e-5); got {hand}"
        print0("checked: the broadcast aligned the models; each slice's gradient differs from the")
        print0("         full batch's; averaged, they match it, and the trained models match;")
        print0(f"         HandDDP made one all-reduce per parameter tensor, and sent {ring_cost(world_size)[1]:.2f} x the gradients' bytes.")
    else:
        assert hand.start_spread > 1e-3 and hand.weight_error > 1e-3 and not hand.ranks_agree, (
            f"without the broadcast the ranks start apart and stay apart; got {hand}")
        print0("checked (--no-broadcast): the ranks started apart and stayed apart: averaged")
        print0("         gradients applied to different weights never make them meet.")
    if args.forget_divide:
        show_forgotten_division(rank, world_size, broadcast)


def ring_cost(world_size: int) -> tuple[int, float]:
    """One ring all-reduce on p ranks: (messages each rank sends one after another, bytes it sends per byte summed)."""
    return 2 * (world_size - 1), 2 * (world_size - 1) / world_size


def print_ring_cost(hand, world_size: int) -> None:
    messages, share = ring_cost(world_size)
    n_params = len(list(make_model(seed=0).parameters()))
    print0(f"each all-reduce, as a ring on p = {world_size} ranks: 2(p-1) = {messages} messages one after another "
           f"(each pays the link's latency), and each rank sends 2(p-1)/p = {share:.2f} x the tensor's bytes")
    assert hand.all_reduces == n_params, f"HandDDP all-reduces each of the {n_params} parameter tensors once per step; counted {hand.all_reduces}"
    gradient_bytes = sum(p.numel() * p.element_size() for p in make_model(seed=0).parameters())
    assert abs(hand.ring_bytes_sent - share * gradient_bytes) < 1e-6, (
        f"a ring sends {share:.3f} x the {gradient_bytes} gradient bytes; the table says {hand.ring_bytes_sent}")


def show_forgotten_division(rank: int, world_size: int, broadcast: bool) -> None:
    """One backward on the same data, with and without the division: a factor p, exactly."""
    x = torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(rank))  # each rank its slice
    grads = []
    for wrapper in (HandDDP, ForgotToDivide):
        ddp = wrapper(make_model(seed=0), broadcast)
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
        grads.append(ddp.module[0].weight.grad)
    averaged, summed = grads
    ratio = (summed.norm() / averaged.norm()).item()
    print0(f"\n--forget-divide: the first layer's gradient, one backward: norm {averaged.norm():.4f} averaged, "
           f"{summed.norm():.4f} summed: {ratio:.4f} times, and world size is {world_size}")
    assert torch.allclose(summed, world_size * averaged, rtol=1e-5, atol=1e-7), (
        f"the sum is world size ({world_size}) times the average; the norms' ratio was {ratio:.6f}")
    print0(f"checked (--forget-divide): the gradient came out {world_size} times the average: SGD with a "
           f"{world_size}x learning rate in disguise.")


def options(parser) -> None:
    parser.add_argument("--no-broadcast", action="store_true", help="skip the broadcast of rank 0's weights")
    parser.add_argument("--forget-divide", action="store_true", help="exercise 2: add a wrapper that never divides by p")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args)
