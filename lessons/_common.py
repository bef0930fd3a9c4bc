"""The little every lesson shares: its command line, starting ranks, printing,
and the frozen test bench of lessons 04 to 08.

Kept small on purpose, so that each lesson still reads top to bottom. From
lesson 02 on, ranks are started with ``minddp.launch.spawn``, which wraps
``torch.multiprocessing.spawn`` (lesson 02 shows how it works underneath),
through the lab's ``minddp_lab.links.spawn`` (the same, behind a real link
when ``--link real:RATE`` asks for one).

Lessons 04-08 each build one data-parallel wrapper and hand it to
:func:`train_and_compare`: the same model, the same data, the same
single-process reference and the same result table every time, so that
``diff lessons/05_gradient_hooks.py lessons/06_async_overlap.py`` shows the
wrapper's new idea and little else.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from minddp_lab.links import namespaces as links, spawn
from minddp_lab.network import PRESETS, Link, ring_bytes_sent_per_rank
from minddp_lab.simulated_link import SimulatedLink

REAL = "real:"  # --link real:1gbit: real links between the ranks (minddp_lab/links/namespaces.py), not a simulated one


def parse_args(doc: str, world_size: int = 2, extra=None, min_world_size: int = 1) -> argparse.Namespace:
    """``--world-size N`` (default 2), ``--reveal``, plus whatever ``extra(parser)`` adds.

    ``--reveal`` prints the lesson's Try this with the answers from
    ``lessons/answers.md``, and exits before any rank starts.

    A lesson that compares ranks with each other passes ``min_world_size=2``
    and stops with one line when given fewer.
    """
    first_line = (doc or "").strip().splitlines()[0] if doc else None
    parser = argparse.ArgumentParser(description=first_line)
    parser.add_argument("--world-size", type=int, default=world_size, help="number of processes (default %(default)s)")
    parser.add_argument("--reveal", action="store_true", help="print the answers to this lesson's Try this, and stop")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if args.reveal:
        from _answers import reveal  # lessons/ is on the path of a lesson run as a script

        print(reveal(doc))
        parser.exit(0)
    if args.world_size < min_world_size:
        parser.exit(2, f"this lesson compares ranks with each other: run it with --world-size {min_world_size} or more\n")
    return args


def add_link_option(parser: argparse.ArgumentParser, default: str = "laptop") -> None:
    """``--link NAME``: a simulated network from ``minddp_lab.network.PRESETS``, ``none``, or ``real:RATE``."""
    parser.add_argument("--link", default=default, type=_link_name, metavar="{" + ",".join([*PRESETS, "none"]) + ",real:RATE}",
                        help="simulated network for the all-reduces (default %(default)s; none: plain Gloo; "
                        "real:1gbit: each rank in a network namespace of its own, joined by links shaped to that "
                        "rate, plain Gloo over them; needs root)")  # fmt: skip


def _link_name(text: str) -> str:
    if text in PRESETS or text == "none":
        return text
    if not text.startswith(REAL):
        raise argparse.ArgumentTypeError(f"unknown link {text!r}: choose from {', '.join(PRESETS)}, none, or real:RATE")
    try:
        rate = links.format_rate(links.parse_rate(text[len(REAL):]))
    except links.LinkError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None
    if links.missing():
        raise argparse.ArgumentTypeError(f"{text}: {links.missing()}")
    return REAL + rate


def is_real(name: str) -> bool:
    return name.startswith(REAL)


def wire_model(name: str) -> SimulatedLink | None:
    """For ``real:RATE``: a simulated link with the real one's numbers (its rate, no added latency),
    to *predict* with, never to send through; None otherwise."""
    if not is_real(name):
        return None
    rate = links.parse_rate(name[len(REAL):])
    return SimulatedLink(Link(name, alpha_s=0.0, bandwidth_Bps=rate / 8, source="a real link shaped by tc"))


def make_link(name: str) -> SimulatedLink | None:
    """The simulated link a wrapper sends its buckets through; None for plain Gloo (``none``, ``real:RATE``)."""
    return None if name == "none" or is_real(name) else SimulatedLink(name)


def _entry(rank: int, world_size: int, fn, args: tuple) -> None:
    # Two processes on a laptop each spawning a thread per core would fight
    # over the same cores; one thread each keeps timings honest and runs fast.
    torch.set_num_threads(1)
    fn(rank, world_size, *args)


def run(fn, world_size: int, *args, link: str = "none") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; with ``link="real:RATE"`` each
    in a network namespace of its own, joined to the others by links shaped to that rate."""
    # Forked ranks inherit the imported torch instead of importing it again,
    # which halves a lesson's start-up. Linux only: macOS forks badly once
    # system frameworks are loaded, so there each rank starts afresh.
    spawn(_entry, world_size, fn, args, backend="gloo", start_method="fork" if sys.platform == "linux" else "spawn",
          link=link[len(REAL):] if is_real(link) else None)


