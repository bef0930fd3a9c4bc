"""No silent result: every call on a sharded model that minddp.fsdp does not support raises, naming it.

Each call below would otherwise leave a model that looks fine and trains
wrong (or not at all): ``.half()`` or ``.to(other device)`` would give each
parameter a new tensor cut off from its unit's shard; a deep copy would
share the units' collectives with the original; a 2-D mesh would shard
over the wrong ranks. One run of two ranks tries them all; one test per call.
"""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from minddp.fsdp import FSDPModule, fully_shard
from minddp_lab.rank_pool import RankPool

REFUSED_METHODS = {
    "set_is_last_backward": (True,),
    "set_reshard_after_backward": (True,),
    "set_requires_all_reduce": (True,),
    "set_all_reduce_hook": (lambda t: None,),
    "set_post_optim_event": (None,),
    "set_reduce_scatter_divide_factor": (2.0,),
    "set_gradient_divide_factor": (2.0,),
    "set_force_sum_reduction_for_comms": (True,),
    "set_unshard_in_backward": (True,),
    "set_custom_all_gather": (None,),
    "set_custom_reduce_scatter": (None,),
    "set_allocate_memory_from_process_group_for_comm": (True,),
}

CONVERSIONS = {
    ".half()": lambda m: m.half(),
    ".double()": lambda m: m.double(),
    ".bfloat16()": lambda m: m.bfloat16(),
    ".to(torch.float64)": lambda m: m.to(torch.float64),
    ".to('meta')": lambda m: m.to("meta"),
    ".to_empty(device='meta') of a real model": lambda m: m.to_empty(device="meta"),
}

COPIES = {
    "copy.deepcopy": copy.deepcopy,
    "copy.copy": copy.copy,
    "pickle.dumps": pickle.dumps,
}


def _sharded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(model[0])
    return fully_shard(model)


def _outcome(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test looks at which error, and what it says
        return type(error).__name__, str(error)
    return None


def _everything(rank, world_size):
    torch.set_num_threads(1)
    out = {}
    for name, args in REFUSED_METHODS.items():
        out[name] = _outcome(lambda: getattr(_sharded(), name)(*args))
    for name, convert in CONVERSIONS.items():
        model = _sharded()
        out[name] = _outcome(lambda: convert(model))
        out[name + " leaves the model training"] = _trains(model)
    for name, copier in COPIES.items():
        out[name] = _outcome(lambda: copier(_sharded()))
    mesh_2d = init_device_mesh("cpu", (1, world_size))
    out["2-D mesh"] = _outcome(lambda: fully_shard(nn.Linear(2, 2), mesh=mesh_2d))
    with torch.device("meta"):
        on_meta = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    fully_shard(on_meta)
    out["forward before to_empty"] = _outcome(lambda: on_meta(torch.zeros(1, 4)))
    out["prefetch of a plain module"] = _outcome(
        lambda: _sharded()[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)]))
    stale_optimizer = torch.optim.SGD(on_meta.parameters(), lr=0.1)
    on_meta.to_empty(device="cpu")
    out["optimizer built before to_empty"] = _outcome(stale_optimizer.step)
    # What stays supported: .to() its own device and dtype, .float() of a float32 model.
    model = _sharded()
    model.to("cpu").float()
    out["to its own device and dtype"] = _trains(model)
    return out


def _trains(model):
    """After the call, does an optimizer over model.parameters() still move the units' shards?"""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    before = [u.shard.clone() for u in (m._fsdp_unit for m in model.modules() if isinstance(m, FSDPModule))]
    optimizer.step()
    after = [m._fsdp_unit.shard for m in model.modules() if isinstance(m, FSDPModule)]
    return all(not torch.equal(b, a) for b, a in zip(before, after))


@pytest.fixture(scope="module")
def outcomes(_pools):
    if 2 not in _pools:
        _pools[2] = RankPool(2)
    return _pools[2].run(_everything, timeout_s=90)


@pytest.mark.parametrize("method", REFUSED_METHODS)
def test_unsupported_fsdpmodule_method_is_refused_by_name(outcomes, method):
    for rank in outcomes:
        kind, message = rank[method]
        assert kind == "NotImplementedError" and f"FSDPModule.{method}" in message


@pytest.mark.parametrize("call", CONVERSIONS)
def test_moving_or_converting_a_sharded_model_is_refused(outcomes, call):
    for rank in outcomes:
        kind, message = rank[call]
        assert kind == "NotImplementedError" and "_apply" in message and "before fully_shard" in message
        assert rank[call + " leaves the model training"], "a refused call must not have touched the model"


@pytest.mark.parametrize("call", COPIES)
def test_copying_a_sharded_model_is_refused(outcomes, call):
    for rank in outcomes:
        kind, message = rank[call]
        assert kind == "TypeError" and "deepcopy" in message and "before fully_shard" in message


def test_a_2d_mesh_is_refused(outcomes):
    for rank in outcomes:
        kind, message = rank["2-D mesh"]
        assert kind == "NotImplementedError" and "1-D" in message


def test_running_a_model_still_on_meta_says_to_materialize_it(outcomes):
    for rank in outcomes:
        kind, message = rank["forward before to_empty"]
        assert kind == "RuntimeError" and "to_empty" in message


def test_prefetching_a_module_that_is_not_sharded_is_refused(outcomes):
    for rank in outcomes:
        kind, message = rank["prefetch of a plain module"]
        assert kind == "TypeError" and "Linear" in message


def test_an_optimizer_over_the_meta_parameters_is_refused_after_to_empty(outcomes):
    for rank in outcomes:
        kind, message = rank["optimizer built before to_empty"]
        assert kind == "RuntimeError" and "SGD" in message


def test_to_its_own_device_and_dtype_keeps_training(outcomes):
    assert all(rank["to its own device and dtype"] for rank in outcomes)
