"""minddp's ZeRO does what torch's ``ZeroRedundancyOptimizer`` does.

Each test runs minddp's optimizer beside torch's on the same data and checks
the parameters after every step: bit for bit where both do the same
arithmetic on the same averaged gradients (2 ranks: a sum of two terms has
one order), and within float32 rounding of one process training on the
whole batch (rtol 1e-5, atol 1e-6, as in tests/library/test_zero.py).

* a parameter whose ``.grad`` is None (frozen for a step, or not used) is
  not stepped and its Adam ``step`` count does not advance; a zero gradient
  is a step;
* a parameter with ``requires_grad=False`` when the optimizer is built is
  still sharded, and trained once unfrozen;
* ``step(closure, **kwargs)`` reaches the local optimizer (LBFGS);
* torch's ``Join`` runs minddp's join hook (torch's ``JoinHook`` contract);
* stage 2 accepts a second group added after construction.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp.zero import ZeroRedundancyOptimizer

PER_RANK = 3
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # float32: per-rank means summed in another order than one mean


class ThreeLayers(nn.Module):
    """``middle`` can be skipped by the forward: an unused parameter for that step."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.middle = nn.Linear(8, 8)
        self.last = nn.Linear(8, 3)

    def forward(self, x, use_middle: bool = True):
        h = torch.tanh(self.first(x))
        if use_middle:
            h = h + torch.tanh(self.middle(h))
        return self.last(h)


def build() -> ThreeLayers:
    torch.manual_seed(0)
    return ThreeLayers()


def data(step: int, size: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g)


def mine_of(x, rank):
    return x[rank * PER_RANK:(rank + 1) * PER_RANK]


def assert_equal_models(mine: nn.Module, theirs: nn.Module, what: str) -> None:
    for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), f"{what} {name}: differs from torch's ZeroRedundancyOptimizer by " \
                                  f"{(p - q).abs().max().item():.3g}"


def assert_close_models(mine: nn.Module, reference: nn.Module, what: str) -> None:
    for (name, p), q in zip(mine.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOLERANCE, msg=lambda m: f"{what} {name}: {m}")


# What happens at each step: (frozen layers, is `middle` used?). `last` is frozen when
# the optimizers are built (item 5), unfrozen at step 2; `middle` is unused at step 1
# and frozen at step 3 (item 4: its .grad is None, so it must not move).
SCHEDULE = [({"last"}, True), ({"last"}, False), (set(), True), ({"middle"}, True), (set(), True)]


def _none_gradients(rank, world_size, mode, opt_name):
    cls, kw = (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}) if opt_name == "adamw" else \
        (torch.optim.Adam, {"lr": 0.05})
    reference, plain_model, torch_model = build(), build(), build()
    theirs = TorchDDP(torch_model, find_unused_parameters=True)
    if mode == "no wrapper":
        model = build()
        opt_kw = {}
    else:
        model = MiniDDP(build(), find_unused_parameters=True, bucket_cap_mb=1e-4)  # ~100 B: several buckets
        opt_kw = {"ddp": model, "shard_gradients": mode == "stage 2",
                  "partition": "greedy" if mode == "greedy" else "flat"}
    module = getattr(model, "module", model)
    for m in (reference, module, torch_model):
        m.last.requires_grad_(False)  # frozen when the optimizer is built
    ref_opt = cls(reference.parameters(), **kw)
    my_opt = ZeroRedundancyOptimizer(module.parameters(), cls, **opt_kw, **kw)
    their_opt = TorchZero(torch_model.parameters(), cls, **kw)
    for step, (frozen, use_middle) in enumerate(SCHEDULE):
        for m in (reference, module, torch_model):
            for name in ("first", "middle", "last"):
                getattr(m, name).requires_grad_(name not in frozen)
        x, y = data(step, PER_RANK * world_size)
        for net, opt, whole in ((reference, ref_opt, True), (model, my_opt, False), (theirs, their_opt, False)):
            opt.zero_grad(set_to_none=True)
            xs, ys = (x, y) if whole else (mine_of(x, rank), mine_of(y, rank))
            F.mse_loss(net(xs, use_middle), ys).backward()
            if net is model and mode == "no wrapper":
                pass  # the optimizer averages itself
            opt.step()
        assert_equal_models(module, torch_model, f"{mode}, step {step}")
        assert_close_models(module, reference, f"{mode}, step {step} (one process)")
    assert not torch.equal(module.last.weight, build().last.weight), "`last`, unfrozen at step 2, never trained"
    return [st["step"].item() for st in ref_opt.state.values()]


