"""A dropped wrapper lets go of the model, its gradients and the process group, as torch's DDP does.

Gradient hooks live on the parameters, in C++ where Python's garbage
collector cannot look; a hook that holds its wrapper keeps the whole model
alive for good ([Note: a hook must not own its owner] in
:mod:`minddp.ddp.core.weak_hooks`). The cost is not only memory: a group still
referenced when the interpreter exits is torn down during its shutdown, where
a Gloo worker thread can abort the process after training succeeded.
"""

import gc
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp.ddp.default_hooks import fp16_compress_hook
from minddp.fsdp import fully_shard
from minddp.zero import ZeroRedundancyOptimizer
from models_for_tests import build, global_batch


def _with_comm_hook(model):
    ddp = MiniDDP(model)
    ddp.register_comm_hook(None, fp16_compress_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)


def _zero(stage):
    def wrap(model):
        ddp = MiniDDP(model)
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1,
                                            ddp=ddp, shard_gradients=stage == 2)
        return ddp, optimizer
    return wrap


def _wrapped(wrapper, **kwargs):
    def wrap(model):
        ddp = wrapper(model, **kwargs)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)
    return wrap


def _fully_sharded(model):
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


WRAPPERS = {
    "torch DDP": _wrapped(TorchDDP),
    "MiniDDP": _wrapped(MiniDDP),
    "find_unused_parameters": _wrapped(MiniDDP, find_unused_parameters=True),
    "static_graph": _wrapped(MiniDDP, static_graph=True),
    "gradient_as_bucket_view": _wrapped(MiniDDP, gradient_as_bucket_view=True),
    "comm hook": _with_comm_hook,
    "ZeRO stage 1": _zero(1),
    "ZeRO stage 2": _zero(2),
    "fully_shard": _fully_sharded,
}


def _train_then_drop(rank, world_size, name):
    """How many of the model's parameters, and references to the group, outlive the dropped wrapper."""
    _once(rank, name)  # torch caches a few things for the group at its first use
    group = dist.group.WORLD
    gc.collect()
    group_refs = sys.getrefcount(group)
    alive = _once(rank, name)
    gc.collect()
    return alive, sys.getrefcount(group) - group_refs


def _once(rank, name):
    """Train a fresh model two steps, drop it and its wrapper: how many of their parameters are still alive."""
    model = build("mlp", seed=0)
    originals = [weakref.ref(p) for p in model.parameters()]
    wrapped, optimizer = WRAPPERS[name](model)
    x, y = global_batch(rank, 4)
    for _ in range(2):
        optimizer.zero_grad()
        F.mse_loss(wrapped(x), y).backward()
        optimizer.step()
    now = [weakref.ref(p) for p in wrapped.parameters()]  # FSDP's own, ZeRO's views: all must go
    del model, wrapped, optimizer
    gc.collect()
    return sum(ref() is not None for ref in originals + now)


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_dropped_wrapper_frees_the_model_and_the_group(ranks, name):
    for alive, extra_group_refs in ranks(2).run(_train_then_drop, name):
        assert alive == 0, f"{name}: {alive} parameters outlived the dropped wrapper"
        assert extra_group_refs == 0, f"{name}: {extra_group_refs} references to the process group outlived it"


def _local_after_drop(rank, world_size):
    """A model whose MiniDDP was dropped trains alone: its backward reduces nothing, and nothing fails."""
    model = build("mlp", seed=0)
    ddp = MiniDDP(model)
    x, y = global_batch(rank, 4)
    F.mse_loss(ddp(x), y).backward()
    del ddp
    gc.collect()
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    alone = build("mlp", seed=0)
    F.mse_loss(alone(x), y).backward()
    return all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), alone.parameters()))


def test_a_model_outlives_its_dropped_wrapper_and_trains_alone(ranks):
    assert all(ranks(2).run(_local_after_drop))
