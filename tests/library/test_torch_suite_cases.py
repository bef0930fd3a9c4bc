"""Behaviours that torch's own DDP test suite checks, against MiniDDP and torch's DDP side by side.

Running ``test/distributed/test_c10d_gloo.py`` and ``test_c10d_common.py``
with MiniDDP in place of torch's DDP found three cases where MiniDDP gave a
wrong gradient or an error that torch's DDP does not. Each is reproduced
here in our own words, on the project's oracle: after every SGD step,
MiniDDP's parameters equal one process on the whole batch and torch's DDP
on the same shards (helpers from ``test_training_idioms``: replicas start
from different seeds, so equality needs rank 0's weights broadcast *and*
averaged gradients; a rank that kept its own gradient drifts from both).

1. ``static_graph=True`` with a reentrant activation checkpoint around the
   *whole* wrapped model: the synchronized forward is the recomputation
   inside the checkpoint's backward, so all gradients come from one nested
   autograd pass; its end is the end of that backward (before: never
   finished, each rank kept its own gradient, the next forward raised).
2. ``static_graph=True`` with ``find_unused_parameters=True`` and a reentrant
   checkpoint: the graph walk is torch's way to find unused parameters on
   a dynamic graph; a static graph learns them from its first backward, and
   torch ignores the walk then (before: "produced a gradient twice").
3. ``find_unused_parameters=True`` with a forward that returns a dataclass:
   the tensors in its fields count as outputs (before: every parameter
   looked unused, then "produced a gradient twice").
"""

import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from test_training_idioms import PER_RANK, _batch, _shard, _train_three_ways


