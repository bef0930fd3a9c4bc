"""Lesson 07: buckets -- fewer, larger messages that still overlap with backward.

What you will learn
    Every collective call pays a fixed cost (a round trip, a wake-up of the
    communication thread, on GPUs a kernel launch) before its first byte
    moves: the network model's *alpha*. A model with hundreds of small
    parameters pays it hundreds of times per step; that was lesson 06's
    ``AsyncDDP``. The fix is to pack gradients into a few flat *buckets* and
    all-reduce each bucket as one tensor.

    But one huge bucket is wrong too: it can only be sent once its *last*
    gradient exists, i.e. after backward has finished, so nothing overlaps
    and the whole ``bytes / bandwidth`` is paid on top of backward. The
    answer is in between: buckets of a few MB (torch's DDP: 25 MB), filled
    in the order backward produces gradients (last layer first).

    The difference from lesson 06: parameters are grouped into buckets in
    ``__init__``; the hook counts a bucket's ready gradients and launches the
    bucket when it is full; buckets are launched *in order*, because
    collectives are matched by order across ranks -- if rank 0 sent bucket 1
    first and rank 1 bucket 0, the sums would mix different tensors.

What to run
    python lessons/07_buckets.py [--world-size 3] [--cap KB] [--link eth25|none]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    The sweep over bucket caps through the simulated ``laptop`` link: calls
    per step, the model's step time and the measured one. Too small a cap
    pays alpha per call; one bucket pays all of ``bytes / bandwidth`` after
    backward; the best cap is in the middle (a U). The lesson checks the U
    in the model's column: the fastest forward and backward measured here, the wire
    as the alpha-beta model says. The measured column usually agrees, but a
    busy machine, or three ranks sharing two cores, can move its minimum by
    a few ms; the clock counts that, the model does not.

Try this
    1. Before running, predict the best cap from alpha = 2 ms and 200 MB/s
       (printed first, with backward's length and the gradient bytes).
       A bucket of b bytes is on the wire for 2(p-1) alpha + 2(p-1)/p b/B;
       backward makes gradients at G bytes per T ms. The wire keeps up when
       a bucket's wire time is at most the time backward takes to fill the
       next one; the smallest such bucket leaves least work after backward.
    2. ``--cap 200``: add your own cap (in KB) to the sweep; the lesson
       prints the model's prediction for it next to the measurement.
    3. ``--link none``: plain Gloo on loopback, where alpha is microseconds.
       Predict where the best cap moves. (To the largest buckets, or
       anywhere: nothing is worth overlapping, and the differences drown in
       noise. There is no model of the wire then, so nothing about time is
       checked.)
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import (FEATURES, add_link_option, is_exact, is_real, make_link, make_model, parse_args, print0, print_results,
                     run, train_and_compare, wire_model)


class BucketDDP(nn.Module):
    """Lesson 06's AsyncDDP, all-reducing flat buckets instead of single tensors."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: float, link=None, broadcast: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False while accumulating micro-batches
        self.link = link
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            if broadcast:
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
        self.pending = []  # (bucket index, flat tensor, future)
        for p in params:
            p.register_post_accumulate_grad_hook(self._average_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        if self.link is not None:  # the same sum, at the simulated network's pace
            return self.link.all_reduce(tensor)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def _average_grad(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        self.ready[self.bucket_of[param]] += 1
        while self.next_bucket < len(self.buckets) and self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[self.next_bucket]])
            self.pending.append((self.next_bucket, flat, self._all_reduce(flat)))
            self.next_bucket += 1

    def finish_gradient_synchronization(self) -> None:
        # Called after backward, before optimizer.step().
        if not self.require_sync:
            return
        assert self.next_bucket == len(self.buckets), "a parameter got no gradient this step"
        for i, flat, future in self.pending:
            future.wait()
            flat /= self.world_size
            offset = 0
            for p in self.buckets[i]:  # unpack the bucket back into each .grad
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0


class TimedBucketDDP(BucketDDP):
    """BucketDDP noting when forward ended and each gradient hook fired, for the timing."""

    def forward(self, *args, **kwargs):
        self.hook_times = []
        output = super().forward(*args, **kwargs)
        self.forward_done = time.perf_counter()
        return output

    def _average_grad(self, param: torch.Tensor) -> None:
        if self.require_sync:
            self.hook_times.append(time.perf_counter())
        super()._average_grad(param)


def predicted_ms(ddp: BucketDDP, link, backward_ms: float) -> float:
    """The alpha-beta model's step: gradients made at a steady rate during
    backward, each bucket on the wire once it is full and the wire is free."""
    sizes = [sum(p.numel() * p.element_size() for p in b) for b in ddp.buckets]
    made, wire_free = 0, 0.0
    for nbytes in sizes:
        made += nbytes
        ready = backward_ms * made / sum(sizes)
        wire_free = max(ready, wire_free) + 1e3 * link.predicted_time(nbytes)
    return wire_free


def label(cap: float) -> str:
    return "per param" if cap == 0 else "one bucket" if cap == math.inf else f"{cap / 1024:.0f} KB"


