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

What to run
    python lessons/04_average_gradients.py [--world-size 4]

What to look at
    Rank 1 starts with different weights until the broadcast. Before
    averaging, each rank's gradient differs from the full-batch one; after,
    they agree to float rounding, and after 5 SGD steps the model equals one
    trained by a single process on the whole batch.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import parse_args, print0, print_ranks, run


class HandDDP(nn.Module):
    """The smallest data-parallel wrapper: sync weights once, gradients by hand."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        # Without this, each rank would train its own model from its own
        # random start; averaging gradients of different models means nothing.
        for p in self.module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        # Call after backward, before optimizer.step().
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= self.world_size


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def main(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # a different random model on every rank, on purpose
    model = make_model()
    first_weight = model[0].weight[0, 0].item()
    ddp = HandDDP(model)
    print0("first weight before and after the broadcast in HandDDP.__init__:")
    print_ranks(f"{first_weight:+.4f} -> {model[0].weight[0, 0].item():+.4f}")
    everyone = [None] * world_size
    dist.all_gather_object(everyone, model[0].weight[0, 0].item())
    assert len(set(everyone)) == 1, "after the broadcast all ranks hold rank 0's weights"

    # The reference: one process, the same start, the whole batch.
    single = copy.deepcopy(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1)

    per_rank = 8
    global_batch = per_rank * world_size
    data = torch.Generator().manual_seed(1234)  # same batches on every rank
    loss_fn = nn.CrossEntropyLoss()  # a mean over the batch: what makes averaging exact
    for step in range(5):
        x = torch.randn(global_batch, 20, generator=data)
        y = torch.randint(0, 4, (global_batch,), generator=data)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)

        opt.zero_grad()
        loss_fn(ddp(x[mine]), y[mine]).backward()
        local = [p.grad.clone() for p in ddp.parameters()]
        ddp.sync_gradients()

        opt_single.zero_grad()
        loss_fn(single(x), y).backward()
        full = [p.grad for p in single.parameters()]

        before, after = max_diff(local, full), max_diff([p.grad for p in ddp.parameters()], full)
        assert before > 1e-4, "a slice's gradient is not the full batch's"
        assert after < 1e-5, "averaged gradients equal the full batch's"
        if step == 0:
            print0(f"\nstep 0, max |grad - full-batch grad| over all weights ({per_rank} of {global_batch} samples each):")
            print_ranks(f"own slice only {before:.2e}   after sync_gradients {after:.2e}")
        opt.step()
        opt_single.step()

    drift = max_diff(ddp.parameters(), single.parameters())
    assert drift < 1e-5
    print0(f"\nafter 5 steps, max |weight - single-process weight| = {drift:.1e}")
    print0("checked: the broadcast aligned the models; each slice's gradient differs from")
    print0("         the full batch's; averaged, they match it; and the trained models match.")


if __name__ == "__main__":
    args = parse_args(__doc__)
    run(main, args.world_size)
