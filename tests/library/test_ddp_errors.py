"""Every misuse gets an error that names what is at fault, on every rank, without a hang."""

import pytest
import torch
from torch import nn

from minddp import MiniDDP


def test_needs_a_process_group():
    # The test process itself has no process group.
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        MiniDDP(nn.Linear(2, 2))


def _frozen_module(rank, world_size):
    with pytest.raises(RuntimeError, match="no parameter that requires a gradient.*Linear has none"):
        MiniDDP(nn.Linear(2, 2).requires_grad_(False))


def test_rejects_a_module_with_nothing_to_train(ranks):
    ranks(2).run(_frozen_module)


def _different_models(rank, world_size, kind):
    if kind == "extra_layer":
        model = nn.Sequential(nn.Linear(4, 4), *([nn.Linear(4, 2)] if rank == 1 else []))
    elif kind == "shape":
        model = nn.Sequential(nn.Linear(4, 4 if rank == 0 else 5))
    else:  # frozen on one rank only: would build different buckets
        model = nn.Sequential(nn.Linear(4, 4))
        model[0].bias.requires_grad_(rank == 0)
    with pytest.raises(RuntimeError) as info:
        MiniDDP(model)
    return str(info.value)


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("extra_layer", "parameter #2 differs between rank 0 and rank 1: rank 0 has nothing, rank 1 has '1.weight'"),
        ("shape", "parameter #0 differs between rank 0 and rank 1: rank 0 has '0.weight' of shape [4, 4]"),
        ("frozen", "rank 1 has '0.bias' of shape [4] and torch.float32, requires_grad=False"),
    ],
)
def test_different_models_fail_on_every_rank_naming_the_parameter(ranks, kind, expected):
    messages = ranks(2).run(_different_models, kind, timeout_s=30)
    assert messages[0] == messages[1]  # the same verdict everywhere
    assert expected in messages[0]


def _device_ids_on_a_cpu_module(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    for device_ids in ([0], [torch.device("cpu")], ["cpu"]):
        with pytest.raises(ValueError, match="device_ids") as torch_refuses:
            TorchDDP(nn.Linear(2, 2), device_ids=device_ids)
        with pytest.raises(ValueError, match="leave them out") as ours:
            MiniDDP(nn.Linear(2, 2), device_ids=device_ids)
        assert "device_ids=[" in str(ours.value) and torch_refuses.type is ours.type


def test_device_ids_on_a_cpu_module_are_refused_as_torch_refuses_them(ranks):
    ranks(1).run(_device_ids_on_a_cpu_module)
