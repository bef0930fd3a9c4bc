"""Lesson 06: overlap communication with backward -- asynchronous all_reduce.

What you will learn
    In lesson 05 each hook *waited* for its all_reduce, so backward stood
    still while gradients travelled. But the last layer's gradient is final
    long before the first layer's is computed. ``dist.all_reduce(t,
    async_op=True)`` returns at once with a *work handle*; the sum happens
    in Gloo's background thread while autograd carries on with the earlier
    layers. Before the optimizer step we ``wait()`` for every handle.

    The difference from lesson 05: the hook launches instead of waiting, and
    a new ``finish_gradient_synchronization()`` waits and divides. (Torch's
    DDP and MiniDDP call that for you at the end of backward; here it is
    explicit so you can see it.)

What to run
    python lessons/06_async_overlap.py [--world-size 4]

What to look at
    The timeline of one backward pass on rank 0: when each parameter's hook
    fired (``^``), while its all-reduce was queued or in flight (``=``), and where
    backward ended (``|``). Communication of the last layers runs while the
    first layers are still computing. Gradients still equal the full batch's.
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import parse_args, print0, run


class AsyncDDP(nn.Module):
    """Lesson 05's HookDDP, launching all_reduce without waiting for it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.pending = []  # (param, work handle) launched during this backward
        self.timeline = []  # (name, launched at, finished at) for the picture
        names = {p: n for n, p in module.named_parameters()}
        for p in self.module.parameters():
            dist.broadcast(p.data, src=0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda param, name=names[p]: self._launch(param, name))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _launch(self, param: torch.Tensor, name: str) -> None:
        work = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True)
        self.pending.append((param, work))
        entry = [name, time.perf_counter(), None]
        self.timeline.append(entry)

        # Only to draw the timeline: note the moment the sum is complete.
        def done(fut, entry=entry):
            entry[2] = time.perf_counter()

        work.get_future().then(done)

    def finish_gradient_synchronization(self) -> None:
        # Call after backward, before optimizer.step().
        for param, work in self.pending:
            work.wait()
            param.grad /= self.world_size
        self.pending.clear()


def make_model() -> nn.Sequential:
    # Wide enough layers that computing a layer's gradient takes a moment.
    layers = []
    for _ in range(6):
        layers += [nn.Linear(384, 384), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(384, 10))


def draw(timeline, t0: float, t_backward_end: float, t_all_done: float, width: int = 56) -> None:
    scale = width / (t_all_done - t0)
    col = lambda t: min(width - 1, int((t - t0) * scale))  # noqa: E731
    end_col = col(t_backward_end)
    print0(f"  {'parameter':<10} 0 ms{' ' * (width - 14)}{(t_all_done - t0) * 1e3:6.1f} ms")
    for name, launched, finished in timeline:
        row = [" "] * width
        for c in range(col(launched), col(finished) + 1):
            row[c] = "="
        row[col(launched)] = "^"
        if row[end_col] == " ":
            row[end_col] = "|"
        print0(f"  {name:<10} {''.join(row)}")
    print0(f"  ^ hook fired, all_reduce launched   = queued or in flight   | backward returned at {(t_backward_end - t0) * 1e3:.1f} ms")


def main(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = make_model()
    single = copy.deepcopy(model)
    ddp = AsyncDDP(model)
    loss_fn = nn.CrossEntropyLoss()
    per_rank = 128
    data = torch.Generator().manual_seed(1234)

    for step in range(3):  # the first pass is slow (allocations); show the last
        x = torch.randn(per_rank * world_size, 384, generator=data)
        y = torch.randint(0, 10, (per_rank * world_size,), generator=data)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        ddp.zero_grad()
        ddp.timeline.clear()
        loss = loss_fn(ddp(x[mine]), y[mine])
        dist.barrier()  # start backward together, for a fair picture
        t0 = time.perf_counter()
        loss.backward()
        t_backward_end = time.perf_counter()
        ddp.finish_gradient_synchronization()
        t_all_done = time.perf_counter()

    single.zero_grad()
    loss_fn(single(x), y).backward()
    error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), single.parameters()))
    assert error < 1e-5, error

    if rank == 0:
        print(f"rank 0, one backward pass, {len(ddp.timeline)} parameters, all_reduce launched from the hooks:")
        draw(ddp.timeline, t0, t_backward_end, t_all_done)
    first_name, first_launch, _ = ddp.timeline[0]
    last_layer = str(len(model) - 1)
    assert first_name.split(".")[0] == last_layer, "backward reaches the last layer first"
    assert first_launch < t_backward_end, "communication started while backward was still running"
    assert all(finished is not None for _, _, finished in ddp.timeline)
    print0(f"\nchecked: the first hook was the last layer's ({first_name}), its all_reduce was launched")
    print0("         before backward returned, and the averaged gradients equal the")
    print0(f"         full-batch ones (max difference {error:.1e}).")


if __name__ == "__main__":
    args = parse_args(__doc__)
    run(main, args.world_size)
