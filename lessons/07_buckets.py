"""Lesson 07: buckets -- fewer, larger messages that still overlap with backward.

What you will learn
    Every collective call pays a fixed cost (a round trip, a wake-up of the
    communication thread, on GPUs a kernel launch) before its first byte
    moves. A model with hundreds of small parameters pays it hundreds of
    times per step; that was lesson 06's ``AsyncDDP``. The fix is to pack
    gradients into a few flat *buckets* and all-reduce each bucket as one
    tensor.

    But one huge bucket is wrong too: it can only be sent once its *last*
    gradient exists, i.e. after backward has finished, so nothing overlaps.
    The answer is in between: buckets of a few MB (torch's DDP: 25 MB),
    filled in the order backward produces gradients (last layer first).

    The difference from lesson 06: parameters are grouped into buckets in
    ``__init__``; the hook counts a bucket's ready gradients and launches the
    bucket when it is full; buckets are launched *in order*, because
    collectives are matched by order across ranks -- if rank 0 sent bucket 1
    first and rank 1 bucket 0, the sums would mix different tensors.

What to run
    python lessons/07_buckets.py [--world-size 4]

What to look at
    The sweep over bucket sizes: all-reduce calls per step, when the first
    bucket left (as a fraction of backward), and the measured step time.
    On a laptop with Gloo over loopback the fixed cost per call is small, so
    the differences are modest; on real networks and GPUs they are large.
    Also, on one CPU machine Gloo's communication thread competes with
    backward for the same cores, so overlap buys little there and the fewest
    calls often win; with GPUs (compute on the GPU, transfers on the
    network) overlap is what hides the communication time.
"""

import copy
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import parse_args, print0, run


class BucketDDP(nn.Module):
    """Lesson 06's AsyncDDP, all-reducing flat buckets instead of single tensors."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: float):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            dist.broadcast(p.data, src=0)

        # Reversed: backward produces the last layer's gradients first, so
        # the first bucket fills (and can leave) first.
        self.buckets, current, size = [], [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        self.buckets.append(current)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}

        self.ready = [0] * len(self.buckets)  # gradients arrived, per bucket
        self.next_bucket = 0  # the next bucket to launch, in order
        self.pending = []  # (bucket index, flat tensor, work handle)
        self.calls = 0
        self.hook_times, self.launch_times = [], []
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self.hook_times.append(time.perf_counter())
        self.ready[self.bucket_of[param]] += 1
        while self.next_bucket < len(self.buckets) and self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _launch(self, i: int) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        self.pending.append((i, flat, work))
        self.calls += 1
        self.launch_times.append(time.perf_counter())

    def finish_gradient_synchronization(self) -> None:
        assert self.next_bucket == len(self.buckets), "a parameter got no gradient this step"
        for i, flat, work in self.pending:
            work.wait()
            flat /= self.world_size
            offset = 0
            for p in self.buckets[i]:  # unpack the bucket back into each .grad
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0


def make_model() -> nn.Sequential:
    # Many small layers: 48 parameter tensors (16 KB weights, 256 B biases),
    # the worst case for one call per parameter.
    layers = []
    for _ in range(24):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers)


def run_cap(cap: float, rank: int, world_size: int, steps: int = 12):
    torch.manual_seed(0)
    model = make_model()
    single = copy.deepcopy(model)
    ddp = BucketDDP(model, cap)
    loss_fn = nn.MSELoss()
    data = torch.Generator().manual_seed(1234)
    per_rank = 32
    times = []
    for step in range(steps):
        x = torch.randn(per_rank * world_size, 64, generator=data)
        mine = x[rank * per_rank : (rank + 1) * per_rank]
        ddp.zero_grad()
        ddp.calls, ddp.hook_times, ddp.launch_times = 0, [], []
        dist.barrier()
        start = time.perf_counter()
        loss = loss_fn(ddp(mine), mine.flip(1))
        t_backward = time.perf_counter()
        loss.backward()
        t_backward_end = time.perf_counter()
        ddp.finish_gradient_synchronization()
        times.append(time.perf_counter() - start)

    single.zero_grad()
    loss_fn(single(x), x.flip(1)).backward()
    error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), single.parameters()))
    assert error < 1e-5, f"bucket cap {cap}: gradients differ from the full batch by {error}"

    first_launch = (ddp.launch_times[0] - t_backward) / (t_backward_end - t_backward)
    launched_after_last_grad = ddp.launch_times[0] >= ddp.hook_times[-1]
    # The slowest rank sets the pace; skip the first two steps (warm-up).
    step_time = torch.tensor(sorted(times[2:])[len(times[2:]) // 2])
    dist.all_reduce(step_time, op=dist.ReduceOp.MAX)
    return dict(buckets=len(ddp.buckets), calls=ddp.calls, first_launch=first_launch,
                after_last=launched_after_last_grad, ms=step_time.item() * 1e3)


def main(rank: int, world_size: int) -> None:
    n_params = len(list(make_model().parameters()))
    caps = [0, 20 * 1024, 80 * 1024, 320 * 1024, math.inf]
    results = [run_cap(cap, rank, world_size) for cap in caps]

    print0(f"{n_params} parameter tensors, {world_size} ranks; per step:")
    print0("  bucket cap  | all_reduce calls | first bucket left after | median step time")
    for cap, r in zip(caps, results):
        label = "per param" if cap == 0 else "one bucket" if cap == math.inf else f"{cap // 1024} KB"
        print0(f"  {label:<11} | {r['calls']:>16} | {r['first_launch']:>10.0%} of backward | {r['ms']:>8.2f} ms")

    calls = [r["calls"] for r in results]
    assert calls[0] == n_params and calls[-1] == 1
    assert all(a >= b for a, b in zip(calls, calls[1:])), "bigger buckets, fewer calls"
    assert all(r["calls"] == r["buckets"] for r in results)
    assert results[-1]["after_last"], "one bucket leaves only after the last gradient"
    assert not results[1]["after_last"], "smaller buckets leave while backward still runs"
    best = min(zip(caps, results), key=lambda cr: cr[1]["ms"])[0]
    print0(f"\nchecked: every cap gives the full-batch gradients; calls fall from {n_params} to 1")
    print0("         as buckets grow; the single bucket left only after the last gradient")
    print0("         was computed, while 20 KB buckets left during backward.")
    label = "per param" if best == 0 else "one bucket" if best == math.inf else f"{best // 1024} KB"
    print0(f"fastest here: {label} (a measurement; it varies from run to run and machine to machine)")


if __name__ == "__main__":
    args = parse_args(__doc__)
    run(main, args.world_size)
