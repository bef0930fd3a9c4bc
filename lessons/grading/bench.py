"""The lessons' bench, seen from the grader: a learner's wrapper against one process on the whole batch.

Every rank builds the bench's model (``lessons/_common.make_model``), takes its
slice of the same global batch, runs backward through the learner's wrapper and
compares the gradients with those one process computes on the whole batch.
What it measures is chosen to tell mistakes apart: the spread of the weights
before the first step (nothing broadcast); at the first step whose gradients
are wrong, what each parameter's gradient holds instead (``diagnose``: this
rank's own, rank 0's, the sum, the largest...); the ReduceOps the learner named.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lessons._common import CLASSES, make_model
from lessons.grading.diagnose import explain_gradients, what_each_holds
from lessons.grading.ledger import caller, own

PER_RANK, STEPS, LR = 8, 3, 0.1
# The grader's own: a grader may watch dist.all_reduce for the learner's calls, and must not count its own.
_all_reduce = own.all_reduce


@dataclass
class Seen:
    start_spread: float = 0.0  # max |weight - rank 0's| after wrapping, worst rank
    start_from: int | None = None  # after wrapping every rank holds this rank's starting weights (None: no one's)
    start_off: list = field(default_factory=list)  # the parameters that differ from rank 0's after wrapping
    start_same: list = field(default_factory=list)  # and those that agree, when some differ
    grad_error: float = 0.0  # max |grad - one process's|, over steps, worst rank
    wrong_gradients: str = ""  # at the first wrong step: which parameters hold what (``diagnose``)
    weight_error: float = 0.0  # after the last step, worst rank
    ranks_agree: bool = True  # bit-identical weights at the end
    ops: set = field(default_factory=set)  # the ReduceOps the learner's dist.all_reduce calls named
    frozen_with_grad: list = field(default_factory=list)  # parameters not requiring a gradient whose .grad is set
    tolerance: float = 1e-5  # of grad_error and weight_error: see ``off``

    def exact(self) -> bool:
        return (self.start_spread == 0 and self.grad_error < self.tolerance and self.weight_error < self.tolerance
                and self.ranks_agree)


def off(mine: torch.Tensor, right: torch.Tensor) -> float:
    """How far ``mine`` is from ``right``: the largest difference; for a low-precision dtype, as a fraction of
    ``right``'s largest number (its rounding grows with the numbers, and a sum of slices rounds otherwise than
    one process's whole batch)."""
    difference = (mine.double() - right.double()).abs().max().item()
    if right.dtype in (torch.float32, torch.float64):
        return difference
    return difference / max(right.double().abs().max().item(), 1e-30)


