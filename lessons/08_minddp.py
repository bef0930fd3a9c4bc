"""Lesson 08: ``minddp.MiniDDP`` -- lessons 04 to 07 in one class, checked against torch.

What you will learn
    ``MiniDDP`` is the wrapper you grew in lessons 04-07, finished:

    * at construction it broadcasts rank 0's parameters *and buffers*
      (lesson 04 forgot buffers: BatchNorm's running statistics);
    * post-accumulate hooks (lesson 05) copy each gradient into a flat bucket
      (lesson 07), already divided by the world size;
    * full buckets are all-reduced asynchronously, strictly in order, while
      backward goes on (lesson 06);
    * the end-of-backward wait is queued on autograd's engine, so there is
      no ``finish_gradient_synchronization()`` to forget: when
      ``loss.backward()`` returns, every ``.grad`` is the average;
    * after the first step, buckets are rebuilt in the order gradients
      actually arrived (registration order is only a guess);
    * with ``broadcast_buffers=True`` (the default) every forward first copies
      rank 0's buffers to all ranks, so the running statistics agree.

    Its constructor takes torch's arguments, so it is a drop-in for
    ``torch.nn.parallel.DistributedDataParallel`` -- and this lesson trains
    both side by side and compares them number for number.

What to run
    python lessons/08_minddp.py [--world-size 4]

What to look at
    The buckets MiniDDP built (small ``bucket_cap_mb`` to get several), the
    timeline of the last step, and the final differences to torch's DDP.
    Read ``minddp/ddp.py`` next: its docstring traces a gradient's path.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from _common import parse_args, print0, print_ranks, run


def make_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(20, 128), nn.BatchNorm1d(128), nn.ReLU(),  # a buffer-carrying layer
        nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 4),
    )


def main(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # different on purpose: construction must fix it
    model = make_model()
    model[1].running_mean.fill_(float(rank))  # and the buffers too
    torch_model = copy.deepcopy(model)
    before = (model[0].weight[0, 0].item(), model[1].running_mean[0].item())

    # 0.02 MiB ~ 20 KB: the 64 KB weight gets a bucket of its own. torch's
    # default is 25 MiB, which would put this whole model in one bucket.
    ddp = MiniDDP(model, bucket_cap_mb=0.02)
    reference = TorchDDP(torch_model, bucket_cap_mb=0.02)

    w = [None] * world_size
    dist.all_gather_object(w, (model[0].weight[0, 0].item(), model[1].running_mean[0].item()))
    assert len(set(w)) == 1, "MiniDDP broadcast rank 0's parameters and buffers"
    print0("first weight and first running mean, before -> after MiniDDP(model):")
    print_ranks(f"weight {before[0]:+.4f} -> {w[rank][0]:+.4f}   running mean {before[1]:+.1f} -> {w[rank][1]:+.1f}")

    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
    for step in range(8):
        x, y = torch.randn(16, 20, generator=data), torch.randint(0, 4, (16,), generator=data)
        for m, o in ((ddp, opt), (reference, opt_ref)):
            o.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()  # MiniDDP: .grad is averaged when this returns
            o.step()
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
            ref_grads = [p.grad for p in torch_model.parameters()]
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads))

    print0(f"\nMiniDDP's buckets after the first step, in launch order ({len(ddp.bucket_names)} buckets):")
    for i, names in enumerate(ddp.bucket_names):
        print0(f"  bucket {i}: {', '.join(names)}")
    tl = ddp.timeline
    first = (tl.launches[0] - tl.first_hook) * 1e3
    last_hook = (tl.last_hook - tl.first_hook) * 1e3
    print0(f"last step: first bucket launched {first:.2f} ms after the first hook; last hook at {last_hook:.2f} ms")
    assert len(ddp.bucket_names) > 1 and len(tl.launches) == len(ddp.bucket_names)
    assert tl.launches[0] < tl.last_hook, "the first bucket left while backward was still running"

    param_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), torch_model.parameters()))
    buffer_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(model.buffers(), torch_model.buffers()))
    ranks_agree = [None] * world_size
    dist.all_gather_object(ranks_agree, [p.sum().item() for p in model.parameters()])
    assert param_diff < 1e-5 and buffer_diff < 1e-5, (param_diff, buffer_diff)
    assert all(r == ranks_agree[0] for r in ranks_agree), "every rank holds the same weights"
    print0("\nafter 8 steps of SGD with momentum, MiniDDP vs torch's DDP:")
    print_ranks(f"max |param diff| {param_diff:.1e}   max |buffer diff| {buffer_diff:.1e}")
    print0("checked: construction broadcast rank 0's weights and buffers; the first bucket")
    print0("         left before the last gradient was ready; the gradients, weights and")
    print0("         BatchNorm buffers match torch's DDP, and all ranks hold the same weights.")
    print0("(the buffers are rank 0's at the start of every forward; that forward then updates")
    print0(" them with the local batch, so between steps they differ across ranks: lesson 10)")


if __name__ == "__main__":
    args = parse_args(__doc__)
    run(main, args.world_size)