def print_ranks(text: str) -> None:
    """Every rank passes one line; rank 0 prints them all, in rank order.

    Plain ``print`` from several processes interleaves at random. Gathering
    the lines first makes the output the same on every run.
    """
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, text)
    if dist.get_rank() == 0:
        for r, line in enumerate(lines):
            print(f"  [rank {r}] {line}", flush=True)


def short_group(timeout_s: float) -> dist.ProcessGroup:
    """A fresh group whose collectives give up after ``timeout_s`` (the default group keeps
    its long timeout, so the ranks can still meet after a failure). The ranks first meet on
    the default group, so that the short timeout times the hang a lesson sets up, not a
    rank arriving late on a busy machine."""
    dist.barrier()
    return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))


def c_stderr(fn) -> str:
    """Run ``fn`` with this process's stderr (file descriptor 2, where torch's C++ warnings go) caught; its text."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        return caught.read().decode(errors="replace")


def print0(*args) -> None:
    """Print on rank 0 only (or when no process group is running)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


# ---------------------------------------------------------------------------
# The test bench of lessons 04-08. Frozen: a lesson changes its wrapper, not
# this. A wrapper is anything with the module's parameters that averages
# gradients; it may offer ``require_sync`` (False while accumulating),
# ``no_sync()`` (torch's and MiniDDP's spelling of the same switch) and
# ``finish_gradient_synchronization()`` (called after every backward).

FEATURES, CLASSES = 20, 4


def make_model(seed: int, width: int = 64, depth: int = 2) -> nn.Sequential:
    """``depth`` hidden layers of ``width``; ``seed`` sets the starting weights."""
    torch.manual_seed(seed)
    layers, size = [], FEATURES
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, CLASSES))


@dataclass
class Result:
    name: str
    start_spread: float  # max |weight - rank 0's| right after wrapping, over ranks
    grad_error: float  # max |averaged grad - one process's full-batch grad|, all steps
    weight_error: float  # max |weight - one process's weight| after the last step
    ranks_agree: bool  # every rank holds bit-identical weights at the end
    # The last step's communication on rank 0, counted (not timed: a clock on a shared machine
    # measures the other programs too): collectives by name, and the bytes a ring all-reduce
    # makes each rank send for them, 2 (p-1)/p of the tensors' bytes.
    collectives: Counter = field(default_factory=Counter)
    ring_bytes_sent: float = 0.0

    @property
    def all_reduces(self) -> int:
        return self.collectives["allreduce_"]


