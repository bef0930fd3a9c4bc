"""What every rank runs for the two overlap extras: ``--learned-order`` and ``--trace``.

Learned bucket order
    MiniDDP first buckets gradients in *reverse registration order*, its
    guess at the order backward produces them, and (``learn_bucket_order=True``,
    the default) rebuilds the buckets after the first synchronized backward in
    the order the gradients really arrived. The guess is right for an
    ``nn.Sequential``, so the benchmark's usual models cannot show what
    learning buys. :class:`ShuffledMLP` can: its layers are *registered* in a
    shuffled order but *run* in a fixed one. With the guessed order, bucket 0
    holds a layer whose gradient comes late, and since buckets launch strictly
    in order, every bucket behind it waits too: communication bunches up at
    the end of backward. :func:`measure_learned_order` times both settings in
    alternating blocks and counts, from ``MiniDDP.timeline``, how many
    buckets were launched before the last gradient hook fired (that count does
    not depend on the machine's speed; the times do).

Trace
    :func:`record_trace` runs a few extra steps of ``MiniDDP(trace=True)``
    after warm-up and writes the Chrome trace (``minddp/ddp/observers/trace.py``); the
    parent process reads it back with ``minddp_lab/trace_view.py``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SHUFFLED = "shuffled_mlp"  # the name --models and the JSON use for ShuffledMLP

# Layer i of the forward pass is registered at position REGISTRATION_ORDER.index(i):
# a fixed shuffle, so every run (and every rank) builds the same model. The
# input layer comes last (as in a model whose __init__ builds its head before
# its stem): reverse registration order then puts the gradient that backward
# computes *last* into bucket 0, and strict bucket order makes every other
# bucket wait for it. tests/benchmarks/test_benchmark.py relies on that.
REGISTRATION_ORDER = [6, 2, 9, 4, 7, 1, 8, 3, 5, 0]
WIDTH = 512  # hidden layers of 512 x 512 floats: 1 MiB of gradient each, ~9.6 MiB in all


class ShuffledMLP(nn.Module):
    """Ten Linear layers run in order 0..9, registered in :data:`REGISTRATION_ORDER`.

    Takes MNIST-shaped images and returns logits for 10 classes, like the
    ``mlp`` of ``minddp_lab.models``, so the benchmark feeds it the same batches.
    """

    def __init__(self):
        super().__init__()
        fans = [(28 * 28, WIDTH)] + [(WIDTH, WIDTH)] * 8 + [(WIDTH, 10)]
        layers = [nn.Linear(fan_in, fan_out) for fan_in, fan_out in fans]
        for i in REGISTRATION_ORDER:  # registration order = named_parameters() order
            self.add_module(f"layer{i}", layers[i])
        self.execution_order = [f"layer{i}" for i in range(len(layers))]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        for k, name in enumerate(self.execution_order):
            x = getattr(self, name)(x)
            if k < len(self.execution_order) - 1:
                x = F.relu(x)
        return x


def launched_before_last_hook(ddp) -> int:
    """Buckets of the last synchronized backward launched before its last gradient hook."""
    tl = ddp.timeline
    return sum(1 for t in tl.launches if t < tl.last_hook)


def measure_learned_order(runner) -> dict:
    """MiniDDP with ``learn_bucket_order`` True vs False on ``runner``'s model.

    Same protocol as the table (``Runner.medians``): warm-up steps (the
    learned order is in place after the first), then rounds of one block
    each of ``local``, ``allreduce`` and the two settings, in an order that
    rotates every round; the slowest rank's time per block, median over
    rounds. MiniDDP with ``gradient_as_bucket_view=True`` in both.
    """
    steps = {
        "local": runner.stepper(runner.fresh()),
        "allreduce": runner.allreduce_step(),
        "learned": runner.stepper(runner.wrap_minddp(runner.fresh(), learn_bucket_order=True, timeline=True)),
        "registration": runner.stepper(runner.wrap_minddp(runner.fresh(), learn_bucket_order=False, timeline=True)),
    }
    out = {"median_ms": runner.medians(steps)}
    for name in ("learned", "registration"):
        ddp = steps[name].module
        out[f"buckets_{name}"] = len(ddp.bucket_names)  # this rank's; every rank builds the same
        out[f"launched_before_last_hook_{name}"] = launched_before_last_hook(ddp)  # rank 0's is reported
    return out


def record_trace(runner, path: str, n_steps: int) -> None:
    """Warm up ``MiniDDP(trace=True)``, keep the events of ``n_steps`` more steps, write ``path`` on rank 0."""
    step = runner.stepper(runner.wrap_minddp(runner.fresh(), trace=True))
    for _ in range(runner.cfg["warmup"]):  # first steps: allocation, bucket rebuild; not shown
        step()
    step.module.tracer.clear()
    dist.barrier()  # start the shown steps together on every rank
    for _ in range(n_steps):
        step()
    step.module.tracer.export_chrome_trace(path)


def learned_order_row(cfg: dict, make_runner: Callable, say: Callable[[str], None]) -> dict:
    """:func:`measure_learned_order` on :class:`ShuffledMLP` at ``cfg["learned_order_cap_mb"]``;
    ``say``: where to tell what it does (rank 0's progress line)."""
    cap = cfg["learned_order_cap_mb"]
    say(f"learned vs registration bucket order, {SHUFFLED}, bucket cap {cap:g} MB ...")
    return {"model": SHUFFLED, "bucket_cap_mb": cap, **measure_learned_order(make_runner(SHUFFLED, cap))}


def record_traces(cfg: dict, make_runner: Callable, say: Callable[[str], None]) -> None:
    """:func:`record_trace` for every model of ``cfg["trace_files"]``, at the first bucket cap."""
    for name, path in cfg.get("trace_files", {}).items():
        say(f"tracing {name} -> {path} ...")
        record_trace(make_runner(name, cfg["bucket_caps"][0]), path, cfg["trace_steps"])
