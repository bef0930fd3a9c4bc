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

    How to read it: a bucket's bar starts when the bucket was launched,
    i.e. when its last gradient arrived. Over a link that carries one
    message at a time it may first *wait* for the buckets launched before
    it (drawn ``.``), then travel (``=``). Only travel that lies before the
    *last* gradient hook ran under backward and was hidden; waiting hides
    nothing, and whatever travels after the last hook is paid on top of
    backward. The lesson adds up both parts for rank 0's last step.

    By default the buckets travel over the simulated ``laptop`` link
    (``minddp.net.simulated_link``, 2 ms per message, 200 MB/s), which carries
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
    python lessons/16_overlap_trace.py [--world-size 1-3] [--link none] [--bucket-cap-mb 25] [--out overlap.json]
    then open the JSON in https://ui.perfetto.dev (or chrome://tracing).

What to look at
    The text timeline of rank 0's last step, and where the first bucket
    left compared with the last gradient hook. Then each bar split into its
    parts: waiting for the wire, the model's time on it, waiting for the
    slowest rank to launch the same bucket, and what this machine added. With matplotlib installed
    (``pip install '.[plot]'``) the same step for every rank as a PNG
    beside the JSON, drawn by ``minddp/ddp/observers/trace_view.py``, the code
    behind ``benchmarks/compare.py --trace``.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Each bucket here is one 256 KiB layer. Predict the time a bar spends
       on the wire on the laptop link at 2 ranks: 2 alpha + bytes / bandwidth
       = 4 ms + 1.3 ms. Then read the table under the drawing: why are most
       bars longer than that, and by how much?
    2. ``--link none``: predict whether the bars still end in launch order.
    3. ``--bucket-cap-mb 25`` (torch's default) in place of 0.25: predict
       the picture.
"""

import json
import os
import tempfile

import torch
import torch.nn as nn

from minddp import MiniDDP
from minddp.net.simulated_link import simulated_allreduce_hook
from minddp.ddp.observers.trace_view import StepView, draw_overlap, read_steps  # shared with the benchmark
from _common import add_link_option, make_link, parse_args, print0, run

STEPS = 4
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "minddp_lesson16_trace.json")
BATCH = 1024  # samples per rank: a backward about as long as the laptop link's 8 messages


def make_model() -> nn.Sequential:
    # Eight 256x256 layers (256 KiB of gradient each, 2 MiB in all) and a small head.
    layers = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def on_the_wire(view: StepView, one_wire: bool) -> list[float]:
    """When each bar's all-reduce got the wire: at launch, or -- one message
    at a time -- when the bar before it was over, whichever came later."""
    starts, free = [], float("-inf")
    for bar in view.buckets:
        starts.append(max(bar.launched_ms, free) if one_wire else bar.launched_ms)
        free = bar.finished_ms
    return starts


def draw(view: StepView, one_wire: bool, width: int = 60) -> None:
    """One text row for backward, one per bucket; time 0 = the first gradient hook."""
    t0, span = view.start_ms, max(view.end_ms, *(b.finished_ms for b in view.buckets)) - view.start_ms
    col = lambda t: min(width - 1, int((t - t0) / span * width))  # noqa: E731
    last = col(view.last_hook_ms)
    backward = ["#"] * (last + 1) + ["."] * (col(view.end_ms) - last)
    for _, t in view.hooks:
        backward[col(t)] = "g"
    print0(f"  {'':<9} 0 ms{' ' * (width - 8)}{span:6.1f} ms")
    print0(f"  {'backward':<9} {''.join(backward)}")
    for bar, wire in zip(view.buckets, on_the_wire(view, one_wire)):
        row = [" "] * width
        for c in range(col(bar.launched_ms), col(bar.finished_ms) + 1):
            row[c] = "." if c < col(wire) else "="
        row[col(bar.launched_ms)] = "^"
        if row[last] != "^":  # left of it the bar ran under backward, right of it after
            row[last] = "|"
        print0(f"  bucket {bar.index:<2} {''.join(row)}")
    print0("  g gradient hook   # computing gradients   . waiting for the all-reduces")
    print0("  ^ bucket launched   . waiting for the wire   = on the wire (or waiting for a slower rank, or this machine)")
    print0("  | the last gradient hook")


def hidden_ms(view: StepView, one_wire: bool) -> tuple[float, float]:
    """(bar time after its wait for the wire that lay before the last gradient hook, that time in all):
    by the trace's clock, so it also counts a late peer and a busy machine."""
    starts = on_the_wire(view, one_wire)
    under = sum(max(0.0, min(b.finished_ms, view.last_hook_ms) - s) for b, s in zip(view.buckets, starts))
    return under, sum(b.finished_ms - s for b, s in zip(view.buckets, starts))


def explain_bars(views: list[StepView], wire_ms, taken_ms: list[float]) -> list[dict]:
    """Rank ``views[0]``'s bars of one step, each split into what the simulated link makes it:
    ``queued`` until the wire took it (``taken_ms``, one per bar: the link's own record, the
    moment the message before it was done), ``wire`` the model's time for its bytes
    (``wire_ms(nbytes)``), ``late_peer``: waiting past that for the slowest rank to launch the
    same bucket (the real sum needs every rank's part), and ``rest``: what is left, this
    machine's own delay (a thread waking late, a busy core). ``views`` holds every rank's view
    of the same step; times are on the machine's one clock.

    Each part ends at an event that comes before the bar's end (the link delivers no earlier
    than the model's time after it took the message, nor before every rank has sent it), so
    ``rest`` is never negative, however busy the machine. The end of the bar before is no
    stand-in for ``taken_ms``: the trace stamps it in a callback that runs after the link has
    freed the wire, later still when a busy core delays that thread."""
    mine, rows = views[0], []
    for bar, on_wire in zip(mine.buckets, taken_ms, strict=True):
        slowest_launch = max(v.buckets[bar.index].launched_ms for v in views)
        modelled_end = on_wire + wire_ms(bar.nbytes)
        explained_end = max(modelled_end, slowest_launch)
        rows.append(dict(index=bar.index, nbytes=bar.nbytes, bar=bar.finished_ms - bar.launched_ms,
                         queued=on_wire - bar.launched_ms, wire=modelled_end - on_wire,
                         late_peer=explained_end - modelled_end, rest=bar.finished_ms - explained_end))
    return rows


def show_bar_lengths(steps: dict, wire_ms, taken_ms: list[float]) -> None:
    """Rank 0's last bars, explained: the model's wire time, and what made each bar longer."""
    rows = explain_bars([views[-1] for views in steps.values()], wire_ms, taken_ms)
    print0("\nrank 0's bars, ms: the wire's part is the model's 2(p-1) alpha + 2(p-1)/p bytes / bandwidth;")
    print0("the rest of a bar is waiting (for the wire, for the slowest rank to launch the same bucket) and this")
    print0("machine's own delay: the real sum on Gloo and the link's thread share the cores with backward and with")
    print0("whatever else runs here (a clock figure: shown, not checked)")
    print0(f"  {'bucket':>6} {'KiB':>6} {'bar':>6} = {'queued':>6} + {'on the wire':>11} + {'late peer':>9} + {'machine':>7}")
    for r in rows:
        print0(f"  {r['index']:>6} {r['nbytes'] / 1024:>6.0f} {r['bar']:>6.1f} = {r['queued']:>6.1f} + "
               f"{r['wire']:>11.1f} + {r['late_peer']:>9.1f} + {r['rest']:>7.1f}")
    # The simulated link never delivers before the model's time after it took a message, nor before
    # every rank has sent it: a bar shorter than its explanation would mean the explanation is wrong.
    # (1e-6 ms: float rounding of the stamps, ms since the clock's start.)
    assert all(r["rest"] > -1e-6 for r in rows), f"a bar ended before the model allows: {rows}"


def check_and_show(trace: dict, n_buckets: int, one_wire: bool, wire_ms=None, taken_ms=None) -> None:
    """Rank 0: read the trace back, assert what it shows, draw it. With a simulated link,
    ``wire_ms`` is its model and ``taken_ms`` when it took each of rank 0's last bars."""
    steps = read_steps(trace)
    for rank, views in steps.items():
        assert len(views) == STEPS, f"rank {rank}: {len(views)} steps in the trace, expected {STEPS}"
        for v in views:
            indices = [b.index for b in v.buckets]  # in launch order
            assert indices == list(range(len(indices))), f"rank {rank} step {v.step}: bars {indices}"
            if len(v.buckets) > 1:  # (one bucket waits for every gradient: the first step, or a large cap)
                assert v.buckets[0].launched_ms < v.last_hook_ms, "the first bucket leaves during backward"
            if one_wire:  # one message at a time: each ends after the one before it
                ends = [b.finished_ms for b in v.buckets]
                assert ends == sorted(ends), f"rank {rank} step {v.step}: bars ended out of order {ends}"
        assert len(views[-1].buckets) == n_buckets, "one bar per bucket"

    last = steps[0][-1]
    print0(f"\nrank 0, step {last.step} ({len(last.hooks)} gradient hooks, {len(last.buckets)} buckets):")
    draw(last, one_wire)
    under, total = hidden_ms(last, one_wire)
    print0(f"  by this run's clock (shown, not checked), the bars less their wait for the wire: {total:.1f} ms,"
           f"\n  {under:.1f} ms of it before the last gradient hook (under backward)"
           + (": the table below splits each bar" if wire_ms is not None else "")
           + ("" if one_wire else ";\n  with plain Gloo a bar's start is its launch: it may still wait in Gloo's queue"))
    if wire_ms is not None:
        show_bar_lengths(steps, wire_ms, taken_ms)
    print0("\nevery rank's last step:")
    for views in steps.values():
        print0(f"  {views[-1].summary()}")
    print0(f"\nchecked: on every rank, in each of the {STEPS} steps, the trace holds exactly one all-reduce")
    print0("         bar per bucket, launched in bucket order, and the first bucket was launched")
    print0("         before the last gradient hook fired: communication began during backward"
           + (";\n         over the simulated link the bars ended in launch order, one at a time." if one_wire else "."))


def main(rank: int, world_size: int, out: str, link_name: str, bucket_cap_mb: float) -> None:
    torch.manual_seed(0)
    # 0.25 MiB buckets: one layer each, since a bucket closes after the gradient
    # that reaches its cap (256 KiB of weight and 1 KiB of bias; the first bucket
    # holds the small head too). A cap of 25 MiB would pack this 2 MiB model into
    # one bucket (exercise 3). The first step sends one bucket whatever the cap
    # (torch's first guess), then the buckets are cut at it.
    ddp = MiniDDP(make_model(), bucket_cap_mb=bucket_cap_mb, trace=True)
    link = make_link(link_name)
    if link is not None:
        ddp.register_comm_hook(link, simulated_allreduce_hook)  # the same average, at the link's pace
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 256, generator=data), torch.randint(0, 10, (BATCH,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    # ddp.tracer.export_chrome_trace(out) in two steps, keeping the dict: the
    # checks below read what this run recorded, even if another run side by
    # side overwrites the file.
    trace = ddp.tracer.chrome_trace()  # a collective: every rank's events, on rank 0
    if rank != 0:
        return
    with open(out, "w") as f:
        json.dump(trace, f)
    print(f"wrote {out}: {STEPS} steps x {world_size} ranks; open it in https://ui.perfetto.dev")
    wire_ms = taken_ms = None
    if link is not None:
        wire_ms = lambda nbytes: 1e3 * link.predicted_time(nbytes, world_size)  # noqa: E731
        taken_ms = [1e3 * m.started for m in link.messages[-len(ddp.bucket_names):]]  # the last step's, in launch order
    check_and_show(trace, len(ddp.bucket_names), one_wire=link is not None, wire_ms=wire_ms, taken_ms=taken_ms)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("\n(no matplotlib: pip install '.[plot]' to get the same picture as a PNG)")
        return
    png = os.path.splitext(out)[0] + ".png"
    draw_overlap(trace, png, title=f"lesson 16: {world_size} ranks, {bucket_cap_mb:g} MiB buckets")
    print(f"\nwrote {png}")


def options(parser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, help="trace file (JSON)")
    add_link_option(parser)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25, help="MiniDDP's bucket cap (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, os.path.abspath(args.out), args.link, args.bucket_cap_mb)
