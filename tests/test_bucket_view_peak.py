"""gradient_as_bucket_view=True must not hold two sets of bucket buffers while MiniDDP is built.

The reducer builds its buckets, then the bucket-view layer builds them again
(each ``.grad`` must become a slot of the buffers it will keep). On the
benchmark's ``mlp`` that second build allocated every new buffer while the
first set was still alive: a construction peak of parameters + twice the
gradients (60.4 MiB against torch's DDP's 49.1). Here the buffers are counted
as they are taken: at no moment may more bucket memory be alive than one
bucket per parameter holds.
"""

import weakref

import torch
from torch import nn

import minddp.ddp.buckets
from minddp import MiniDDP


def _most_bucket_elements_alive(rank, world_size, view):
    alive, most = [0], [0]
    take = minddp.ddp.buckets.BucketStorage.take

    def counting_take(self, numel, dtype, device):
        buffer = take(self, numel, dtype, device)
        alive[0] += numel
        most[0] = max(most[0], alive[0])
        weakref.finalize(buffer, lambda: alive.__setitem__(0, alive[0] - numel))
        return buffer

    minddp.ddp.buckets.BucketStorage.take = counting_take
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 4 x 257 KiB
        ddp = MiniDDP(model, bucket_cap_mb=1.0, gradient_as_bucket_view=view)
        gradient_elements = sum(p.numel() for p in model.parameters())
        result = (most[0], gradient_elements)
        del ddp
    finally:
        minddp.ddp.buckets.BucketStorage.take = take
    return result


def test_building_with_bucket_views_never_holds_two_sets_of_buffers(ranks):
    for view in (False, True):
        most, gradients = ranks(2).run(_most_bucket_elements_alive, view)[0]
        assert most == gradients, (
            f"gradient_as_bucket_view={view}: {most} bucket elements alive at once while building, "
            f"one set is {gradients}")