class CountCollectives(TorchDispatchMode):
    """Inside ``with CountCollectives() as count:``, every collective this thread launches, with its
    bytes: ``count.calls`` holds ``(name, bytes)`` pairs, e.g. ``("allreduce_", 1024)``.

    A dispatch mode sees each operation torch runs on this thread, the c10d collectives
    included, whoever launches them: a lesson's wrapper, MiniDDP, or torch's DDP from C++.
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "wait" not in func.__name__:
            tensors = args[0] if args and isinstance(args[0], (list, tuple)) else []
            self.calls.append((func.__name__.split(".")[0], sum(t.nbytes for t in tensors if hasattr(t, "nbytes"))))
        return func(*args, **(kwargs or {}))


def _sync_switch(ddp, sync: bool):
    if hasattr(ddp, "require_sync"):
        ddp.require_sync = sync
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else ddp.no_sync()


def _worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def train_and_compare(name: str, wrap, rank: int, world_size: int, *, width: int = 64, depth: int = 2,
                      per_rank: int = 8, micro_batches: int = 1, steps: int = 3, lr: float = 0.1,
                      reference: bool = True):
    """Train ``wrap(model)`` for ``steps`` SGD steps against one process on the whole batch.

    Every rank starts from its *own* random weights (seed = rank): the
    wrapper must make them rank 0's. Each step every rank takes its slice of
    ``per_rank * micro_batches`` samples out of the same global batch, in
    ``micro_batches`` backward passes (syncing on the last only). Returns
    ``(Result, wrapper)``; every rank gets the same Result. ``reference=False``
    skips the single process (errors then read nan): for sweeps that only
    need the trained wrapper.
    """
    ddp = wrap(make_model(seed=rank, width=width, depth=depth))
    single = make_model(seed=0, width=width, depth=depth)  # rank 0's start, on every rank
    start_spread = _worst(max((p - q).abs().max().item() for p, q in zip(ddp.parameters(), single.parameters())))
    opt, opt_single = torch.optim.SGD(ddp.parameters(), lr=lr), torch.optim.SGD(single.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()  # a mean over the batch: what makes averaging exact
    data = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    finish = getattr(ddp, "finish_gradient_synchronization", lambda: None)
    batches, synced_grads = [], []
    for step in range(steps):
        x = torch.randn(world_size, micro_batches, per_rank, FEATURES, generator=data)
        y = torch.randint(0, CLASSES, (world_size, micro_batches, per_rank), generator=data)
        opt.zero_grad()
        # Only the last step is counted: a dispatch mode sees every operation, and would slow
        # down the steps a wrapper may be measuring itself (plan_buckets).
        count = CountCollectives() if step == steps - 1 else contextlib.nullcontext()
        with count:
            for i in range(micro_batches):
                with _sync_switch(ddp, i == micro_batches - 1):
                    # The mean of k equal parts' means, each divided by k, is the whole's mean.
                    (loss_fn(ddp(x[rank, i]), y[rank, i]) / micro_batches).backward()
                finish()
        if reference:
            batches.append((x, y))
            synced_grads.append([p.grad.clone() for p in ddp.parameters()])
        opt.step()

    # One process on each whole batch, after the wrapper's steps, so that those ran back to
    # back as in training (nothing of the reference's work between one backward and the next).
    grad_error = 0.0
    for (x, y), grads in zip(batches, synced_grads):
        opt_single.zero_grad()
        loss_fn(single(x.reshape(-1, FEATURES)), y.reshape(-1)).backward()
        grad_error = max(grad_error, *((g - q.grad).abs().max().item() for g, q in zip(grads, single.parameters())))
        opt_single.step()

    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    highest = weights.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    agree = _worst(float(not torch.equal(highest, weights))) == 0.0
    weight_error = max((p - q).abs().max().item() for p, q in zip(ddp.parameters(), single.parameters()))
    if not reference:
        grad_error = weight_error = float("nan")
    collectives = [None] * world_size
    dist.all_gather_object(collectives, count.calls)  # rank 0's count is the table's; ranks must match
    collectives = collectives[0]
    sent = sum(ring_bytes_sent_per_rank(n, world_size) for kind, n in collectives if kind == "allreduce_")
    return Result(name, start_spread, _worst(grad_error), _worst(weight_error), agree,
                  Counter(kind for kind, _ in collectives), sent), ddp


def describe_collectives(r: Result) -> str:
    """``"6 all-reduces"``, plus any other collective of the step: ``"3 all-reduces, 2 broadcast_"``."""
    others = [f"{n} {kind}" for kind, n in sorted(r.collectives.items()) if kind != "allreduce_"]
    return ", ".join([f"{r.all_reduces} all-reduce{'s' if r.all_reduces != 1 else ''}"] + others)


def print_results(results: list[Result]) -> None:
    print0(f"  {'wrapper':<34} {'start spread':>12} {'grad error':>10} {'weight error':>12} {'ranks agree':>11} "
           f"{'collectives, last step':>24} {'KB sent':>8}")
    for r in results:
        print0(f"  {r.name:<34} {r.start_spread:>12.1e} {r.grad_error:>10.1e} {r.weight_error:>12.1e} "
               f"{'yes' if r.ranks_agree else 'NO':>11} {describe_collectives(r):>24} {r.ring_bytes_sent / 1e3:>8.1f}")
    print0("  (errors: max |difference| from one process training on the whole batch; spread: from rank 0;")
    print0("   collectives: those rank 0 launched in the last step, counted; KB sent: by each rank, for those")
    print0("   all-reduces, if each is a ring: 2 (p-1)/p of its bytes)")


def is_exact(r: Result, tolerance: float = 1e-5) -> bool:
    """Right in every column: float32 rounding of sums in another order stays far below 1e-5."""
    return r.start_spread == 0 and r.grad_error < tolerance and r.weight_error < tolerance and r.ranks_agree
