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

``buffer_sync="with_gradients"`` must give the very same buffers before and
after every forward (they travel in the last gradient bucket instead of a
broadcast), and issue one broadcast fewer per training step.
"""

import pytest
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


def _forward_without_backward(model, rank, step):
    model.train()
    model(_batch(rank, step))  # synchronized, but no backward follows: nothing can ride with gradients


# Each entry: what the client does next. After each, the running means are recorded.
SCRIPT = [_train_forward, _eval_forward, _eval_forward, _train_forward,
          _accumulate, _accumulate, _train_forward, _eval_forward,
          _train_forward, _forward_without_backward, _train_forward, _train_forward, _eval_forward]


def _statistics(bn):
    return torch.cat([bn.running_mean, bn.running_var, bn.num_batches_tracked.view(1).float()])


def _running_means_after_each_forward(rank, world_size, wrapper, kwargs=None):
    """The BatchNorm's buffers after each action, and as each forward saw them (at its start)."""
    model = (MiniDDP if wrapper == "minddp" else TorchDDP)(_model(), **(kwargs or {}))
    bn = model.module[1]
    seen_by_forward = []
    model.module.register_forward_pre_hook(lambda module, args: seen_by_forward.append(_statistics(bn)))
    after = []
    for step, action in enumerate(SCRIPT):
        action(model, rank, step)
        after.append(_statistics(bn))
    return after, seen_by_forward


def test_buffers_are_broadcast_before_a_forward_that_follows_a_synchronized_one(ranks):
    pool = ranks(2)
    ours = [after for after, _ in pool.run(_running_means_after_each_forward, "minddp")]
    torchs = [after for after, _ in pool.run(_running_means_after_each_forward, "torch")]
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


def test_with_gradients_gives_every_forward_the_buffers_torch_gives_it(ranks):
    # Forward by forward, the buffers each forward computes with, and the
    # buffers after each action (between a backward and the next forward
    # every rank still holds its own, as under torch's DDP: rank 0's arrive
    # with the gradients but are written only where torch broadcasts).
    pool = ranks(2)
    ours = pool.run(_running_means_after_each_forward, "minddp", {"buffer_sync": "with_gradients"})
    torchs = pool.run(_running_means_after_each_forward, "torch", {})
    for rank in range(2):
        for when, mine_all, theirs_all in zip(("after the action", "as the forward saw them"), ours[rank],
                                              torchs[rank]):
            assert len(mine_all) == len(theirs_all) == len(SCRIPT)
            for step, (mine, theirs) in enumerate(zip(mine_all, theirs_all)):
                assert torch.equal(mine, theirs), (
                    f"rank {rank}, forward {step} ({SCRIPT[step].__name__}), {when}: {mine.tolist()}, "
                    f"torch's DDP: {theirs.tolist()}")
    assert not torch.equal(ours[1][1][0], ours[1][1][1])  # not vacuous: the statistics do change


def _broadcasts_per_step(rank, world_size, buffer_sync):
    model = MiniDDP(_model(), buffer_sync=buffer_sync)
    calls = []
    real = torch.distributed.broadcast
    torch.distributed.broadcast = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        for step in range(4):
            _train_forward(model, rank, step)
    finally:
        torch.distributed.broadcast = real
    return len(calls)


def test_with_gradients_saves_the_broadcast_of_every_step(ranks):
    # 4 training steps. torch's rule broadcasts before every one of them (the
    # wrapper starts as if a synchronized forward came before), in two
    # collectives (float32 statistics, int64 counter): 8; plus the learned
    # bucket order's 1. Riding in the last bucket, only the first step's 2 remain.
    pool = ranks(2)
    assert pool.run(_broadcasts_per_step, "broadcast") == [9, 9]
    assert pool.run(_broadcasts_per_step, "with_gradients") == [3, 3]


def _uneven_under_join(rank, world_size, kwargs):
    batches = [2, 4][rank]
    model = (MiniDDP if kwargs is not None else TorchDDP)(_model(), **(kwargs or {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(batches):
            opt.zero_grad()
            _train_forward(model, rank, step)
            opt.step()
    bn = model.module[1]
    return _statistics(bn), [p.detach().clone() for p in model.parameters()]


def test_with_gradients_under_join_falls_back_to_torchs_broadcast(ranks):
    # Under join() a rank that ran out of data cannot carry rank 0's buffers
    # in its zeros, so every synchronized forward broadcasts, as torch does.
    pool = ranks(2)
    ours = pool.run(_uneven_under_join, {"buffer_sync": "with_gradients"})
    torchs = pool.run(_uneven_under_join, None)
    for (our_stats, our_params), (their_stats, their_params) in zip(ours, torchs):
        assert torch.equal(our_stats, their_stats)
        for a, b in zip(our_params, their_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _rank0_changes_its_buffers_between_steps(rank, world_size, kwargs):
    import warnings

    model = (MiniDDP if kwargs is not None else TorchDDP)(_model(), **(kwargs or {}))
    _train_forward(model, rank, 0)
    if rank == 0:  # e.g. a load_state_dict on rank 0 alone
        model.module[1].running_mean.fill_(7.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_forward(model, rank, 1)
    named = any("buffer_sync='with_gradients'" in str(w.message) for w in caught)
    return named, _statistics(model.module[1])


def test_with_gradients_differs_only_when_rank0_alone_changes_buffers_and_says_so(ranks):
    # The documented difference, measured: torch broadcasts rank 0's new
    # values, MiniDDP had sent the old ones with the gradients. Rank 0 warns.
    pool = ranks(2)
    ours = pool.run(_rank0_changes_its_buffers_between_steps, {"buffer_sync": "with_gradients"})
    torchs = pool.run(_rank0_changes_its_buffers_between_steps, None)
    assert [named for named, _ in ours] == [True, False]
    assert torch.equal(ours[0][1], torchs[0][1])  # rank 0 computed with its own new values, as in torch
    assert not torch.equal(ours[1][1], torchs[1][1])  # rank 1 did not get them
