"""When buffers are broadcast: torch's rule, forward by forward.

torch's DDP broadcasts rank 0's buffers before a forward when the forward
*before it* was a synchronized one (``require_forward_param_sync``), whatever
the grad mode of the forward at hand. Two patterns of real training code
depend on it:

* torchvision's reference script evaluates through the wrapper after a
  training step (``model.eval()`` and a forward under ``inference_mode``): the
  broadcast before that forward is what makes every rank evaluate with the
  same BatchNorm statistics, so the ranks report the same validation result;
* gradient accumulation: the forwards inside ``no_sync()`` change each rank's
  running statistics on its own data, and the synchronized forward that
  closes the step does *not* broadcast first (the forward before it did not
  synchronize).

The check is not vacuous: each rank's batch is shifted by ``10 * rank``, so a
rank's own running mean is far from rank 0's, and a missed or extra
broadcast shows as a difference of about 1 in ``running_mean``.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=g) + 10 * rank


def _train_forward(model, rank, step):
    model.train()
    F.mse_loss(model(_batch(rank, step)), torch.zeros(8, 4)).backward()


def _eval_forward(model, rank, step):
    model.eval()
    with torch.inference_mode():
        model(_batch(rank, step))


def _accumulate(model, rank, step):
    model.train()
    with model.no_sync():
        F.mse_loss(model(_batch(rank, step)), torch.zeros(8, 4)).backward()


# Each entry: what the client does next. After each, the running means are recorded.
SCRIPT = [_train_forward, _eval_forward, _eval_forward, _train_forward,
          _accumulate, _accumulate, _train_forward, _eval_forward]


def _running_means_after_each_forward(rank, world_size, wrapper):
    model = (MiniDDP if wrapper == "minddp" else TorchDDP)(_model())
    means = []
    for step, action in enumerate(SCRIPT):
        action(model, rank, step)
        means.append(model.module[1].running_mean.clone())
    return means


def test_buffers_are_broadcast_before_a_forward_that_follows_a_synchronized_one(ranks):
    pool = ranks(2)
    ours = pool.run(_running_means_after_each_forward, "minddp")
    torchs = pool.run(_running_means_after_each_forward, "torch")
    for rank in range(2):
        for step, (mine, theirs) in enumerate(zip(ours[rank], torchs[rank])):
            assert torch.equal(mine, theirs), (
                f"rank {rank}, after forward {step} ({SCRIPT[step].__name__}): MiniDDP's running_mean "
                f"{mine.tolist()} differs from torch's DDP's {theirs.tolist()}"
            )
    # The evaluation forward right after a training step saw rank 0's statistics on both ranks.
    assert torch.equal(ours[0][1], ours[1][1])
    # ... and the rule matters: inside no_sync the ranks' statistics drift apart.
    assert not torch.allclose(ours[0][5], ours[1][5], atol=0.5)