@pytest.mark.parametrize("mode", ["no wrapper", "flat", "greedy", "stage 2"])
def test_a_missing_gradient_is_not_a_step_and_a_frozen_parameter_is_sharded(ranks, mode):
    steps = ranks(2).run(_none_gradients, mode, "adam" if mode == "greedy" else "adamw", timeout_s=60)
    assert steps[0] == [5.0, 5.0, 3.0, 3.0, 3.0, 3.0], "the schedule gives each parameter its own step count"


def _nothing_trainable_yet(rank, world_size):
    model = build()
    model.requires_grad_(False)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)  # refused before
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no gradient anywhere: nothing moves
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model.last.requires_grad_(True)
    F.mse_loss(model(*data(0, 2)[:1]), data(0, 2)[1]).backward()
    opt.step()
    assert not torch.equal(model.last.weight, before[4]) and torch.equal(model.first.weight, before[0])


def test_a_parameter_list_with_nothing_trainable_yet_is_accepted(ranks):
    ranks(2).run(_nothing_trainable_yet, timeout_s=60)


# ------------------------------------------------------------------ step(closure, **kwargs)
class ScaledSGD(torch.optim.SGD):
    """An optimizer whose step takes a keyword argument (as some do: GradScaler's, fused ones)."""

    def step(self, closure=None, scale: float = 1.0):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return super().step(closure)


def _closure_reaches_the_local_optimizer(rank, world_size):
    mine, theirs = MiniDDP(build()), TorchDDP(build())
    x, y = data(0, PER_RANK * world_size)
    x, y = mine_of(x, rank), mine_of(y, rank)
    # LBFGS needs the closure (it evaluates the loss again inside its step).
    my_opt = ZeroRedundancyOptimizer(mine.parameters(), torch.optim.LBFGS, ddp=mine, partition="greedy",
                                     lr=0.5, max_iter=3)
    their_opt = TorchZero(theirs.parameters(), torch.optim.LBFGS, lr=0.5, max_iter=3)
    for step in range(2):
        losses = []
        for net, opt in ((mine, my_opt), (theirs, their_opt)):
            def closure(net=net, opt=opt):
                opt.zero_grad()
                loss = F.mse_loss(net(x), y)
                loss.backward()
                return loss
            losses.append(opt.step(closure).item())
        assert losses[0] == losses[1], f"step {step}: the closure's loss"
        assert_equal_models(mine.module, theirs.module, f"LBFGS step {step}")
    # torch's signature: step(closure=None, **kwargs), the kwargs for the local optimizer.
    mine, theirs = MiniDDP(build()), TorchDDP(build())
    my_opt = ZeroRedundancyOptimizer(mine.parameters(), ScaledSGD, ddp=mine, partition="greedy", lr=0.1)
    their_opt = TorchZero(theirs.parameters(), ScaledSGD, lr=0.1)
    for net, opt in ((mine, my_opt), (theirs, their_opt)):
        F.mse_loss(net(x), y).backward()
        assert opt.step(closure=None, scale=3.0) is None
    assert_equal_models(mine.module, theirs.module, "step(closure=None, scale=3.0)")
    # A local optimizer that takes a closure but does not call it steps with
    # the gradients already there (torch's ZeRO: the model's own .grad).
    mine, theirs = MiniDDP(build()), TorchDDP(build())
    my_opt = ZeroRedundancyOptimizer(mine.parameters(), SGDIgnoringClosure, ddp=mine, lr=0.1)
    their_opt = TorchZero(theirs.parameters(), SGDIgnoringClosure, lr=0.1)
    for net, opt in ((mine, my_opt), (theirs, their_opt)):
        F.mse_loss(net(x), y).backward()
        opt.step(closure=lambda: 0.0)
    assert_equal_models(mine.module, theirs.module, "a step whose closure the local optimizer ignores")


class SGDIgnoringClosure(torch.optim.SGD):
    def step(self, closure=None):
        return super().step()


def test_step_passes_closure_and_kwargs_to_the_local_optimizer(ranks):
    ranks(2).run(_closure_reaches_the_local_optimizer, timeout_s=60)


