"""Lesson 24: overlap under torch.compile -- one backward node, the graph cut at the buckets, the overlap back.

What you will learn
    Overlap (lessons 06 and 16) needs gradients to arrive one layer at a
    time, so a bucket can leave while backward still computes the layers
    below it. ``torch.compile`` changes that: AOT autograd makes the compiled
    graph's whole backward *one* autograd node, which hands every gradient
    over at its end. Every hook fires after it, every bucket leaves after
    backward's compute is over: no overlap at all.

    The cure is torch's DDPOptimizer's idea: cut the graph into pieces of a
    bucket's worth of parameters and compile each piece on its own, so the
    backward has one node per piece. ``minddp.compile`` does that at
    MiniDDP's own bucket caps (``minddp/ddp/compiled.py``), and makes the
    buckets exactly the pieces, which torch's DDP cannot: its buckets are
    built apart from the cut.

    Overlap is measured here without a clock, by the *launch fraction*: the
    gradient bytes whose all-reduce started before the last backward node
    ended (``minddp/ddp/observers/launch_fraction.py``). A 2-core machine
    cannot time the overlap, but it can count this, the same on every run.

What to run
    python lessons/24_compiled_overlap.py [--backend aot_eager|inductor] [--layers 4]

What to look at
    Four lines, one per way of running the same model: the backward's
    nodes (and how many are compiled), the buckets, the launch fraction.
    Eager: (layers-1)/layers, the last bucket can only leave at the end.
    Compiled whole: one compiled node, 0. Cut: one compiled node per
    bucket, the eager fraction again. Buckets that straddle the pieces:
    a bucket waits for the next piece, and the fraction drops.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. With ``--layers 8``, what fraction does each way reach?
    2. In the last line a cap of two weights closes the first bucket one
       tensor into the second piece. Which piece does it wait for, and
       what does a torch DDP bucket that ends like this cost?
    3. Why is the fraction never 1, however the graph is cut?
"""

import torch
import torch.nn.functional as F
from torch import nn

from _common import parse_args, print0, run
from minddp import MiniDDP
from minddp.ddp.compiled import BucketCut
from minddp.ddp.observers.launch_fraction import LaunchFraction

WIDTH = 64
CAP_MB = WIDTH * WIDTH * 4 / 2**20  # one layer's weight: each layer fills its own bucket


def make_model(seed: int, layers: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def train_and_count(model, reducer, rank: int, steps: int = 3):
    """A few steps (the buckets settle after the first); the last step's launches counted."""
    counter = LaunchFraction()
    reducer.add_observer(counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        counter.watch(loss)
        loss.backward()
        opt.step()
    return counter.report()


def show(name: str, report, reducer) -> None:
    print0(f"  {name:<38} {report.nodes:3d} nodes ({report.compiled_nodes} compiled), "
           f"{len(reducer.buckets)} buckets, launch fraction {report.fraction:.3f}")


def main(rank: int, world_size: int, backend: str, layers: int) -> None:
    torch.set_num_threads(1)
    torch._dynamo.reset()
    print0(f"{layers} layers, buckets of one layer each, backend {backend!r}, {world_size} ranks")

    # 1. Eager: each layer's backward is a node of its own; all but the last bucket leave early.
    eager = MiniDDP(make_model(rank, layers), bucket_cap_mb=CAP_MB)
    eager_report = train_and_count(eager, eager.reducer, rank)
    show("eager MiniDDP", eager_report, eager.reducer)

    # 2. torch.compile: one compiled node, every bucket after it.
    whole = torch.compile(MiniDDP(make_model(rank, layers), bucket_cap_mb=CAP_MB), backend=backend)
    whole_report = train_and_count(whole, whole._orig_mod.reducer, rank)
    show("torch.compile(MiniDDP(model))", whole_report, whole._orig_mod.reducer)

    # 3. The cut (what minddp.compile does): one compiled node per piece, the buckets are the pieces.
    cut = BucketCut(backend)
    pieces_model = torch.compile(MiniDDP(make_model(rank, layers), bucket_cap_mb=CAP_MB), backend=cut)
    reducer = pieces_model._orig_mod.reducer
    cut_report = train_and_count(pieces_model, reducer, rank)
    show("cut at the buckets (minddp.compile)", cut_report, reducer)
    buckets = [list(b.indices) for b in reducer.buckets]
    print0(f"    pieces {cut.cuts[-1].pieces}\n    buckets {buckets}")

    # 4. Buckets that disagree with the pieces: two layers each, by a cap, over the same cut.
    reducer.rebuild(reducer.bucket_order, 2 * int(CAP_MB * 2**20), None)
    straddle_report = train_and_count(pieces_model, reducer, rank, steps=1)
    show("the same cut, buckets by a 2-layer cap", straddle_report, reducer)
    piece_of = {i: k for k, piece in enumerate(cut.cuts[-1].pieces) for i in piece}
    spans = [sorted({piece_of[i] for i in b.indices}) for b in reducer.buckets]
    print0(f"    buckets {[list(b.indices) for b in reducer.buckets]}: pieces each waits for {spans}")

    early = (layers - 1) / layers
    assert eager_report.compiled_nodes == 0 and eager_report.fraction == early, eager_report
    assert whole_report.compiled_nodes == 1 and whole_report.fraction == 0.0, \
        f"compiled whole: expected one compiled node and fraction 0, saw {whole_report}"
    assert cut_report.compiled_nodes == len(buckets) == layers, f"cut: one node per bucket expected: {cut_report}"
    assert buckets == cut.cuts[-1].pieces, f"the buckets {buckets} are not the pieces {cut.cuts[-1].pieces}"
    assert cut_report.fraction == eager_report.fraction, f"cut {cut_report.fraction} != eager {eager_report.fraction}"
    assert any(len(span) > 1 for span in spans), f"no bucket spans two pieces: {spans}"
    assert straddle_report.fraction < cut_report.fraction, f"buckets across pieces: {straddle_report}"
    print0("checked: compiled whole, 1 node and fraction 0; cut at the buckets, one node per bucket and the "
           "eager fraction; buckets across pieces, a lower one")


def options(parser) -> None:
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend (default %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args.backend, args.layers)
