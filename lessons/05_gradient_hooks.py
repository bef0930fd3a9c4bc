"""Lesson 05: averaging inside backward, with hooks -- and two hooks that go wrong.

What you will learn
    Lesson 04 needed a ``sync_gradients()`` call after every backward. Here
    the wrapper asks autograd to call it: ``param.register_post_accumulate_grad_hook(fn)``
    runs ``fn(param)`` right after ``param.grad`` has been updated by this
    backward pass. The difference from lesson 04 is a dozen lines: hooks in
    ``__init__``, and a ``require_sync`` switch so that gradient
    *accumulation* (several backward passes, one optimizer step) can average
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
    python lessons/05_gradient_hooks.py [--world-size 4]

What to look at
    The table: for each variant, the largest difference from the
    single-process full-batch gradient, without and with accumulation.
    Only the post-accumulate hook is right in both columns.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import parse_args, print0, run


class HookDDP(nn.Module):
    """Lesson 04's HandDDP, with the averaging moved into backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False while accumulating micro-batches
        for p in self.module.parameters():
            dist.broadcast(p.data, src=0)
            if p.requires_grad:
                self._add_hook(p)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _add_hook(self, p: torch.Tensor) -> None:
        p.register_post_accumulate_grad_hook(self._average_grad)

    def _average_grad(self, param: torch.Tensor) -> None:
        # By now param.grad holds everything accumulated so far, this pass
        # included, so averaging it once at the end averages all of it.
        if self.require_sync:
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


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def gradient_error(wrapper_cls, micro_batches: int, rank: int, world_size: int) -> float:
    """Largest |grad - single-process full-batch grad| after one (accumulated) step."""
    torch.manual_seed(0)
    model = make_model()
    single = copy.deepcopy(model)
    ddp = wrapper_cls(model)

    per_rank = 8 * micro_batches
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(per_rank * world_size, 20, generator=data)
    y = torch.randint(0, 4, (per_rank * world_size,), generator=data)
    loss_fn = nn.CrossEntropyLoss()

    loss_fn(single(x), y).backward()

    mine_x, mine_y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    for i, (xb, yb) in enumerate(zip(mine_x.chunk(micro_batches), mine_y.chunk(micro_batches))):
        ddp.require_sync = i == micro_batches - 1  # communicate once, on the last
        # Divide by the number of micro-batches: the sum of k means of k
        # equal parts is k times the mean of the whole.
        (loss_fn(ddp(xb), yb) / micro_batches).backward()

    error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), single.parameters()))
    # Averaged gradients are the same on every rank; check that too.
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    spread = grads.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    ranks_agree = torch.equal(spread, grads)
    # Use the same numbers on every rank (mistake B leaves ranks disagreeing).
    t = torch.tensor([error, float(not ranks_agree)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[1].item() == 0.0


def main(rank: int, world_size: int) -> None:
    ok = 1e-5
    rows = []
    for cls, name in [
        (HookDDP, "post-accumulate hook (right)"),
        (TensorHookDDP, "A: Tensor.register_hook"),
        (ParamAsGradDDP, "B: hook(grad) that gets the param"),
    ]:
        (one, agree_one), (two, agree_two) = (gradient_error(cls, k, rank, world_size) for k in (1, 2))
        rows.append((name, one, two))
        if cls is ParamAsGradDDP:
            assert not agree_one and not agree_two, "mistake B leaves each rank with its own gradients"
        if cls is HookDDP:
            assert agree_one and agree_two

    print0("max |grad - full-batch grad| after one optimizer step's worth of backward:")
    print0(f"  {'variant':<36} {'1 micro-batch':>14} {'2 micro-batches':>16}")
    for name, one, two in rows:
        print0(f"  {name:<36} {one:>14.1e} {two:>16.1e}")

    (_, right_1, right_2), (_, a_1, a_2), (_, b_1, b_2) = rows
    assert right_1 < ok and right_2 < ok, "the post-accumulate hook is right with and without accumulation"
    assert a_1 < ok, "mistake A passes a test without accumulation..."
    assert a_2 > 1e-3, "...and silently breaks accumulation"
    assert b_1 > 1e-3 and b_2 > 1e-3, "mistake B never averages the gradients"
    print0(f"checked: only the post-accumulate hook is within {ok:g} in both columns;")
    print0("         mistake A is right without accumulation and wrong with it;")
    print0("         mistake B is wrong always: each rank kept its own gradients (it averaged")
    print0("         the weights instead).")


if __name__ == "__main__":
    args = parse_args(__doc__)
    run(main, args.world_size)
