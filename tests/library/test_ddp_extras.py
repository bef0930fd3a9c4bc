"""Beyond torch's DDP: uneven inputs with join(), the desync detector, the
overlap trace, and the averaging buffer policy."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp.ddp.replicas import ReplicaDesyncError, check_replicas_in_sync
from models_for_tests import build, global_batch

BATCHES_PER_RANK = [3, 5, 4]


# ----------------------------------------------------------- uneven inputs
def _uneven(rank, world_size, divide_by_initial):
    final = {}
    for impl in (MiniDDP, TorchDDP):
        model = impl(build("mlp", seed=rank), bucket_cap_mb=1e-3)  # several buckets to shadow
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join(divide_by_initial_world_size=divide_by_initial):
            for step in range(BATCHES_PER_RANK[rank]):
                x, y = global_batch(step * 10 + rank, 4)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        final[impl.__name__] = [p.detach().clone() for p in model.parameters()]
    return final


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_lets_uneven_ranks_finish_like_torch_ddp(ranks, divide_by_initial):
    results = ranks(3).run(_uneven, divide_by_initial, timeout_s=90)
    for res in results:
        for a, b in zip(res["MiniDDP"], res["DistributedDataParallel"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # ...and every replica leaves join() identical to the last rank that trained.
    last = BATCHES_PER_RANK.index(max(BATCHES_PER_RANK))
    for rank, res in enumerate(results):
        for a, b in zip(res["MiniDDP"], results[last]["MiniDDP"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"rank {rank} vs rank {last}: {m}")


# --------------------------------------------------------- desync detector
def _perturbed(rank, world_size):
    model = build("mlp", seed=0)
    check_replicas_in_sync(model)  # identical: silent
    if rank == 1:
        with torch.no_grad():
            model.net[2].bias[3] += 1e-3
    with pytest.raises(ReplicaDesyncError) as info:
        check_replicas_in_sync(model)
    return str(info.value)


def test_desync_detector_names_the_parameter_and_the_ranks(ranks):
    for message in ranks(2).run(_perturbed):
        assert "'net.2.bias' on rank(s) [1] differs from rank 0" in message


def _swapped(rank, world_size):
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]] if rank == 0 else [[2.0, 1.0]]))
    with pytest.raises(ReplicaDesyncError, match="'weight'"):
        check_replicas_in_sync(model)  # same sum, different order: still caught


def test_desync_detector_catches_permuted_values(ranks):
    ranks(2).run(_swapped)


def _drifting(rank, world_size):
    model = MiniDDP(build("mlp", seed=0), check_sync_every=2)
    x, y = global_batch(0, 4)
    F.mse_loss(model(x), y).backward()  # forward #0: checked, in sync
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).mul_(1.01)  # an optimizer step on one rank only
    F.mse_loss(model(x), y).backward()  # forward #1: not checked
    with pytest.raises(ReplicaDesyncError, match="'net.0.weight' on rank\\(s\\) \\[1\\]"):
        model(x)  # forward #2: checked


def test_check_sync_every_catches_a_drifting_replica(ranks):
    ranks(2).run(_drifting)


# ------------------------------------------------------------------- trace
def _traced(rank, world_size, path):
    model = MiniDDP(build("mlp", seed=0), bucket_cap_mb=1e-3, trace=True)
    for step in range(2):
        x, y = global_batch(step, 4)
        F.mse_loss(model(x), y).backward()
    model.tracer.export_chrome_trace(path)
    return len(model.bucket_names)


def test_trace_exports_a_chrome_trace_with_a_track_per_rank(ranks, tmp_path):
    path = tmp_path / "trace.json"
    n_buckets = ranks(2).run(_traced, str(path))[0]
    events = json.loads(path.read_text())["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        comm = [e for e in mine if e.get("name", "").startswith("all_reduce bucket")]
        # one bucket in the first step (the order is not known yet), the learned buckets in the second
        assert len(comm) == 1 + n_buckets and all(e["dur"] >= 0 for e in comm)
        assert sum(1 for e in mine if e.get("name", "").startswith("grad ")) == 2 * 6
        names = {e["args"]["name"] for e in mine if e["ph"] == "M"}
        assert names == {f"rank {rank}", "backward", "communication"}


# ------------------------------------------------------------ buffer policy
def _two_steps_of_batchnorm(rank, world_size, policy):
    bn = nn.BatchNorm1d(3)
    model = MiniDDP(bn, buffer_sync=policy)
    x = torch.arange(4.0)[:, None].repeat(1, 3) + rank  # per-channel batch mean: 1.5 + rank
    for _ in range(2):
        model(x).sum().backward()
    return bn.running_mean[0].item(), bn.num_batches_tracked.item()


@pytest.mark.parametrize(
    "policy,expected",
    [
        # forward 1: both start at 0 -> 0.1 * 1.5 = 0.15 on rank 0, 0.25 on rank 1
        # forward 2, average: (0.15 + 0.25) / 2 = 0.2 first -> 0.9 * 0.2 + 0.15 = 0.33
        ("average", 0.33),
        # forward 2, broadcast: rank 0's 0.15 first -> 0.9 * 0.15 + 0.15 = 0.285
        ("broadcast", 0.285),
    ],
)
def test_buffer_policies(ranks, policy, expected):
    (mean0, n0), (mean1, n1) = ranks(2).run(_two_steps_of_batchnorm, policy)
    assert mean0 == pytest.approx(expected, abs=1e-6)
    assert mean1 == pytest.approx(expected + 0.1, abs=1e-6)  # rank 1's own last batch is 1.0 higher
    assert n0 == n1 == 2


# ------------------------------------------------ under torch's own Join
def _under_torchs_join(rank, world_size, divide_by_initial, with_zero):
    """Uneven batches (3 and 5) under torch's ``Join``: MiniDDP (alone, or with minddp's ZeRO as
    ``Join([model, opt])``) against torch's DDP with the plain optimizer: sharding the optimizer
    must not change the training. (torch's own ZeRO beside torch's DDP does change it under join:
    a joined rank steps its shard with its last, stale ``.grad``; minddp's ZeRO gets the averaged
    gradient through MiniDDP's buckets.)"""
    from torch.distributed.algorithms.join import Join as TorchJoin

    from minddp.zero import ZeroRedundancyOptimizer

    final = {}
    for impl in (MiniDDP, TorchDDP):
        torch.manual_seed(rank)  # BatchNorm: the buffers' source matters
        model = impl(nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)),
                     bucket_cap_mb=1e-3)
        if with_zero and impl is MiniDDP:
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, ddp=model)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        joinables = [model, opt] if with_zero and impl is MiniDDP else [model]
        with TorchJoin(joinables, divide_by_initial_world_size=divide_by_initial):
            for step in range([3, 5][rank]):
                x, y = global_batch(step * 10 + rank, 4)
                opt.zero_grad()
                F.mse_loss(model(x + rank), y).backward()
                opt.step()
        final[impl.__name__] = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    return final


@pytest.mark.parametrize("divide_by_initial", [True, False])
@pytest.mark.parametrize("with_zero", [False, True], ids=["model", "model_and_zero"])
def test_torchs_join_runs_miniddp_like_torch_ddp(ranks, divide_by_initial, with_zero):
    # Not vacuous: MiniDDP's hook used to need minddp's Join (a TypeError,
    # then a RuntimeError, under torch's), and the ranks end on rank 1's
    # replica only if the divisor and the buffers' source follow who trains.
    for res in ranks(2).run(_under_torchs_join, divide_by_initial, with_zero, timeout_s=90):
        for a, b in zip(res["MiniDDP"], res["DistributedDataParallel"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
