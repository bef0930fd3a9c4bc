"""Overlap under torch.compile, counted: the launch fraction of MiniDDP and torch's DDP, eager and compiled.

    python benchmarks/compile_overlap.py [--backend aot_eager|inductor] [--layers 8] [--width 512]
                                         [--time-rounds 0] [--link real:1gbit]

Six ways of training the same MLP (``--layers`` Linear(width, width), buckets
of 1 MiB, torch's smallest that compiles) on two Gloo ranks: MiniDDP eager,
compiled whole (``torch.compile(MiniDDP(m))``) and cut at its buckets
(``minddp.compile(MiniDDP(m))``); torch's DDP eager and compiled inside
(``DDP(torch.compile(m))``) with its
DDPOptimizer on (``torch._dynamo.config.optimize_ddp``, the default) and off.
For each, after a few steps: the backward's nodes (how many compiled), the
buckets, and the launch fraction, the gradient bytes whose all-reduce started
before the last backward node ended (``minddp/ddp/observers/launch_fraction.py``).
A count of events, the same on a loaded machine as on an idle one; it says
whether overlap can happen, not what it saves.

``--time-rounds N`` also times each way's step, N interleaved rounds (every
way once per round, so a change in load hits all alike), and prints the
median and the spread; ``--link real:RATE`` runs the ranks behind a real
shaped link (root, Linux), where the overlap the fraction allows shows in
the step time. torch's DDP carries a Python comm hook (to count its launches)
in every way it runs, a few microseconds per bucket.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import MiniDDP
from minddp.ddp.observers.launch_fraction import LaunchFraction

BUCKET_CAP_MB = 1.0
WAYS = ["MiniDDP eager", "MiniDDP compiled whole", "MiniDDP compiled, cut", "torch DDP eager",
        "torch DDP compiled, optimize_ddp on", "torch DDP compiled, optimize_ddp off"]


def _model(layers: int, width: int) -> nn.Module:
    """The MLP, behind a forward compiled afresh for each way.

    [Note: one compiled cache per way]
    Dynamo keeps compiled code on the forward's code object, and its guards do not look at
    ``optimize_ddp``: two models of one class share a cache, and the second way compiled would
    run the first one's graphs. ``exec`` makes a new code object each time."""
    torch.manual_seed(0)
    namespace: dict = {}
    exec("def forward(self, x):\n    return self.layers(x)\n", namespace)
    model = type("MLP", (nn.Module,), {"forward": namespace["forward"]})()
    model.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    return model


def _build(way: str, layers: int, width: int, backend: str):
    """(the model to call, its launch counter): MiniDDP's counter is an observer, torch's a comm hook."""
    counter = LaunchFraction()
    if way.startswith("MiniDDP"):
        mini = MiniDDP(_model(layers, width), bucket_cap_mb=BUCKET_CAP_MB)
        mini.reducer.add_observer(counter)
        if "whole" in way:
            return torch.compile(mini, backend=backend), counter
        if "cut" in way:
            return minddp.compile(mini, backend=backend), counter
        return mini, counter
    # Compiled inside: torch.compile(TorchDDP(m)) stops at a graph break in DDP's forward (torch 2.15) and runs
    # the module eagerly; TorchDDP(torch.compile(m)) is where torch's DDPOptimizer cuts.
    module = _model(layers, width)
    ddp = TorchDDP(torch.compile(module, backend=backend) if "compiled" in way else module, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(None, counter.torch_ddp_hook)
    return ddp, counter


def _step(model, opt, counter, x, y) -> None:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    counter.watch(loss)
    loss.backward()
    opt.step()


def _measure(rank: int, world_size: int, layers: int, width: int, backend: str, rounds: int, steps: int) -> None:
    torch.set_num_threads(1)
    x, y = torch.randn(32, width), torch.randn(32, width)
    built = {}
    for way in WAYS:
        model, counter = _build(way, layers, width, backend)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with torch._dynamo.config.patch(optimize_ddp="optimize_ddp off" not in way):
            for _ in range(3):  # compile, learn the bucket order, settle
                _step(model, opt, counter, x, y)
        built[way] = (model, opt, counter, counter.report())
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way, (model, opt, counter, _) in built.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, opt, counter, x, y)
            times[way].append(1e3 * (time.perf_counter() - start) / steps)
    if rank != 0:
        return
    print(f"{layers} x Linear({width}, {width}), buckets of {BUCKET_CAP_MB:g} MiB, backend {backend!r}, "
          f"{world_size} ranks, torch {torch.__version__}")
    print(f"{'':<38} {'nodes':>5} {'compiled':>8} {'launched':>8} {'fraction':>8}" +
          ("   ms/step median [min, max]" if rounds else ""))
    for way, (_, _, counter, report) in built.items():
        launches = sum(1 for entry in counter.log if entry is not None)
        line = f"{way:<38} {report.nodes:>5} {report.compiled_nodes:>8} {launches:>8} {report.fraction:>8.3f}"
        if rounds:
            t = times[way]
            line += f"   {statistics.median(t):7.2f} [{min(t):.2f}, {max(t):.2f}]"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend (default %(default)s)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--time-rounds", type=int, default=0, help="interleaved timing rounds (default: none)")
    parser.add_argument("--steps", type=int, default=5, help="steps per way per round (default %(default)s)")
    parser.add_argument("--link", default=None, help="real:RATE: the ranks behind a real shaped link (root)")
    args = parser.parse_args()
    from minddp_lab.links import spawn  # the lab's spawn: minddp.launch.spawn, behind a real link when asked

    link = args.link[len("real:"):] if args.link and args.link.startswith("real:") else args.link
    spawn(_measure, 2, args.layers, args.width, args.backend, args.time_rounds, args.steps, backend="gloo", link=link)


if __name__ == "__main__":
    main()
