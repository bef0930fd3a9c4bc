"""Bucket boundaries are observable: a comm hook sees each ``GradBucket``, a profiler counts the
all-reduces. MiniDDP's must be torch's, step by step, on the installed torch: one bucket until the
first rebuild, then buckets that close after the tensor reaching the cap (a 1 MiB first one only
when no cap was given), no rebuild at all with ``find_unused_parameters``, and with ``static_graph``
a rebuild after the second backward."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)  # 0.5 MiB, 0.75 MiB, 0.25 MiB + 680 B, 1.5 MiB of float32 gradients
    return nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 384, bias=False),
                         nn.Linear(384, 170), nn.Linear(170, 2312, bias=False))


def _buckets_per_step(wrapper, kwargs) -> list[list[tuple[int, list[str], int]]]:
    """Each step's buckets as the comm hook sees them: (index, parameter names, buffer bytes)."""
    module = _model()
    names = {p: name for name, p in module.named_parameters()}
    model = wrapper(module, **kwargs)
    seen = []

    def recording_allreduce(state, bucket):
        seen.append((bucket.index(), [names[p] for p in bucket.parameters()], bucket.buffer().nbytes))
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, recording_allreduce)
    steps = []
    for step in range(STEPS):
        seen.clear()
        model(torch.randn(4, 256)).sum().backward()
        steps.append(list(seen))
    return steps


def _compare(rank, world_size, kwargs):
    mine, torchs = _buckets_per_step(MiniDDP, kwargs), _buckets_per_step(TorchDDP, kwargs)
    assert mine == torchs, f"{kwargs}:\nMiniDDP {mine}\ntorch   {torchs}"
    return [len(step) for step in torchs]


@pytest.mark.parametrize("kwargs, all_reduces", [
    ({}, [1, 2, 2]),  # the 1 MiB first bucket after the rebuild
    ({"bucket_cap_mb": 25}, [1, 1, 1]),  # a cap given: no smaller first bucket
    ({"bucket_cap_mb": 1}, [1, 2, 2]),
    ({"bucket_cap_mb": 0.5}, [1, 3, 3]),  # 0.25 MiB + 0.75 MiB: the bucket passes its cap by one tensor
    ({"bucket_cap_mb": 0}, [1, 5, 5]),
    ({"find_unused_parameters": True}, [2, 2, 2]),  # never rebuilt: torch's first guess for good
    ({"find_unused_parameters": True, "bucket_cap_mb": 25}, [1, 1, 1]),
    ({"static_graph": True}, [1, 1, 2]),  # rebuilt after the second backward
    ({"bucket_cap_mb_list": [0.5, 1]}, [2, 2, 2]),
    ({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.6}, [1, 3, 3]),
])
def test_buckets_are_torchs_step_by_step(ranks, kwargs, all_reduces):
    assert ranks(2).run(_compare, kwargs)[0] == all_reduces