def time_alternately(wrappers: list, per_rank: int, rounds: int = 6) -> list[dict]:
    """Forward + backward + sync, one step of each wrapper in turn (so all meet
    the same load on a shared machine); the fastest of ``rounds``, slowest rank."""
    x = torch.randn(per_rank, FEATURES)
    times = [dict(step=[], forward=[], backward=[]) for _ in wrappers]
    for _ in range(rounds):
        for ddp, t in zip(wrappers, times):
            ddp.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            ddp(x).sum().backward()
            ddp.finish_gradient_synchronization()
            t["step"].append(time.perf_counter() - start)
            t["forward"].append(ddp.forward_done - start)
            t["backward"].append(ddp.hook_times[-1] - ddp.forward_done)
    worst = torch.tensor([[1e3 * min(t[k]) for k in ("step", "forward", "backward")] for t in times])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return [dict(zip(("step", "forward", "backward"), row)) for row in worst.tolist()]


def main(rank: int, world_size: int, args) -> None:
    caps = sorted({0, 300 * 1024, 600 * 1024, 1100 * 1024, 1600 * 1024, math.inf} | ({args.cap * 1024} if args.cap else set()))
    results, wrappers = [], []
    for cap in caps:  # the bench: every cap gives the full-batch gradients (checked at both ends)
        result, ddp = train_and_compare(label(cap), lambda m: TimedBucketDDP(m, cap, make_link(args.link)), rank, world_size,
                                        width=256, depth=12, steps=2, reference=cap in (0, math.inf))
        results.append(result)
        wrappers.append(ddp)
    # One more without any communication cost: how long forward and backward take here.
    plain = TimedBucketDDP(make_model(seed=0, width=256, depth=12), math.inf)
    # 1024 samples per rank: a backward long enough to hide several buckets behind.
    timing = time_alternately([plain] + wrappers, per_rank=1024)
    # Every wrapper computes the same forward and backward (hooks only add to
    # them): the fastest of all is the best measure of the compute alone.
    compute = {k: min(t[k] for t in timing) for k in ("forward", "backward")}
    timing = timing[1:]
    link = make_link(args.link) or wire_model(args.link)  # real:RATE: the model only, the ranks use the wire
    grad_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    if link is not None:
        print0(f"link {link.link.name}: alpha {link.link.alpha_s * 1e3:g} ms per message, {link.link.bandwidth_Bps / 1e6:g} MB/s; "
               f"{world_size} ranks; {grad_bytes / 1e6:.2f} MB of gradients in {len(list(plain.parameters()))} tensors,")
        print0(f"made by a backward of about {compute['backward']:.0f} ms after a {compute['forward']:.0f} ms forward.")
        print0("  (predict the best cap now; the sweep follows)\n")

    rows = []
    for cap, ddp, t in zip(caps, wrappers, timing):
        model_ms = compute["forward"] + predicted_ms(ddp, link, compute["backward"]) if link is not None else float("nan")
        rows.append((cap, len(ddp.buckets), model_ms, t["step"]))
    print0("  bucket cap  | all_reduce calls | model's step | measured step (fastest of 6)")
    if link is not None:
        print0("  (the model: the fastest forward and backward measured here, every bucket on the wire for")
        print0("   its alpha-beta time from the moment it is full and the wire is free)")
    for cap, calls, model_ms, measured in rows:
        model_cell = "no link" if link is None else f"{model_ms:.1f} ms"
        print0(f"  {label(cap):<11} | {calls:>16} | {model_cell:>12} | {measured:>8.1f} ms")

    assert all(is_exact(r) for r in results if not math.isnan(r.grad_error)), "buckets change when, not what"
    calls = [c for _, c, _, _ in rows]
    assert calls[0] == len(list(plain.parameters())) and calls[-1] == 1, (
        f"per parameter: one call per tensor ({len(list(plain.parameters()))}), one bucket: 1 call; got {calls[0]} and {calls[-1]}")
    assert all(a >= b for a, b in zip(calls, calls[1:])), f"bigger buckets, fewer calls; got {calls}"
    measured_best = min(rows, key=lambda row: row[3])
    print0(f"\nfastest measured: {label(measured_best[0])} (by the clock, which also counts a busy machine and late peers)")
    if link is None:
        print0("checked: per-parameter and one-bucket runs give the full-batch gradients; calls fall as buckets grow.")
        print0("         With no simulated link there is no model of the wire, so nothing about time is checked.")
        return
    model_best = min(rows, key=lambda row: row[2])
    ends = min(rows[0][2], rows[-1][2])
    print0(f"fastest in the model: {label(model_best[0])}, {model_best[2]:.1f} ms; "
           f"the clock {'agrees' if measured_best[0] == model_best[0] else 'picks another cap this time'}")
    if is_real(args.link):  # a wire with no added latency: the model charges nothing per call, so no U to check
        print0("checked: per-parameter and one-bucket runs give the full-batch gradients; calls fall as buckets grow.")
        print0("         On the real link the model knows the rate only (tc adds no latency), so it charges nothing")
        print0("         per call: what the clock adds for many small buckets is Gloo's own cost per all-reduce.")
        return
    assert model_best[0] not in (0, math.inf) and model_best[2] < ends, (
        f"the U: in the model the best cap lies in between; its steps were "
        + ", ".join(f"{label(cap)} {m:.1f} ms" for cap, _, m, _ in rows))
    print0("checked: per-parameter and one-bucket runs give the full-batch gradients; calls fall as buckets grow;")
    print0(f"         in the model the best cap lies in between: {model_best[2]:.1f} ms against {rows[0][2]:.1f} ms per")
    print0(f"         parameter (alpha paid {calls[0]} times) and {rows[-1][2]:.1f} ms for one bucket (nothing hidden).")


def options(parser) -> None:
    add_link_option(parser)
    parser.add_argument("--cap", type=float, default=None, help="add a bucket cap of your own, in KB")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args, link=args.link)