def tolerance_for(dtype: torch.dtype) -> float:
    """What ``off`` may be for a right wrapper: float32 rounding of 3 slices' sum; for a narrower dtype 8 of its
    roundings (a right bfloat16 wrapper is off by up to 2.5 of them here; a wrong one by the gradient's scale)."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 8 * torch.finfo(dtype).eps


def worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    _all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in module.parameters()])


def flat_weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def agree(weights: torch.Tensor) -> bool:
    highest = weights.clone()
    _all_reduce(highest, op=dist.ReduceOp.MAX)
    return worst(float(not torch.equal(highest, weights))) == 0.0


@contextlib.contextmanager
def ops_named(ops: set):
    """Note, in ``ops``, the ReduceOp of every dist.all_reduce the learner calls (SUM when none is named)."""
    inner = dist.all_reduce

    broadcast = dist.broadcast

    def all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        ops.add(getattr(op, "name", str(op).split(".")[-1]))
        where, own = caller()
        if where and not own and not any(o.startswith("AT ") for o in ops):
            ops.add(f"AT {where}")  # where the learner's first all-reduce is
        if kwargs.get("async_op"):
            ops.add("ASYNC")
        return inner(tensor, op, *args, **kwargs)

    def collective(tensor, *args, **kwargs):  # a broadcast: noted, as "BROADCAST"
        ops.add("BROADCAST")
        return broadcast(tensor, *args, **kwargs)

    dist.all_reduce, dist.broadcast = all_reduce, collective
    try:
        yield
    finally:
        dist.all_reduce, dist.broadcast = inner, broadcast


def slice_gradients(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, loss_fn) -> list[list[torch.Tensor]]:
    """Every rank's own gradients at ``model``'s weights: [rank][parameter], micro-batches accumulated."""
    probe = copy.deepcopy(model)
    everyone = []
    for x, y in zip(xs, ys):  # one rank's micro-batches
        probe.zero_grad()
        for xi, yi in zip(x, y):
            (loss_fn(probe(xi), yi) / len(x)).backward()
        everyone.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in probe.parameters()])
    return everyone


def train_vs_one_process(wrap, backward_done=None, *, model=None, own_seeds: bool = False,
                         micro_batches: int = 1, steps: int = STEPS, step_starts=None) -> Seen:
    """``steps`` SGD steps of ``wrap(model)`` on this rank's slice against one process on every slice.

    ``wrap(module)`` returns an object with ``forward`` (or ``__call__``), an
    optional ``require_sync`` switch and an optional ``finish()`` called after
    each backward. ``own_seeds``: every rank starts from its own random
    weights (the wrapper must broadcast rank 0's). ``backward_done()`` is
    called right after each synchronizing backward returns, before ``finish``;
    ``step_starts(step)`` before each step's first forward.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = model if model is not None else make_model(seed=0)

    def start(seed: int) -> nn.Module:
        module = copy.deepcopy(base)
        if own_seeds:  # this seed's own random weights
            torch.manual_seed(seed)
            for p in module.parameters():
                nn.init.normal_(p, std=0.3)
        return module

    mine, single = start(rank), start(0)  # one process starts from rank 0's weights
    dtype = next(base.parameters()).dtype
    seen = Seen(tolerance=tolerance_for(dtype))
    with ops_named(seen.ops):
        wrapper = wrap(mine)
    seen.start_spread = worst(max((p - q).abs().max().item() for p, q in zip(mine.parameters(), single.parameters())))
    if seen.start_spread > 0:  # which parameters differ, and whose weights each rank holds (a wrong src?)
        names = [name for name, _ in single.named_parameters()]
        spreads = [worst((p - q).abs().max().item()) for p, q in zip(mine.parameters(), single.parameters())]
        seen.start_off = [n for n, spread in zip(names, spreads) if spread > 0]
        seen.start_same = [n for n, spread in zip(names, spreads) if spread == 0]
        holds = next((k for k in range(world_size) if torch.equal(flat_weights(mine), flat_weights(start(k)))), -1)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, holds)
        seen.start_from = everyone[0] if len(set(everyone)) == 1 and everyone[0] >= 0 else None
    loss_fn = nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(1234)
    finish = getattr(wrapper, "finish", lambda: None)
    in_features = next(base.parameters()).shape[1]
    names = [name for name, _ in single.named_parameters()]
    for step in range(steps):
        x = torch.randn(world_size, micro_batches, PER_RANK, in_features, generator=data).to(dtype)
        y = torch.randint(0, CLASSES, (world_size, micro_batches, PER_RANK), generator=data)
        if step_starts is not None:
            step_starts(step)
        mine.zero_grad()
        with ops_named(seen.ops):
            for i in range(micro_batches):
                last = i == micro_batches - 1
                if hasattr(wrapper, "require_sync"):
                    wrapper.require_sync = last
                (loss_fn(wrapper(x[rank, i]), y[rank, i]) / micro_batches).backward()
                if last and backward_done is not None:
                    backward_done()
                finish()
        single.zero_grad()
        loss_fn(single(x.reshape(-1, in_features)), y.reshape(-1)).backward()
        error = worst(off(flat_grads(mine), flat_grads(single)))
        if error >= seen.tolerance and not seen.wrong_gradients:  # the first wrong step: say what each parameter holds
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in mine.parameters()]
            held = what_each_holds(names, grads, slice_gradients(single, x, y, loss_fn))
            seen.wrong_gradients = explain_gradients(held, world_size, seen.ops, step, error)
        seen.grad_error = max(seen.grad_error, error)
        sgd_step(mine)
        sgd_step(single)
    seen.frozen_with_grad = [name for name, p in mine.named_parameters() if not p.requires_grad and p.grad is not None]
    seen.weight_error = worst(off(flat_weights(mine), flat_weights(single)))
    seen.ranks_agree = agree(flat_weights(mine))
    return seen


@torch.no_grad()
def sgd_step(module: nn.Module, lr: float = LR) -> None:
    """Plain SGD, as ``torch.optim.SGD`` steps (whose first use imports torch's compiler: seconds on each rank)."""
    for p in module.parameters():
        if p.grad is not None:
            p.add_(p.grad, alpha=-lr)


def explain(seen: Seen, world_size: int, what: str = "") -> list[str]:
    """The failures a Seen shows, most telling first, in a learner's words."""
    if seen.exact():
        return []
    if seen.start_spread > 0 and seen.start_from is not None:
        return [f"{what}before the first step every rank holds rank {seen.start_from}'s starting weights, not rank "
                f"0's: broadcast from src=0 (one process on the whole batch starts from rank 0's)"]
    if seen.start_spread > 0 and seen.start_same:
        return [f"{what}before the first step the ranks' {', '.join(seen.start_off)} differ from rank 0's (by up to "
                f"{seen.start_spread:.2g}) while {', '.join(seen.start_same)} agree: broadcast every parameter"]
    if seen.start_spread > 0:
        if "BROADCAST" in seen.ops:
            return [f"{what}the ranks' weights differ from rank 0's before the first step (by up to "
                    f"{seen.start_spread:.2g}), though your code called dist.broadcast: a broadcast writes rank 0's "
                    f"numbers into the very tensor it is given on every other rank; if that was a copy (.clone(), "
                    f"torch.cat of the parameters), copy the result back into the parameters"]
        return [f"{what}the ranks' weights differ from rank 0's before the first step (by up to {seen.start_spread:.2g}): "
                f"nothing was broadcast, so each rank trains its own model"]
    if seen.wrong_gradients:
        return [f"{what}{seen.wrong_gradients}"]
    if not seen.ranks_agree:
        return [f"{what}the ranks' weights differ after training: every rank must apply the same averaged gradient"]
    return [f"{what}the weights differ from one process on the whole batch by {seen.weight_error:.2g} after {STEPS} steps"]


def gather_failures(failures: list[str]) -> list[str]:
    """The failures of the lowest rank that has any (the others mostly see the same mistake): the same on every rank."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures)
    return next((part for part in everyone if part), [])
