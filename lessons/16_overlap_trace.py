"""Lesson 16: see the overlap -- a Chrome trace of MiniDDP's gradient hooks and buckets.

What you will learn
    Lesson 06 drew a timeline by hand. ``MiniDDP(..., trace=True)`` records
    one for every step: when each gradient hook fired, and when each
    bucket's all-reduce was launched and when it completed. Then
    ``model.tracer.export_chrome_trace(path)`` (a collective: every rank
    calls it, rank 0 writes) saves all ranks in the Chrome trace format:
    a JSON list of events, ``"ph": "i"`` an instant, ``"ph": "X"`` a span
    with a start ``ts`` and a length ``dur`` in microseconds, ``pid`` the
    rank, ``tid`` the track (0 backward, 1 communication).

    How to read it: a bucket's bar starts when its last gradient arrived
    (buckets leave strictly in order, so a bar can also wait for the one
    before it). The part of a bar before the *last* gradient hook ran under
    backward: hidden. The part after it is paid on top of backward.

    By default the buckets travel over the simulated ``laptop`` link
    (``minddp.simulated_link``, 2 ms per message, 200 MB/s), which carries
    one message at a time, so bars end in launch order and the wire's cost
    is plain to see. With ``--link none`` they go over plain Gloo, and a
    *later* bucket can finish before an earlier one: Gloo runs a process
    group's queued collectives on a small pool of worker threads (two by
    default), so bucket k+1 may start while bucket k is still in flight,
    and a smaller bucket then completes first. Launch order, the only order
    matching needs, stays the same on every rank. On a machine with few
    cores Gloo's threads also compete with backward for the CPU, so bars
    stretch and little is hidden; with spare cores (or GPUs and NCCL) more
    is.

What to run
    python lessons/16_overlap_trace.py [--world-size 4] [--link none] [--out overlap.json]
    then open the JSON in https://ui.perfetto.dev (or chrome://tracing).

What to look at
    The text timeline of rank 0's last step, and where the first bucket
    left compared with the last gradient hook. With matplotlib installed
    (``pip install '.[plot]'``) the same step for every rank as a PNG
    beside the JSON, drawn by ``minddp/trace_view.py``, the code
    behind ``benchmarks/compare.py --trace``.

Try this
    1. Each bucket here is one 256 KiB layer. Predict a bar's length on the
       laptop link at 2 ranks: 2 alpha + bytes / bandwidth = 4 ms + 1.3 ms.
       Then compare with the drawing.
    2. ``--link none``: predict whether the bars still end in launch order.
       (Not always -- see above; run it a few times.)
    3. Change ``bucket_cap_mb=0.3`` to ``25`` and predict the picture. (One
       bar, launched at the last gradient hook: nothing hidden.)
"""

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from minddp import MiniDDP
from minddp.simulated_link import simulated_allreduce_hook
from minddp.trace_view import StepView, draw_overlap, read_steps  # shared with the benchmark
from _common import add_link_option, make_link, parse_args, print0, run

STEPS = 4
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "minddp_lesson16_trace.json")


def make_model() -> nn.Sequential:
    # Eight 256x256 layers (256 KiB of gradient each) and a small head.
    layers = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def draw(view: StepView, width: int = 60) -> None:
    """One text row for backward, one per bucket; time 0 = the first gradient hook."""
    t0, span = view.start_ms, max(view.end_ms, *(b.finished_ms for b in view.buckets)) - view.start_ms
    col = lambda t: min(width - 1, int((t - t0) / span * width))  # noqa: E731
    last = col(view.last_hook_ms)
    backward = ["#"] * (last + 1) + ["."] * (col(view.end_ms) - last)
    for _, t in view.hooks:
        backward[col(t)] = "g"
    print0(f"  {'':<9} 0 ms{' ' * (width - 8)}{span:6.1f} ms")
    print0(f"  {'backward':<9} {''.join(backward)}")
    for bar in view.buckets:
        row = [" "] * width
        for c in range(col(bar.launched_ms), col(bar.finished_ms) + 1):
            row[c] = "="
        row[col(bar.launched_ms)] = "^"
        if row[last] != "^":  # left of it the bar ran under backward, right of it after
            row[last] = "|"
        print0(f"  bucket {bar.index:<2} {''.join(row)}")
    print0("  g gradient hook   # computing gradients   . waiting for the all-reduces")
    print0("  ^ bucket launched   = until its all-reduce completed   | the last gradient hook")


def check_and_show(trace: dict, n_buckets: int, one_wire: bool) -> None:
    """Rank 0: read the trace back, assert what it shows, draw it."""
    steps = read_steps(trace)
    for rank, views in steps.items():
        assert len(views) == STEPS, f"rank {rank}: {len(views)} steps in the trace, expected {STEPS}"
        for v in views:
            indices = [b.index for b in v.buckets]  # in launch order
            assert indices == list(range(len(indices))), f"rank {rank} step {v.step}: bars {indices}"
            assert v.buckets[0].launched_ms < v.last_hook_ms, "the first bucket leaves during backward"
            if one_wire:  # one message at a time: each ends after the one before it
                ends = [b.finished_ms for b in v.buckets]
                assert ends == sorted(ends), f"rank {rank} step {v.step}: bars ended out of order {ends}"
        assert len(views[-1].buckets) == n_buckets, "one bar per bucket"

    last = steps[0][-1]
    print0(f"\nrank 0, step {last.step} ({len(last.hooks)} gradient hooks, {len(last.buckets)} buckets):")
    draw(last)
    print0("\nevery rank's last step:")
    for views in steps.values():
        print0(f"  {views[-1].summary()}")
    print0(f"\nchecked: on every rank, in each of the {STEPS} steps, the trace holds exactly one all-reduce")
    print0("         bar per bucket, launched in bucket order, and the first bucket was launched")
    print0("         before the last gradient hook fired: communication began during backward"
           + (";\n         over the simulated link the bars ended in launch order, one at a time." if one_wire else "."))


def main(rank: int, world_size: int, out: str, link_name: str) -> None:
    torch.manual_seed(0)
    # 0.3 MiB buckets: about one layer each. The default 25 MiB would make
    # this 0.5 MiB model a single bucket that can only leave at the end.
    ddp = MiniDDP(make_model(), bucket_cap_mb=0.3, trace=True)
    link = make_link(link_name)
    if link is not None:
        ddp.register_comm_hook(link, simulated_allreduce_hook)  # the same average, at the link's pace
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(64, 256, generator=data), torch.randint(0, 10, (64,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    ddp.tracer.export_chrome_trace(out)  # every rank calls it; rank 0 writes
    print0(f"wrote {out}: {STEPS} steps x {world_size} ranks; open it in https://ui.perfetto.dev")
    if rank != 0:
        return
    with open(out) as f:
        trace = json.load(f)
    check_and_show(trace, len(ddp.bucket_names), one_wire=link is not None)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("\n(no matplotlib: pip install '.[plot]' to get the same picture as a PNG)")
        return
    png = os.path.splitext(out)[0] + ".png"
    draw_overlap(trace, png, title=f"lesson 16: {world_size} ranks, 0.3 MiB buckets")
    print(f"\nwrote {png}")


def options(parser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, help="trace file (JSON)")
    add_link_option(parser)


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, os.path.abspath(args.out), args.link)
