"""The CUDA/NCCL path: MiniDDP on one GPU equals torch's DDP there.

NCCL refuses two ranks on one GPU, so this runs world size 1 per visible GPU
count (up to 2). Skipped cleanly where there is no GPU (CI has none).
"""

import pytest
import torch

from minddp.testing import RankPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _nccl_equivalence(rank, world_size):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from minddp import MiniDDP
    from models_for_tests import build, global_batch

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        device = torch.device("cuda", rank)
        mini = MiniDDP(build("cnn", seed=rank).to(device), bucket_cap_mb=1e-3, gradient_as_bucket_view=True)
        native = TorchDDP(build("cnn", seed=rank).to(device), device_ids=[rank], bucket_cap_mb=1e-3)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (mini, native)]
        for step in range(3):
            x, y = global_batch(step, 4 * world_size)
            x, y = x[rank * 4 : (rank + 1) * 4].to(device), y[rank * 4 : (rank + 1) * 4].to(device)
            for model, opt in zip((mini, native), opts):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        for a, b in zip(mini.parameters(), native.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_minddp_equals_torch_ddp_on_nccl():
    world_size = min(torch.cuda.device_count(), 2)
    with RankPool(world_size, init_group=False) as pool:
        pool.run(_nccl_equivalence, timeout_s=120)
