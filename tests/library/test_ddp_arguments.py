"""torch's DDP arguments, on the installed torch: every one is MiniDDP's too, in torch's order.

Each is honoured as torch does or refused by name (never a ``TypeError`` for an unexpected
keyword): :func:`test_every_torch_argument_is_minddps_in_torchs_order` sees the next torch
release's additions the day it is installed. Those torch 2.15 added: ``batched_grad_copy`` (what
MiniDDP always does) and ``lazy_bucket_allocation`` (no bucket buffer held between steps).
"""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP

# What MiniDDP adds after torch's arguments (keyword-only).
MINIDDP_ONLY = ["reduce_dtype", "buffer_sync", "check_sync_every", "timeline", "trace", "learn_bucket_order"]
# torch's arguments newer than the oldest torch minddp supports, with the release that added each: on an
# older torch, MiniDDP takes them after torch's own.
ADDED_AFTER_THE_FLOOR = {"lazy_bucket_allocation": "2.15"}


def _parameters(cls) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self


def test_every_torch_argument_is_minddps_in_torchs_order():
    theirs = [p.name for p in _parameters(TorchDDP)]
    ours = _parameters(MiniDDP)
    assert [p.name for p in ours[: len(theirs)]] == theirs, (
        f"torch {torch.__version__}'s DDP arguments, in order: {theirs}; MiniDDP's: {[p.name for p in ours]}")
    extra = ours[len(theirs):]
    newer = [p.name for p in extra if p.kind is not p.KEYWORD_ONLY]
    assert all(name in ADDED_AFTER_THE_FLOOR and torch.__version__ < ADDED_AFTER_THE_FLOOR[name] for name in newer), (
        f"MiniDDP takes {newer} that torch {torch.__version__} does not have and is not known to have added later")
    assert [p.name for p in extra if p.kind is p.KEYWORD_ONLY] == MINIDDP_ONLY, "MiniDDP's own come last, by keyword"


def test_torch_defaults_are_minddps():
    ours = {p.name: p.default for p in _parameters(MiniDDP)}
    for p in _parameters(TorchDDP):
        assert ours[p.name] == p.default, f"{p.name}: torch's default {p.default!r}, MiniDDP's {ours[p.name]!r}"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _arguments(rank, world_size):
    results = {}
    # init_sync=False: no check, no broadcast: each rank keeps its own weights, as torch's DDP does.
    for name, cls in (("minddp", MiniDDP), ("torch", TorchDDP)):
        for init_sync in (False, True):
            torch.manual_seed(rank)  # different weights on each rank
            inner = Net()
            own = inner.a.weight.detach().clone()
            results[f"{name} init_sync={init_sync}: own weights kept"] = torch.equal(
                cls(inner, init_sync=init_sync).module.a.weight, own)
    net = Net()
    # dim: stored, without effect (one device per process).
    results["dim"] = MiniDDP(Net(), dim=1).dim
    # check_reduction: torch's FutureWarning, nothing else.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MiniDDP(Net(), check_reduction=True)
    results["check_reduction warns"] = [w.category.__name__ for w in caught if "check_reduction" in str(w.message)]
    for kwargs, error in (({"delay_all_reduce_named_params": [("a.weight", net.a.weight)],
                            "param_to_hook_all_reduce": net.b.weight}, "delay_all_reduce_named_params"),
                          ({"mixed_precision": object()}, "mixed_precision"),
                          ({"lazy_bucket_allocation": True, "gradient_as_bucket_view": True}, "lazy_bucket_allocation")):
        with pytest.raises((NotImplementedError, ValueError), match=error):
            MiniDDP(Net(), **kwargs)
    return results


def test_init_sync_dim_check_reduction_and_the_refused_ones(ranks):
    for rank, r in enumerate(ranks(2).run(_arguments)):
        for name in ("minddp", "torch"):
            assert r[f"{name} init_sync=False: own weights kept"]
            assert r[f"{name} init_sync=True: own weights kept"] == (rank == 0), "rank 0's weights everywhere"
        assert r["dim"] == 1
        assert r["check_reduction warns"] == ["FutureWarning"]


def _lazy_buckets(rank, world_size, as_view_for_torch):
    torch.manual_seed(0)
    mini = MiniDDP(Net(), bucket_cap_mb=0.0001, lazy_bucket_allocation=True, batched_grad_copy=True)
    torch.manual_seed(0)
    kwargs = {"lazy_bucket_allocation": True} if "lazy_bucket_allocation" in inspect.signature(TorchDDP).parameters else {}
    native = TorchDDP(Net(), bucket_cap_mb=0.0001, **kwargs)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mini, native)]
    held, differences = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        for model, opt in zip((mini, native), optimizers):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        held.append(sum(b.buffer is not None for b in mini.reducer.buckets))
        differences.append(max((p - q).abs().max().item() for p, q in zip(mini.parameters(), native.parameters())))
    return len(mini.reducer.buckets), held, differences


def test_lazy_bucket_allocation_holds_no_bucket_between_steps_and_equals_torch(ranks):
    for buckets, held, differences in ranks(2).run(_lazy_buckets, False):
        assert buckets >= 2, "the test needs several buckets"
        assert held == [0, 0, 0], f"bucket buffers held after each step: {held}"
        assert max(differences) < 1e-6, differences