# ------------------------------------------------------------------ Join
def _under_join(rank, world_size, which):
    """Uneven inputs (rank r has r + 2 batches) under torch's Join, beside torch's ZeRO.

    torch's ZeRO joined alone (no DDP) issues its join all-reduce twice per
    shadowed step (its hook calls ``step()``, which notifies again) and
    hangs, so there its reference is what its join hook does, by hand: the
    joined rank calls ``step()`` once per step the others still take.
    """
    from torch.distributed.algorithms.join import Join as TorchJoin

    cls, kw = torch.optim.AdamW, {"lr": 0.05}
    # With torch's DDP, it averages (and shadows its all-reduces); alone, each rank's own gradients.
    # Either way the optimizer is told a wrapper it is not given did the averaging, if any.
    wrap = TorchDDP if which == "torch, with torch's DDP" else (lambda m: m)
    mine, theirs = wrap(build()), wrap(build())
    my_opt = ZeroRedundancyOptimizer(mine.parameters(), cls, partition="greedy", average_gradients=False, **kw)
    their_opt = TorchZero(theirs.parameters(), cls, **kw)
    steps, most = rank + 2, world_size + 1
    for net, opt in ((mine, my_opt), (theirs, their_opt)):
        joinables = [net, opt] if net is not opt and wrap is TorchDDP else [opt]
        by_hand = wrap is not TorchDDP and opt is their_opt
        with TorchJoin(joinables, enable=not by_hand):
            for step in range(steps):
                x, y = data(step, PER_RANK * world_size)
                opt.zero_grad()
                F.mse_loss(net(mine_of(x, rank)), mine_of(y, rank)).backward()
                opt.step()
        if by_hand:
            for _ in range(most - steps):  # the joined rank keeps its last .grad and steps with it
                opt.step()
    assert_equal_models(getattr(mine, "module", mine), getattr(theirs, "module", theirs), f"after {which}'s Join")


@pytest.mark.parametrize("which", ["torch, with torch's DDP", "torch"])
def test_join_runs_the_zero_hook_as_torch_does(ranks, which):
    ranks(2).run(_under_join, which, timeout_s=60)


def _join_hook_contract(rank, world_size):
    from torch.distributed.algorithms.join import JoinHook as TorchJoinHook

    model = build()
    hook = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1).join_hook()
    assert isinstance(hook, TorchJoinHook)
    import inspect
    assert list(inspect.signature(hook.main_hook).parameters) == []
    assert list(inspect.signature(hook.post_hook).parameters) == ["is_last_joiner"]


def test_zero_join_hook_follows_torchs_contract(ranks):
    ranks(2).run(_join_hook_contract, timeout_s=60)


# ------------------------------------------------------------------ stage 2 + add_param_group
def _stage2_second_group_added(rank, world_size):
    cls, kw = torch.optim.AdamW, {"lr": 0.05}
    model, theirs = MiniDDP(build(), bucket_cap_mb=1e-4), TorchDDP(build())
    first = lambda m: [m.first.weight, m.first.bias]  # noqa: E731
    rest = lambda m: {"params": [m.middle.weight, m.middle.bias, m.last.weight, m.last.bias],  # noqa: E731
                      "weight_decay": 0.0}
    my_opt = ZeroRedundancyOptimizer(first(model.module), cls, ddp=model, shard_gradients=True, **kw)
    my_opt.add_param_group(rest(model.module))
    their_opt = TorchZero(first(theirs.module), cls, **kw)
    their_opt.add_param_group(rest(theirs.module))
    for step in range(3):
        x, y = data(step, PER_RANK * world_size)
        for net, opt in ((model, my_opt), (theirs, their_opt)):
            opt.zero_grad()
            F.mse_loss(net(mine_of(x, rank)), mine_of(y, rank)).backward()
            opt.step()
        assert_equal_models(model.module, theirs.module, f"stage 2, two groups, step {step}")
    # Still refused, at the first step (where the partition is final), when a bucketed parameter is in no group.
    model = MiniDDP(build(), bucket_cap_mb=1e-4)
    opt = ZeroRedundancyOptimizer(first(model.module), cls, ddp=model, shard_gradients=True, **kw)
    F.mse_loss(model(mine_of(x, rank)), mine_of(y, rank)).backward()
    with pytest.raises(ValueError, match=r"middle\.weight"):
        opt.step()


def test_stage2_accepts_a_group_added_after_construction(ranks):
    ranks(2).run(_stage2_second_group_added, timeout_s=60)


# ------------------------------------------------------------------ torch's other constructor arguments
def _constructor_arguments(rank, world_size):
    params = lambda: nn.Linear(2, 2).parameters()  # noqa: E731
    for as_view in (False, True):  # torch's; accepted, as ours are flat already
        ZeroRedundancyOptimizer(params(), torch.optim.SGD, lr=0.1, parameters_as_bucket_view=as_view)
    with pytest.raises(NotImplementedError, match="overlap_with_ddp"):
        ZeroRedundancyOptimizer(params(), torch.optim.SGD, lr=0.1, overlap_with_ddp=True)
    for zero in (ZeroRedundancyOptimizer, TorchZero):  # a clear ValueError, as torch's
        with pytest.raises(ValueError):
            zero([torch.sparse_coo_tensor(size=(2, 3))], torch.optim.SGD, lr=0.01)
    return True


def test_torchs_other_constructor_arguments(ranks):
    # Not vacuous: parameters_as_bucket_view went on to SGD ("unexpected
    # keyword"), and a sparse parameter failed deep inside the partition.
    assert ranks(2).run(_constructor_arguments, timeout_s=60) == [True, True]