# ------------------------------------------- 1. the whole model checkpointed
class Shared(nn.Module):
    """One Linear applied twice (weight sharing, as torch's checkpointing tests use)."""

    def __init__(self, share: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.share = share

    def forward(self, x):
        x = torch.tanh(self.lin(x))
        return self.lin(x) if self.share else x


def _checkpoint_whole_model_step(model, step, rank, world_size):
    x, y = _batch(step, PER_RANK * world_size)
    if rank is not None:
        x, y = _shard(x, rank), _shard(y, rank)
    # The input must require a gradient: a reentrant checkpoint whose inputs
    # need none computes no parameter gradients at all (torch warns).
    x = x.clone().requires_grad_(True)
    F.mse_loss(checkpoint(model, x, use_reentrant=True), y).backward()


@pytest.mark.parametrize("share", [False, True], ids=["plain", "weight_sharing"])
@pytest.mark.parametrize("static_graph", [False, True], ids=["dynamic", "static"])
def test_a_reentrant_checkpoint_around_the_whole_model_averages(ranks, static_graph, share):
    build = functools.partial(Shared, share)
    kwargs = {"static_graph": static_graph}
    assert ranks(2).run(_train_three_ways, build, _checkpoint_whole_model_step, kwargs) == [True, True]


# ------------------- 2. static graph + find_unused_parameters + a checkpoint
class PartlyCheckpointed(nn.Module):
    """A reentrant checkpoint around the middle block, and a layer no forward uses."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.middle = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 8)
        self.never_used = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(checkpoint(self.middle, self.inp(x), use_reentrant=True))


def _mse_step(model, step, rank, world_size):
    x, y = _batch(step, PER_RANK * world_size)
    if rank is not None:
        x, y = _shard(x, rank), _shard(y, rank)
    F.mse_loss(model(x), y).backward()


def _grad_of_the_unused_layer(rank, world_size, kwargs):
    """What torch's DDP and MiniDDP leave in the never-used layer's ``.grad`` after two steps."""
    from minddp import MiniDDP
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    seen = {}
    for name, wrapper in (("minddp", MiniDDP), ("torch", TorchDDP)):
        torch.manual_seed(0)
        model = wrapper(PartlyCheckpointed(), **kwargs)
        for step in range(2):
            _mse_step(model, step, rank, world_size)
        seen[name] = model.module.never_used.weight.grad
    return seen


@pytest.mark.parametrize("find_unused", [True, False], ids=["find_unused", "static_only"])
def test_static_graph_ignores_the_unused_parameter_search_under_a_reentrant_checkpoint(ranks, find_unused):
    kwargs = {"static_graph": True, "find_unused_parameters": find_unused}
    assert ranks(2).run(_train_three_ways, PartlyCheckpointed, _mse_step, kwargs) == [True, True]
    # A parameter no rank uses keeps ``.grad`` None under a static graph, as
    # under find_unused_parameters: an optimizer then skips it (Adam with a
    # zero gradient would still move it). MiniDDP used to write zeros.
    for seen in ranks(2).run(_grad_of_the_unused_layer, kwargs):
        assert seen == {"minddp": None, "torch": None}


# --------------------------------------------- 3. outputs in any container
@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    extras: dict


class Pair(NamedTuple):
    first: torch.Tensor
    second: list


class Containers(nn.Module):
    """Two heads; ``use_b`` decides whether the second one is in this forward at all."""

    def __init__(self, kind: str):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.kind = kind

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        if self.kind == "dataclass":
            return Prediction(logits=a, extras={"deep": [b]})
        return Pair(a, [{"deep": b}])


def _container_step(model, step, rank, world_size):
    x, y = _batch(step, PER_RANK * world_size)
    if rank is not None:
        x, y = _shard(x, rank), _shard(y, rank)
    out = model(x)
    if isinstance(out, Prediction):
        a, b = out.logits, out.extras["deep"][0]
    else:
        a, b = out.first, out.second[0]["deep"]
    F.mse_loss(a + b, y).backward()


@pytest.mark.parametrize("kind", ["dataclass", "namedtuple"])
def test_find_unused_parameters_sees_tensors_inside_dataclasses_and_nesting(ranks, kind):
    # 'unused' really gets no gradient: without the search finding a and b
    # inside the output, they would be counted as unused before their hooks.
    build = functools.partial(Containers, kind)
    kwargs = {"find_unused_parameters": True}
    assert ranks(2).run(_train_three_ways, build, _container_step, kwargs) == [True, True]


# ------------------------------------------------ 4. the comm hook contract
def _bucket_annotated_int(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future()


def _returns_annotated_int(state, bucket: torch.distributed.GradBucket) -> int:
    return 0


def _returns_one(state, bucket):
    return 1


def _hook_contract(rank, world_size):
    from minddp import MiniDDP
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    seen = {}
    for name, wrapper in (("minddp", MiniDDP), ("torch", TorchDDP)):
        for hook in (_bucket_annotated_int, _returns_annotated_int, 42):
            with pytest.raises((ValueError, TypeError)) as raised:
                wrapper(nn.Linear(4, 4)).register_comm_hook(None, hook)
            seen[(name, getattr(hook, "__name__", "not callable"))] = type(raised.value).__name__
        model = wrapper(nn.Linear(4, 4))
        model.register_comm_hook(None, _returns_one)
        with pytest.raises(RuntimeError, match="callback must return a torch.futures.Future"):  # torch's type
            model(torch.randn(2, 4)).sum().backward()
    return seen


def test_comm_hooks_are_checked_at_registration_and_their_return_at_launch(ranks):
    # Not vacuous: MiniDDP accepted both wrong annotations, and a hook that
    # returned 1 failed later with "'int' object has no attribute 'wait'".
    for seen in ranks(2).run(_hook_contract):
        for hook in ("_bucket_annotated_int", "_returns_annotated_int", "not callable"):
            assert seen[("minddp", hook)] == seen[("torch", hook)], (hook, seen)


def _builtin_hooks(rank, world_size, kind):
    from minddp import MiniDDP
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    hook_type = getattr(torch.distributed.BuiltinCommHookType, kind)
    grads = {}
    for name, wrapper in (("minddp", MiniDDP), ("torch", TorchDDP)):
        torch.manual_seed(0)
        model = wrapper(nn.Linear(8, 8))
        model._register_builtin_comm_hook(hook_type)  # torch names it so
        x, y = _batch(rank, PER_RANK)
        F.mse_loss(model(x), y).backward()
        grads[name] = model.module.weight.grad
    torch.testing.assert_close(grads["minddp"], grads["torch"], rtol=0, atol=0)
    return True


@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_builtin_comm_hooks_equal_torch(ranks, kind):
    assert ranks(2).run(_builtin_hooks, kind) == [True, True]
