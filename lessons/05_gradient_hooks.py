"""Lesson 05: averaging inside backward, with hooks -- and two hooks that go wrong.

What you will learn
    Lesson 04 needed a ``finish_gradient_synchronization()`` call after every
    backward. Here the wrapper asks autograd to do it:
    ``param.register_post_accumulate_grad_hook(fn)`` runs ``fn(param)``
    right after ``param.grad`` has been updated by this backward pass. The
    difference from lesson 04 is a few lines: a hook per parameter in
    ``__init__``, reading the same ``require_sync`` switch, so that gradient
    *accumulation* (several backward passes, one optimizer step) averages
    only once, after the last micro-batch.

    Two mistakes people really make, run here and caught:
    A. ``param.register_hook(fn)`` (a hook on the *tensor*) fires *before*
       the gradient is added to ``param.grad``, and ``fn`` sees only this
       pass's gradient. Without accumulation it looks perfect. With
       accumulation it averages the last micro-batch's gradient only; the
       earlier micro-batches stay un-averaged in ``.grad``. No error, just a
       wrong model, slowly.
    B. A post-accumulate hook receives the *parameter*, not the gradient.
       Write it as ``def hook(grad): all_reduce(grad)`` and you all-reduce
       the weights; the gradients are never averaged.

What to run
    python lessons/05_gradient_hooks.py [--world-size 3] [--micro-batches 4] [--sync-every-micro-batch]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    ``diff lessons/wrappers/hand_ddp.py lessons/wrappers/hook_ddp.py``: the
    whole idea. Then the table, once with one backward per step and once
    with two micro-batches: only the post-accumulate hook is right in both,
    and its all-reduces per step stay one per parameter. Then
    mistake B made visible: rank r's weight is nudged by r, one backward
    runs, and the weights come out averaged while the gradients do not.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Before running, predict which rows of the two tables are exact.
    2. ``--micro-batches 4``: mistake A now averages 1 micro-batch of 4
       instead of 1 of 2. Predict whether its ranks end up agreeing.
    3. In ``HookDDP._average_grad`` remove the ``require_sync`` test
       (``--sync-every-micro-batch`` adds that hook to the tables) and
       predict the grad error with accumulation.
"""

import torch
import torch.distributed as dist

from _common import FEATURES, is_exact, make_model, parse_args, print0, print_ranks, print_results, run, train_and_compare
from wrappers.hook_ddp import HookDDP  # this lesson's wrapper: diff it with wrappers/hand_ddp.py


class SyncEveryMicroBatch(HookDDP):
    """Exercise 3: the require_sync test removed -- every backward averages."""

    def _average_grad(self, param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= self.world_size


class TensorHookDDP(HookDDP):
    """Mistake A: a hook on the tensor, which runs before accumulation."""

    def _add_hook(self, p: torch.Tensor) -> None:
        p.register_hook(self._average_this_pass)

    def _average_this_pass(self, grad: torch.Tensor) -> torch.Tensor:
        # `grad` is this backward pass's gradient only; autograd adds the
        # returned tensor to param.grad *after* this hook returns.
        if self.require_sync:
            grad = grad.clone()
            dist.all_reduce(grad)
            grad /= self.world_size
        return grad


class ParamAsGradDDP(HookDDP):
    """Mistake B: a post-accumulate hook that believes it gets the gradient."""

    def _average_grad(self, grad: torch.Tensor) -> None:  # really the parameter!
        if self.require_sync:
            dist.all_reduce(grad.data)  # .data: autograd forbids in-place on a leaf
            grad.data /= self.world_size


def show_mistake_b(rank: int) -> None:
    ddp = ParamAsGradDDP(make_model(seed=0))
    weight = ddp.module[-1].weight
    with torch.no_grad():
        weight[0, 0] += rank  # rank r's replica drifts by r
    before = weight[0, 0].item()
    x = torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    ddp(x).sum().backward()
    after, grad = weight[0, 0].item(), weight.grad[0, 0].item()
    print0("\nmistake B made visible: rank r adds r to one weight, then one backward:")
    print_ranks(f"weight {before:+.4f} -> {after:+.4f}   its gradient {grad:+.4f} (never averaged)")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (before, after))
    mean = sum(b for b, _ in everyone) / len(everyone)
    assert all(abs(a - mean) < 1e-6 for _, a in everyone), "backward averaged the weights"


def main(rank: int, world_size: int, args) -> None:
    variants = [
        ("post-accumulate hook (right)", HookDDP),
        ("A: Tensor.register_hook", TensorHookDDP),
        ("B: hook(grad) that gets the param", ParamAsGradDDP),
    ]
    if args.sync_every_micro_batch:
        variants.append(("hook without the require_sync test", SyncEveryMicroBatch))
    tables = {}
    for k in (1, args.micro_batches):
        tables[k] = [train_and_compare(name, wrap, rank, world_size, micro_batches=k)[0] for name, wrap in variants]
        print0(f"\n{k} micro-batch(es) per step, 8 samples each, on {world_size} ranks:")
        print_results(tables[k])
    show_mistake_b(rank)

    (right_1, a_1, b_1, *_), (right_k, a_k, b_k, *_) = tables[1], tables[args.micro_batches]
    assert is_exact(right_1) and is_exact(right_k), "the post-accumulate hook is right with and without accumulation"
    assert is_exact(a_1), "mistake A passes a test without accumulation..."
    assert a_k.grad_error > 1e-3, "...and silently breaks accumulation"
    assert b_1.grad_error > 1e-3 and b_k.grad_error > 1e-3, "mistake B never averages the gradients"
    n_params = len(list(make_model(seed=0).parameters()))
    assert right_1.all_reduces == right_k.all_reduces == n_params, (
        f"the post-accumulate hook all-reduces each of the {n_params} parameters once per step, accumulating "
        f"or not; counted {right_1.all_reduces} and {right_k.all_reduces}")
    print0("checked: only the post-accumulate hook is exact in both tables; mistake A is right")
    print0("         without accumulation and wrong with it; mistake B is wrong always: its")
    print0("         hook averaged the weights (shown above) and left the gradients alone;")
    print0(f"         the right hook made {n_params} all-reduces per step, with or without accumulation.")
    if args.sync_every_micro_batch:
        every_k = tables[args.micro_batches][-1]
        assert is_exact(every_k), f"averaging every micro-batch is still exact (averaging is linear); got {every_k}"
        assert every_k.all_reduces == n_params * args.micro_batches, (
            f"{n_params} parameters x {args.micro_batches} backward passes = {n_params * args.micro_batches} "
            f"all-reduces per step expected, {every_k.all_reduces} counted")
        print0(f"checked (--sync-every-micro-batch): without the require_sync test the result stays exact,")
        print0(f"         but with {args.micro_batches} micro-batches each step made {args.micro_batches} x "
               f"{n_params} all-reduces instead of {n_params}.")


def options(parser) -> None:
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step in the second table")
    parser.add_argument("--sync-every-micro-batch", action="store_true",
                        help="exercise 3: add a hook that averages after every micro-batch")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    if args.micro_batches < 2:
        raise SystemExit("--micro-batches must be 2 or more: the second table is about accumulation")
    run(main, args.world_size, args)
