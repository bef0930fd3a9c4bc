"""The part of DDP that frameworks reach past the public API for, against torch's DDP directly.

accelerate and Lightning drive DDP's flags and its reducer themselves
(``docs/frameworks.md`` lists every call); each test here does what one of
them does, on MiniDDP and on torch's DDP side by side, and compares the
gradients, buffers and what the call returns. No framework needed: the
frameworks' own code runs in ``tests/test_frameworks_*.py``.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _both(rank: int, **kwargs) -> dict[str, nn.Module]:
    return {"minddp": MiniDDP(_net(rank), **kwargs), "torch": TorchDDP(_net(rank), **kwargs)}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, their gradients and buffers, by name."""
    state = {name: t.detach().clone() for name, t in model.module.state_dict().items()}
    state.update({f"{name}.grad": p.grad.clone() for name, p in model.module.named_parameters() if p.grad is not None})
    return state


def _assert_same(states: dict[str, dict[str, torch.Tensor]], when: str) -> None:
    mini, native = states["minddp"], states["torch"]
    assert mini.keys() == native.keys(), when
    for name in native:
        torch.testing.assert_close(mini[name], native[name], rtol=0, atol=0, msg=lambda m: f"{when}, {name}: {m}")


# ------------------------------------ accelerate's trigger_sync_in_backward
def _accumulate_then_trigger(model, rank, step):
    """accelerate's ``Accelerator.trigger_sync_in_backward``: forwards under ``no_sync()``, then the flags
    set and ``reducer.prepare_for_backward([])``: the next backward must average."""
    x, y = _batch(rank, step)
    with model.no_sync():
        loss_a = F.mse_loss(model(x[:3]), y[:3])
        loss_b = F.mse_loss(model(x[3:]), y[3:])
    loss_a.backward()  # no communication: still inside accumulation
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    loss_b.backward()  # armed: averages everything accumulated


def _trigger_sync_in_backward(rank, world_size):
    states = {}
    for label, model in _both(rank).items():
        for step in range(3):
            _accumulate_then_trigger(model, rank, step)
        states[label] = _state(model)
    grads = [g for name, g in states["minddp"].items() if name.endswith(".grad")]
    gathered = [torch.cat([g.flatten() for g in grads]) for _ in range(world_size)]
    dist.all_gather(gathered, gathered[0].clone())
    assert torch.equal(gathered[0], gathered[1]), "MiniDDP: gradients differ between ranks after the armed backward"
    _assert_same(states, "after trigger_sync_in_backward")


def test_prepare_for_backward_arms_the_next_backward(ranks):
    ranks(2).run(_trigger_sync_in_backward)


def _trigger_with_unused_search(rank, world_size):
    """With find_unused_parameters, ``prepare_for_backward([])`` finds no output, so every parameter
    counts as unused: the gradients that then come are marked twice. torch raises; so must MiniDDP."""
    errors = {}
    for label, model in _both(rank, find_unused_parameters=True).items():
        with pytest.raises(RuntimeError) as raised:
            _accumulate_then_trigger(model, rank, 0)
        errors[label] = str(raised.value)
    return errors


def test_prepare_for_backward_without_outputs_under_unused_search_raises_like_torch(ranks):
    for errors in ranks(2).run(_trigger_with_unused_search):
        assert "ready only once" in errors["torch"]
        assert "ready only once" in errors["minddp"] or "twice" in errors["minddp"], errors["minddp"]


# --------------------- Lightning's manual optimization: the flag read at the end of forward
class _LowersSyncDuringForward(nn.Module):
    """What Lightning's ``_DDPForwardRedirection`` does under manual optimization: the wrapper's
    ``require_backward_grad_sync`` is lowered inside the forward (and raised again after it)."""

    def __init__(self, seed: int):
        super().__init__()
        self.net = _net(seed)
        self.wrapper = None  # set once wrapped (not a submodule: a plain attribute)

    def forward(self, x):
        out = self.net(x)
        self.__dict__["wrapper"].require_backward_grad_sync = False
        return out


def _lightning_manual_backward(model, loss):
    """Lightning's ``overrides.distributed.prepare_for_backward`` then ``loss.backward()``."""
    if torch.is_grad_enabled() and model.require_backward_grad_sync:
        model.require_forward_param_sync = True
        model.reducer._rebuild_buckets()
        model.reducer.prepare_for_backward([])
    else:
        model.require_forward_param_sync = False
    loss.backward()


def _manual_optimization(rank, world_size):
    """Steps where the backward is armed by hand, a step with no backward at all (torch then skips
    the next buffer broadcast: the flag read at the end of that forward was low), eval forwards."""
    states, flags = {}, {}
    for label, cls in (("minddp", MiniDDP), ("torch", TorchDDP)):
        inner = _LowersSyncDuringForward(rank)
        model = cls(inner)
        inner.__dict__["wrapper"] = model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for step in range(5):
            x, y = _batch(rank, step)
            loss = F.mse_loss(model(x), y)
            seen.append(model.require_forward_param_sync)
            model.require_backward_grad_sync = True  # Lightning's on_after_outer_forward
            if step != 2:  # step 2: the training step returns without a backward
                _lightning_manual_backward(model, loss)
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                model.eval()
                model(x)
                model.train()
        states[label] = _state(model)
        flags[label] = seen
    assert flags["minddp"] == flags["torch"], flags
    _assert_same(states, "after manual optimization")


def test_sync_flag_is_read_at_the_end_of_forward_like_torch(ranks):
    ranks(2).run(_manual_optimization)
