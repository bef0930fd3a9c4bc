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
    python lessons/07_buckets.py [--world-size 3] [--cap KB] [--link eth25|none] [--registration-order]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    ``diff lessons/wrappers/async_ddp.py lessons/wrappers/bucket_ddp.py``:
    the idea. Then the sweep over bucket caps through the simulated
    ``laptop`` link: all-reduces per step (counted), when each plan's first
    bucket can leave, and the model's step. The model takes a forward and,
    for every gradient, when its hook fired; a bucket can leave when the
    last of *its* gradients is ready and every bucket before it has left,
    and then holds the wire for its alpha-beta time. Too small a cap pays
    alpha per call; one bucket pays all of ``bytes / bandwidth`` after
    backward; the best cap is in the middle (a U). The lesson's answer,
    which it checks, is the model on a stated backward, about what one
    laptop core takes for this model (gradients ready evenly over 40 ms,
    after a 20 ms forward). Beside it, the same model on this machine's
    CPU times (the fastest of 6 backwards, with no communication at all),
    shown, not checked: a machine much faster or slower than the stated
    one moves the best cap, and may lose the U. No clock figure: the link
    is simulated, and the clock of a shared machine would add the other
    programs' noise to it.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Before running, predict the best cap from alpha = 2 ms and 200 MB/s
       (printed first, with backward's length and the gradient bytes).
       A bucket of b bytes is on the wire for 2(p-1) alpha + 2(p-1)/p b/B;
       backward makes gradients at G bytes per T ms. The wire keeps up when
       a bucket's wire time is at most the time backward takes to fill the
       next one; the smallest such bucket leaves least work after backward.
    2. ``--cap 200``: add your own cap (in KB) to the sweep; the lesson
       prints the model's step for it among the others.
    3. ``--link none``: plain Gloo on loopback, where alpha is microseconds.
       Predict which columns change.
    4. ``--registration-order`` fills the buckets in the order the model
       registers its parameters (first layer first) instead of reversed.
       Predict when the first bucket can leave, and where the U goes.
"""

import math
import time

import torch
import torch.distributed as dist

from _common import (FEATURES, add_link_option, is_exact, is_real, make_link, make_model, parse_args, print0, run,
                     train_and_compare, wire_model)
from wrappers.bucket_ddp import BucketDDP  # this lesson's wrapper: diff it with wrappers/async_ddp.py

WIDTH, DEPTH = 256, 12  # 26 gradient tensors, 2.9 MB: a backward long enough to hide several buckets
# The lesson's answer is the model on a stated backward, about what one laptop core takes for this
# model (42 ms and a 22 ms forward, the fastest of 6, on the 2-core machine the lesson was written
# on): whether the U shows on *this* machine depends on its speed, and its column is shown beside.
STATED_FORWARD_MS, STATED_BACKWARD_MS = 20.0, 40.0


class RegistrationOrderBuckets(BucketDDP):
    """Exercise 4: buckets filled in registration order -- the first layer's gradients, which
    backward makes last, go into the first bucket, and buckets leave in order."""

    def _build_buckets(self, order: list) -> None:
        super()._build_buckets(self.params)


def measure_readiness(per_rank: int, rounds: int = 6) -> tuple[float, list[float]]:
    """This machine's forward, and when each gradient is ready (its hook fires), in ms after
    forward, of the lesson's model with no communication at all; each the fastest of ``rounds``,
    then the slowest rank's. Indexed like ``model.parameters()``. Counted in this thread's CPU
    time (``time.thread_time``), which autograd spends on CPU tensors in the calling thread: the
    other programs of a shared machine stretch the wall clock, not this."""
    model = make_model(seed=0, width=WIDTH, depth=DEPTH)
    params = list(model.parameters())
    fired = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: fired.__setitem__(i, time.thread_time()))
    x, forward, ready = torch.randn(per_rank, FEATURES), math.inf, [math.inf] * len(params)
    for _ in range(rounds):
        model.zero_grad()
        start = time.thread_time()
        loss = model(x).sum()
        forward_done = time.thread_time()
        loss.backward()
        forward = min(forward, forward_done - start)
        ready = [min(r, fired[i] - forward_done) for i, r in enumerate(ready)]
    worst = torch.tensor([forward] + ready, dtype=torch.float64) * 1e3
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst[0].item(), worst[1:].tolist()


def stated_readiness(n_params: int, backward_ms: float = STATED_BACKWARD_MS) -> list[float]:
    """When each gradient is ready, indexed like ``model.parameters()``: backward makes them last
    layer first, evenly over ``backward_ms``."""
    return [backward_ms * (n_params - i) / n_params for i in range(n_params)]


def has_u(rows: list[tuple[float, float]]) -> bool:
    """(cap, the model's step) from the smallest cap to one bucket: is the best strictly in between?"""
    best = min(rows, key=lambda row: row[1])
    return best[0] not in (0, math.inf) and best[1] < min(rows[0][1], rows[-1][1])


def bucket_readiness(ddp: BucketDDP, ready_ms: list[float]) -> list[tuple[int, float]]:
    """Per bucket, in launch order: (its bytes, when the last of its gradients is ready).
    ``ready_ms[i]``: when the gradient of ``ddp.params[i]`` is ready."""
    position = {p: i for i, p in enumerate(ddp.params)}
    return [(sum(p.numel() * p.element_size() for p in bucket), max(ready_ms[position[p]] for p in bucket))
            for bucket in ddp.buckets]


def predicted_ms(buckets: list[tuple[int, float]], wire_ms) -> float:
    """The alpha-beta model's end of communication, in ms after forward: buckets leave in order,
    each once its last gradient is ready and the bucket before it has left, and hold the one wire
    for ``wire_ms(bytes)`` once it is free."""
    wire_free = 0.0
    for nbytes, ready in buckets:
        wire_free = max(ready, wire_free) + wire_ms(nbytes)
    return wire_free


def label(cap: float) -> str:
    return "per param" if cap == 0 else "one bucket" if cap == math.inf else f"{cap / 1024:.0f} KB"


def main(rank: int, world_size: int, args) -> None:
    caps = sorted({0, 300 * 1024, 600 * 1024, 1100 * 1024, 1600 * 1024, math.inf} | ({args.cap * 1024} if args.cap else set()))
    wrapper = RegistrationOrderBuckets if args.registration_order else BucketDDP
    results, wrappers = [], []
    for cap in caps:  # the bench: every cap gives the full-batch gradients (checked at both ends)
        result, ddp = train_and_compare(label(cap), lambda m: wrapper(m, cap, make_link(args.link)), rank, world_size,
                                        width=WIDTH, depth=DEPTH, steps=2, reference=cap in (0, math.inf))
        results.append(result)
        wrappers.append(ddp)
    # 1024 samples per rank: a backward long enough to hide several buckets behind.
    forward_ms, ready_ms = measure_readiness(per_rank=1024)
    backward_ms = max(ready_ms)
    link = make_link(args.link) or wire_model(args.link)  # real:RATE: the model only, the ranks use the wire
    n_params = len(ready_ms)
    grad_bytes = sum(nbytes for nbytes, _ in bucket_readiness(wrappers[-1], ready_ms))
    order = "registration order (first layer first)" if args.registration_order else "reverse registration order"
    if link is not None:
        print0(f"link {link.link.name}: alpha {link.link.alpha_s * 1e3:g} ms per message, {link.link.bandwidth_Bps / 1e6:g} MB/s; "
               f"{world_size} ranks; {grad_bytes / 1e6:.2f} MB of gradients in {n_params} tensors,")
        print0(f"made by a backward of {backward_ms:.0f} ms after a {forward_ms:.0f} ms forward (CPU time, fastest of 6, no communication).")
        print0(f"Buckets filled in {order}.")
        print0("  (predict the best cap now; the sweep follows)\n")

    stated = stated_readiness(n_params)
    wire_ms = lambda n: 1e3 * link.predicted_time(n)  # noqa: E731
    rows = []
    for cap, ddp, result in zip(caps, wrappers, results):
        buckets = bucket_readiness(ddp, ready_ms)
        if link is None:
            here = on_stated = math.nan
        else:
            here = forward_ms + predicted_ms(buckets, wire_ms)
            on_stated = STATED_FORWARD_MS + predicted_ms(bucket_readiness(ddp, stated), wire_ms)
        rows.append((cap, result.all_reduces, buckets[0][1], here, on_stated))
    print0(f"  bucket cap  | all-reduces per step | first bucket can leave | model's step: here | "
           f"stated {STATED_BACKWARD_MS:.0f} ms backward")
    for cap, calls, first_ready, here, on_stated in rows:
        cells = ("no link", "no link") if link is None else (f"{here:.1f} ms", f"{on_stated:.1f} ms")
        print0(f"  {label(cap):<11} | {calls:>20} | {first_ready:>15.1f} ms in | {cells[0]:>18} | {cells[1]:>24}")
    print0("  (all-reduces: counted in the bench's last step; \"can leave\": when the last gradient of bucket 0 is")
    print0("   ready, ms after forward; the model: forward, then each bucket on the wire for its alpha-beta time")
    print0("   from when it and every bucket before it are ready and the wire is free. Here: this machine's")
    print0(f"   CPU times above; stated: a {STATED_FORWARD_MS:.0f} ms forward and gradients ready evenly over a "
           f"{STATED_BACKWARD_MS:.0f} ms backward)")

    assert all(is_exact(r) for r in results if not math.isnan(r.grad_error)), "buckets change when, not what"
    calls = [c for _, c, _, _, _ in rows]
    assert calls == [len(ddp.buckets) for ddp in wrappers], f"one all-reduce per bucket per step; counted {calls}"
    assert calls[0] == n_params and calls[-1] == 1, (
        f"per parameter: one call per tensor ({n_params}), one bucket: 1 call; got {calls[0]} and {calls[-1]}")
    assert all(a >= b for a, b in zip(calls, calls[1:])), f"bigger buckets, fewer calls; got {calls}"
    if args.registration_order:
        assert all(first_ready == backward_ms for _, _, first_ready, _, _ in rows), (
            "in registration order bucket 0 holds the first layer, whose gradients come last: it can leave only "
            f"when backward ends ({backward_ms:.1f} ms); first buckets ready at {[round(r[2], 1) for r in rows]}")
    if link is None:
        print0("\nchecked: per-parameter and one-bucket runs give the full-batch gradients; one all-reduce per bucket,")
        print0("         fewer as buckets grow. With no simulated link there is no model of the wire: nothing about")
        print0("         time is checked.")
        return
    here = [(cap, m) for cap, _, _, m, _ in rows]
    on_stated = [(cap, m) for cap, _, _, _, m in rows]
    best_here, best_stated = (min(column, key=lambda row: row[1]) for column in (here, on_stated))
    print0(f"\nfastest in the model: {label(best_stated[0])} on the stated backward ({best_stated[1]:.1f} ms); "
           f"{label(best_here[0])} on this machine's ({best_here[1]:.1f} ms)")
    if args.registration_order:
        # Bucket 0 waits for the last gradient and every bucket leaves after it: only the alphas differ.
        assert best_here[0] == best_stated[0] == math.inf, (
            f"in registration order nothing leaves before backward ends, so no U and one bucket is best; the best "
            f"were {label(best_here[0])} and {label(best_stated[0])}")
        print0("checked (--registration-order): every run gives the full-batch gradients; but bucket 0, which")
        print0(f"         must leave first, holds the gradients backward makes last: every plan's first bucket")
        print0(f"         can leave only when backward ends ({backward_ms:.1f} ms here), nothing overlaps, and the U")
        print0(f"         is gone on any backward: the fewer buckets, the fewer alphas, the faster ({label(best_stated[0])} "
               f"is best).")
        return
    if is_real(args.link):  # a wire with no added latency: the model charges nothing per call, so no U to check
        print0("checked: per-parameter and one-bucket runs give the full-batch gradients; one all-reduce per bucket.")
        print0("         On the real link the model knows the rate only (tc adds no latency): it charges nothing per")
        print0("         call, so it cannot show the U; what the clock adds for many buckets is Gloo's cost per call.")
        return
    assert rows[1][2] < backward_ms, (
        f"in reverse order the first bucket holds the last layer and can leave during backward; it was ready at "
        f"{rows[1][2]:.1f} ms of {backward_ms:.1f}")
    assert has_u(on_stated), (
        f"the U: in the model the best cap lies in between; on the stated backward its steps were "
        + ", ".join(f"{label(cap)} {m:.1f} ms" for cap, m in on_stated))
    if has_u(here):
        print0(f"on this machine's backward ({backward_ms:.0f} ms) the U shows too.")
    else:  # a machine much faster or slower than the stated one: not an error, another answer
        why = {0: "per-parameter all-reduces keep up with a backward this long",
               math.inf: "a backward this short hides too little to pay for more alphas"}.get(
            best_here[0], "the best cap ties with an end")
        print0(f"on this machine's backward ({backward_ms:.0f} ms) the U does not show ({why}): the best cap "
               f"depends on backward's length, exercise 1's formula.")
    print0("checked: per-parameter and one-bucket runs give the full-batch gradients; one all-reduce per bucket,")
    print0(f"         fewer as buckets grow; in the model, on the stated backward, the best cap lies in between:")
    print0(f"         {best_stated[1]:.1f} ms against {on_stated[0][1]:.1f} ms per parameter (alpha paid {calls[0]} "
           f"times)")
    print0(f"         and {on_stated[-1][1]:.1f} ms for one bucket (nothing hidden).")


def options(parser) -> None:
    add_link_option(parser)
    parser.add_argument("--cap", type=float, default=None, help="add a bucket cap of your own, in KB")
    parser.add_argument("--registration-order", action="store_true",
                        help="exercise 4: fill the buckets first layer first, the order the model registers them")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args, link=args.link)
