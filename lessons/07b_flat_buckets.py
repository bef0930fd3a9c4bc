"""Lesson 07b: the last mile to a real DDP -- persistent buckets, a callback, a learned order.

What you will learn
    Lesson 07's ``BucketDDP`` works, but a real DDP does five things more,
    and this lesson's ``FlatDDP`` adds each one (the numbers mark them in
    the code: ``diff lessons/wrappers/bucket_ddp.py lessons/wrappers/flat_ddp.py``). After it, lesson 08's ``MiniDDP`` is the same wrapper,
    packaged, and checked against torch's DDP.

    1. Persistent flat buckets with views. Lesson 07 built a new flat tensor
       with ``torch.cat`` every step and copied it back. Here each bucket's
       buffer is allocated once; every parameter owns a *view* into it (a
       slice shaped like the parameter), and the hook copies its gradient
       straight into that slot.
    2. Divide before the sum. The copy into the slot multiplies by 1/p, so
       the all-reduce adds averages' parts: in float16 the sum of p
       gradients can overflow where p parts of the average cannot.
    3. An end-of-backward callback. ``Variable._execution_engine.queue_callback(fn)``
       asks autograd to call ``fn`` once this backward pass is over; it
       waits for the buckets and writes ``.grad``. No
       ``finish_gradient_synchronization()`` to forget: when
       ``loss.backward()`` returns, the gradients are averaged.
    4. Buffers too. The broadcast at construction covers ``module.buffers()``
       (BatchNorm's running statistics), not only parameters.
    5. Rebuilding buckets. Reverse registration order is only a guess at the
       order gradients arrive. After the first backward, rank 0's observed
       order is broadcast and every rank rebuilds the same buckets from it.

What to run
    python lessons/07b_flat_buckets.py [--world-size 3] [--keep-order] [--sum-not-average]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    The buckets of a model that registers its head first, before and after
    the first backward (the learned order puts the head first; within a
    layer the bias's gradient arrives before the weight's), and the test
    bench's table: exact, with and without accumulation.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict: after the rebuild, does the head's weight or bias come
       first?
    2. ``--keep-order`` skips step 5: predict what changes in the table.
    3. Remove the ``1 / self.world_size`` of step 2 (``--sum-not-average``
       adds that wrapper, ``SumsInstead``, to the table) and predict the
       grad error.
"""

import torch
import torch.nn as nn

from _common import FEATURES, is_exact, make_model, parse_args, print0, print_results, run, train_and_compare
from wrappers.flat_ddp import FlatDDP  # this lesson's wrapper: diff it with wrappers/bucket_ddp.py


class SumsInstead(FlatDDP):
    """Exercise 3: step 2 forgotten -- every rank adds its full gradient."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.factor = 1.0


class HeadFirst(nn.Module):
    """A model whose registration order is not its execution order: the head is
    registered first but computed last, so its gradients arrive first."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 4)
        self.body = nn.Linear(20, 64)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def main(rank: int, world_size: int, args) -> None:
    cap = 2 * 1024  # HeadFirst has 6,416 bytes of gradients: 2 KB makes several buckets of them
    ddp = FlatDDP(HeadFirst(), cap, learn_order=not args.keep_order)
    guess = ddp.bucket_names()
    ddp(torch.randn(8, 20)).sum().backward()
    print0(f"HeadFirst registers head, then body; buckets of at most {cap // 1024} KB, in launch order:")
    print0(f"  first guess, reverse registration: {guess}")
    print0(f"  after the first backward:          {ddp.bucket_names()}")
    print0("  (buckets leave in order: under the guess the first holds body gradients, which come last,")
    print0("   so nothing can leave before backward ends" + (")" if args.keep_order else "; after the rebuild the head's bucket leaves first)"))

    results = [train_and_compare(f"FlatDDP, {k} micro-batch(es)", lambda m: FlatDDP(m, cap, learn_order=not args.keep_order),
                                 rank, world_size, micro_batches=k)[0] for k in (1, 2)]
    if args.sum_not_average:
        summed = train_and_compare("SumsInstead (no 1/p)", lambda m: SumsInstead(m, cap), rank, world_size)[0]
    print0(f"\n{world_size} ranks on the test bench:")
    print_results(results + ([summed] if args.sum_not_average else []))

    assert all(is_exact(r) for r in results), f"every row exact expected, got {results}"
    assert len(guess) > 1, f"a cap of {cap} bytes should split HeadFirst into several buckets, got {guess}"
    assert guess[0][0].startswith("body"), f"reverse registration puts the body first; got {guess}"
    if args.keep_order:
        assert ddp.bucket_names() == guess, f"--keep-order keeps the first guess {guess}; got {ddp.bucket_names()}"
    else:
        order = [n for b in ddp.bucket_names() for n in b]
        assert order == ["head.bias", "head.weight", "body.bias", "body.weight"], f"the arrival order expected, got {order}"
    if args.sum_not_average:
        show_sum(rank, world_size, cap)
    print0("checked: exact with and without accumulation, with no call after backward;")
    print0("         " + ("the buckets kept the first guess." if args.keep_order else
                         "the rebuilt buckets follow the real order: each layer's bias, then its weight."))


def show_sum(rank: int, world_size: int, cap: float) -> None:
    """One backward on the same data, with and without the 1/p: a factor p."""
    x = torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(rank))  # each rank its slice
    grads = []
    for wrapper in (FlatDDP, SumsInstead):
        ddp = wrapper(make_model(seed=0), cap)
        ddp(x).sum().backward()  # the end-of-backward callback writes .grad
        grads.append(ddp.module[0].weight.grad)
    want, got = grads
    ratio = (got.norm() / want.norm()).item()
    print0(f"\n--sum-not-average: the first layer's gradient norm {got.norm():.4f} against the average's "
           f"{want.norm():.4f}: {ratio:.4f} times, with {world_size} ranks")
    assert torch.allclose(got, world_size * want, rtol=1e-5, atol=1e-7), (
        f"without 1/p each rank adds full gradients: {world_size} times the average expected, {ratio:.6f} times seen")
    print0(f"checked (--sum-not-average): the buckets held the sum, {world_size} times the average.")


def options(parser) -> None:
    parser.add_argument("--keep-order", action="store_true", help="skip rebuilding the buckets in arrival order")
    parser.add_argument("--sum-not-average", action="store_true", help="exercise 3: add a FlatDDP without the 1/p")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args)
