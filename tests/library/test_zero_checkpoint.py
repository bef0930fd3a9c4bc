"""Checkpoints of the sharded optimizer: save on 2 ranks, resume on 3, bit for bit.

To isolate the checkpoint from the rounding of gradient averaging (a mean
over 2 ranks and over 3 sums in different orders), every rank here computes
the gradient of the whole batch and the optimizer does not average
(``average_gradients=False``): the gradients are then the same bits at any
world size and in one process, and any difference left would come from
saving, resharding or loading the optimizer state. The run that never
stopped is one process with the unsharded torch optimizer.
"""

import pytest
import torch

from minddp.zero import ZeroRedundancyOptimizer, load_sharded, save_sharded
from test_zero import build, batch, groups, loss_of, optimizer_args

FIRST, THEN = 3, 3  # steps before the save, steps after the resume


def _train(model, opt, steps):
    for step in steps:
        x, y = batch(step, 6)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


def _save(rank, world_size, path, how, opt_name):
    cls, kw = optimizer_args(opt_name)
    model = build(0)
    opt = ZeroRedundancyOptimizer(groups(model), cls, average_gradients=False, **kw)
    _train(model, opt, range(FIRST))
    if how == "consolidated":
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{path}/full.pt")
    else:
        save_sharded(opt, path)
        if rank == 0:
            torch.save({"model": model.state_dict()}, f"{path}/full.pt")


def _resume(rank, world_size, path, how, opt_name, shard_gradients):
    cls, kw = optimizer_args(opt_name)
    model = build(1)
    saved = torch.load(f"{path}/full.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    opt = ZeroRedundancyOptimizer(groups(model), cls, average_gradients=False, **kw)
    if how == "consolidated":
        opt.load_state_dict(saved["optimizer"])
    else:
        load_sharded(opt, path)
    _train(model, opt, range(FIRST, FIRST + THEN))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["consolidated", "sharded"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_save_on_two_resume_on_three_bit_exact(ranks, tmp_path, how, opt_name):
    ranks(2).run(_save, str(tmp_path), how, opt_name, timeout_s=60)
    resumed = ranks(3).run(_resume, str(tmp_path), how, opt_name, False, timeout_s=60)
    cls, kw = optimizer_args(opt_name)
    model = build(0)
    _train(model, cls(groups(model), **kw), range(FIRST + THEN))  # the run that never stopped
    for name, p in model.named_parameters():
        for rank, params in enumerate(resumed):
            assert torch.equal(params[name], p), f"rank {rank} {name}: resumed run differs from the unstopped one"


def test_consolidated_state_loads_into_a_plain_torch_optimizer(ranks, tmp_path):
    ranks(2).run(_save, str(tmp_path), "consolidated", "adamw", timeout_s=60)
    saved = torch.load(f"{tmp_path}/full.pt", weights_only=True)
    model = build(1)
    model.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(groups(model), **optimizer_args("adamw")[1])
    opt.load_state_dict(saved["optimizer"])  # torch's own format: a plain optimizer takes it
    _train(model, opt, range(FIRST, FIRST + THEN))
    reference = build(0)
    _train(reference, torch.optim.AdamW(groups(reference), **optimizer_args("adamw")[1]), range(FIRST + THEN))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_state_dict_before_consolidation_names_the_call(ranks):
    ranks(2).run(_unconsolidated, timeout_s=60)


def _unconsolidated(rank, world_size):
    model = build(0)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=rf"consolidate_state_dict\(to={rank}\)"):
        opt.state_dict()


def _resume_stage2(rank, world_size, path, how):
    """Stage 2 partitions MiniDDP's buckets, which are rebuilt after the first backward: the state
    loaded before it must follow into the final partition."""
    from minddp import MiniDDP
    from test_zero import PER_RANK, SMALL_CAP_MB

    cls, kw = optimizer_args("adamw")
    model = build(1)
    model.load_state_dict(torch.load(f"{path}/full.pt", weights_only=True)["model"])
    ddp = MiniDDP(model, bucket_cap_mb=SMALL_CAP_MB)
    opt = ZeroRedundancyOptimizer(groups(model), cls, ddp=ddp, shard_gradients=True, **kw)
    if how == "consolidated":
        opt.load_state_dict(torch.load(f"{path}/full.pt", weights_only=True)["optimizer"])
    else:
        load_sharded(opt, path)
    for step in range(FIRST, FIRST + THEN):
        x, y = batch(step, 6)
        opt.zero_grad()
        loss_of(ddp, x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict() if rank == 0 else None


@pytest.mark.parametrize("how", ["consolidated", "sharded"])
def test_stage1_checkpoint_resumes_under_stage2_on_three_ranks(ranks, tmp_path, how):
    ranks(2).run(_save, str(tmp_path), how, "adamw", timeout_s=60)
    resumed = ranks(3).run(_resume_stage2, str(tmp_path), how, timeout_s=60)
    cls, kw = optimizer_args("adamw")
    model = build(0)
    opt = cls(groups(model), **kw)
    _train(model, opt, range(FIRST + THEN))
    # Averaging over 3 ranks rounds differently from one mean: float32 tolerance (see test_zero.py).
    for name, p in model.named_parameters():
        torch.testing.assert_close(resumed[0][0][name], p, rtol=1e-5, atol=1e-6)
    theirs = opt.state_dict()
    mine = resumed[0][1]
    assert sorted(mine["state"]) == sorted(theirs["state"])
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(mine["state"][index][key], value, rtol=1e-4, atol=1e-7)
