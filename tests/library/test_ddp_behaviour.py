"""MiniDDP's behaviour beyond plain equivalence: overlap, no_sync, unused
parameters, buffers, views, comm hooks, learned bucket order, AMP."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from models_for_tests import IN_FEATURES, build, global_batch


def _local_batch(rank, world_size, step=0, per_rank=4):
    x, y = global_batch(step, per_rank * world_size)
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank], x, y


# ---------------------------------------------------------------- overlap
class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)


def _timeline(rank, world_size):
    model = MiniDDP(Deep(), bucket_cap_mb=0.3, timeline=True)  # ~one layer per bucket
    x = torch.randn(64, 256)
    for _ in range(3):
        model(x).square().mean().backward()
    t = model.timeline
    return len(model.bucket_names), t.launches, t.last_hook, t.finished


def test_communication_starts_before_backward_ends(ranks):
    for n_buckets, launches, last_hook, finished in ranks(2).run(_timeline):
        assert n_buckets >= 4
        assert len(launches) == n_buckets
        # The first bucket left while autograd still had gradients to compute.
        assert launches[0] < last_hook < finished


# ---------------------------------------------------------------- no_sync
def _no_sync(rank, world_size, as_view):
    reference = build("mlp", seed=0)
    model = MiniDDP(build("mlp", seed=rank), gradient_as_bucket_view=as_view)
    micro = [_local_batch(rank, world_size, step=s) for s in range(3)]
    with model.no_sync():
        for xb, yb, _, _ in micro[:2]:
            F.mse_loss(model(xb), yb).backward()
    inside = [p.grad.clone() for p in model.parameters()]
    gathered = [torch.zeros_like(inside[0]) for _ in range(world_size)]
    dist.all_gather(gathered, inside[0])
    xb, yb, _, _ = micro[2]
    F.mse_loss(model(xb), yb).backward()
    # Reference: the three global batches, each a mean, summed like accumulation does.
    for _, _, x, y in micro:
        F.mse_loss(reference(x), y).backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
    return not torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("as_view", [False, True])
def test_no_sync_accumulation_equals_one_large_batch(ranks, as_view):
    differed = ranks(2).run(_no_sync, as_view)
    assert all(differed), "inside no_sync the ranks' gradients should still be their own"


# ------------------------------------------------------- unused parameters
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN_FEATURES, 8)
        self.left = nn.Linear(8, 4)
        self.right = nn.Linear(8, 4)
        self.never = nn.Linear(8, 4)

    def forward(self, x, take_left: bool):
        h = torch.tanh(self.trunk(x))
        return self.left(h) if take_left else self.right(h)


def _unused(rank, world_size, as_view):
    results = {}
    for impl in (MiniDDP, TorchDDP):
        torch.manual_seed(0)
        model = impl(Branchy(), find_unused_parameters=True, gradient_as_bucket_view=as_view)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            xb, yb, _, _ = _local_batch(rank, world_size, step)
            # rank 0 goes left, rank 1 right (then they swap): control flow differs between ranks
            F.mse_loss(model(xb, take_left=(rank + step) % 2 == 0), yb).backward()
            opt.step()
        results[impl.__name__] = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.module.named_parameters()}
        results[impl.__name__]["params"] = [p.detach().clone() for p in model.parameters()]
    return results


@pytest.mark.parametrize("as_view", [False, True])
def test_unused_parameters_match_torch_ddp(ranks, as_view):
    for res in ranks(2).run(_unused, as_view):
        mine, theirs = res["MiniDDP"], res["DistributedDataParallel"]
        assert mine["never.weight"] is None and mine["never.bias"] is None  # unused everywhere
        assert theirs["never.weight"] is None
        for name in ["trunk.weight", "left.weight", "right.bias"]:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6)
        for a, b in zip(mine["params"], theirs["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _unused_without_flag(rank, world_size):
    model = MiniDDP(Branchy())
    xb, yb, _, _ = _local_batch(rank, world_size)
    with pytest.raises(RuntimeError) as info:
        F.mse_loss(model(xb, take_left=True), yb).backward()
    return str(info.value)


def test_unused_parameter_without_the_flag_names_it(ranks):
    for message in ranks(2).run(_unused_without_flag):
        assert "'right.weight'" in message and "'never.bias'" in message
        assert "find_unused_parameters=True" in message
        assert "'left.weight'" not in message


def _unused_on_one_rank_only(rank, world_size):
    model = MiniDDP(Branchy())
    xb, yb, _, _ = _local_batch(rank, world_size)
    F.mse_loss(model(xb, take_left=rank == 0) + 0 * model.module.never(torch.zeros(8)).sum(), yb).backward()


def test_rank_dependent_unused_parameter_without_the_flag_fails_not_hangs(ranks):
    from minddp_lab.rank_pool import RankError

    # Each rank misses a different branch: both raise, naming what they missed.
    with pytest.raises(RankError, match="find_unused_parameters=True"):
        ranks(2).run(_unused_on_one_rank_only, timeout_s=30)


# ---------------------------------------------------------------- buffers
class CountsForward(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("seen", torch.full((3,), float(rank)))
        self.step = 10.0 + rank  # ranks drift apart unless rank 0's buffers are broadcast

    def forward(self, x):
        observed = self.seen.clone()
        self.seen += self.step  # like BatchNorm's running statistics, a forward changes it
        return self.lin(x), observed


def _buffers(rank, world_size, broadcast):
    model = MiniDDP(CountsForward(rank), broadcast_buffers=broadcast)
    observed = []
    for _ in range(2):
        out, seen = model(torch.randn(1, 2))
        out.sum().backward()
        observed.append(seen.tolist())
    with torch.no_grad():  # follows a synchronized forward: broadcast, like torch (whatever the grad mode)
        observed.append(model(torch.randn(1, 2))[1].tolist())
    return observed


def test_forward_sees_rank0_buffers(ranks):
    results = ranks(2).run(_buffers, True)
    # Construction copies rank 0's zeros; each synchronized forward re-broadcasts rank 0's.
    assert results[0] == [[0.0] * 3, [10.0] * 3, [20.0] * 3]
    # Rank 1 sees rank 0's values in every forward, the no_grad one too: the
    # forward before it synchronized (torch's require_forward_param_sync), so
    # rank 0's buffers are broadcast, not rank 1's own last step (+11 -> 21).
    assert results[1] == [[0.0] * 3, [10.0] * 3, [20.0] * 3]
    own = ranks(2).run(_buffers, False)
    # broadcast_buffers=False: not even construction copies them (torch 2.14's rule; its
    # forward_sync_buffers=False would): rank 1 keeps its own ones and drifts by its own steps.
    assert own[1] == [[1.0] * 3, [12.0] * 3, [23.0] * 3]


# -------------------------------------------------- gradient as bucket view
def _views(rank, world_size):
    model = MiniDDP(build("mlp", seed=rank), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()  # set_to_none: the next backward must re-point .grad at the bucket
        xb, yb, _, _ = _local_batch(rank, world_size, step)
        F.mse_loss(model(xb), yb).backward()
        opt.step()
    buffers = [b.buffer for b in model.reducer.buckets]
    def inside(t):
        return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size() for b in buffers)
    return all(inside(p.grad) for p in model.parameters())


def test_gradients_are_views_into_buckets(ranks):
    assert ranks(2).run(_views) == [True, True]


# ------------------------------------------------------------ comm hooks
def _compressed(rank, world_size, hook_name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import minddp.ddp.default_hooks as ours

    hook = {"torch_fp16": default_hooks.fp16_compress_hook, "fp16": ours.fp16_compress_hook,
            "bf16": ours.bf16_compress_hook, "allreduce": ours.allreduce_hook}[hook_name]
    exact = MiniDDP(build("mlp", seed=0), bucket_cap_mb=1e-3)
    compressed = MiniDDP(build("mlp", seed=0), bucket_cap_mb=1e-3)
    compressed.register_comm_hook(None, hook)
    xb, yb, _, _ = _local_batch(rank, world_size)
    for model in (exact, compressed):
        F.mse_loss(model(xb), yb).backward()
    return [(a.grad, b.grad) for a, b in zip(exact.parameters(), compressed.parameters())]


@pytest.mark.parametrize("hook_name,rtol", [("allreduce", 1e-6), ("fp16", 2e-3), ("torch_fp16", 2e-3), ("bf16", 1.6e-2)])
def test_comm_hooks_stay_within_their_rounding(ranks, hook_name, rtol):
    for pairs in ranks(2).run(_compressed, hook_name):
        for exact, compressed in pairs:
            scale = exact.abs().max()
            # Each rank rounds its share to the format, then the sum is rounded: ~2 roundings.
            torch.testing.assert_close(compressed, exact, rtol=rtol, atol=rtol * scale.item())
        if hook_name != "allreduce":
            assert any(not torch.equal(e, c) for e, c in pairs), "compression should round something"


def _hook_misuse(rank, world_size):
    model = MiniDDP(build("mlp", seed=0))
    model.register_comm_hook(None, lambda s, b: None)
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, lambda s, b: None)
    late = MiniDDP(build("mlp", seed=0))
    xb, yb, _, _ = _local_batch(rank, world_size)
    F.mse_loss(late(xb), yb).backward()
    with pytest.raises(RuntimeError, match="before the first backward"):
        late.register_comm_hook(None, lambda s, b: None)


def test_comm_hook_misuse_is_refused(ranks):
    ranks(2).run(_hook_misuse)


# ------------------------------------------------------ learned bucket order
class OutOfOrder(nn.Module):
    """Registered a, b, c; executed c, a, b. Reverse registration guesses wrong."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.tanh(self.a(torch.tanh(self.c(x)))))


def _learned_order(rank, world_size):
    model = MiniDDP(OutOfOrder(), bucket_cap_mb=1e-3)  # 1 KiB: a bucket closes at each 4 KiB weight
    before = model.bucket_names
    model(torch.randn(4, 32)).sum().backward()
    model(torch.randn(4, 32))  # the next synchronized forward rebuilds, as torch's
    return before, model.bucket_names


def test_buckets_are_rebuilt_in_the_order_gradients_arrived(ranks):
    for before, after in ranks(2).run(_learned_order):
        assert before == [["a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]]  # one, until known
        # Backward meets b first (the last layer run), then a, then c; each weight passes the cap.
        assert [sorted(n) for n in after] == [["b.bias", "b.weight"], ["a.bias", "a.weight"], ["c.bias", "c.weight"]]


# ------------------------------------------------------------- state dict
def _state_dict_keys(rank, world_size):
    return {
        "module": list(build("mlp", seed=0).state_dict()),
        "minddp": list(MiniDDP(build("mlp", seed=0)).state_dict()),
        "torch": list(TorchDDP(build("mlp", seed=0)).state_dict()),
    }


def test_state_dict_keys_are_prefixed_like_torch(ranks):
    for rank, keys in enumerate(ranks(2).run(_state_dict_keys)):
        assert keys["minddp"] == [f"module.{k}" for k in keys["module"]], f"rank {rank}"
        assert keys["minddp"] == keys["torch"], f"rank {rank}"


# ------------------------------------------------------------ AMP, clipping
def _amp(rank, world_size):
    params = {}
    for impl in (MiniDDP, TorchDDP):
        model = impl(build("mlp", seed=rank))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(3):
            opt.zero_grad()
            xb, yb, _, _ = _local_batch(rank, world_size, step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(xb).float(), yb)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        params[impl.__name__] = [p.detach().clone() for p in model.parameters()]
    return params


def test_autocast_gradscaler_and_clipping_match_torch_ddp(ranks):
    for res in ranks(2).run(_amp):
        for a, b in zip(res["MiniDDP"], res["DistributedDataParallel"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------- two forwards, one backward (BN)
def _two_forwards(rank, world_size):
    torch.manual_seed(0)
    model = MiniDDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    a = model(torch.randn(6, 4))
    b = model(torch.randn(6, 4))  # re-broadcasts BatchNorm's buffers between the two
    (a.sum() + b.sum()).backward()  # torch issue 22095: must not fail on version counters
    return all(p.grad is not None for p in model.parameters())


def test_two_forwards_before_one_backward_with_batchnorm(ranks):
    assert ranks(2).run(_two_forwards) == [True, True]


def _kept_order(rank, world_size):
    model = MiniDDP(OutOfOrder(), bucket_cap_mb=1e-3, learn_bucket_order=False)
    before = model.bucket_names
    model(torch.randn(4, 32)).sum().backward()
    return before == model.bucket_names


def test_learned_bucket_order_can_be_switched_off(ranks):
    assert ranks(2).run(_kept_order) == [True, True]


# --------------------------------------------------------------- profiler
def _profiled(rank, world_size):
    model = MiniDDP(build("mlp", seed=0), bucket_cap_mb=1e-3)
    xb, yb, _, _ = _local_batch(rank, world_size)
    F.mse_loss(model(xb), yb).backward()  # outside the profiler: no ranges, no cost
    with torch.profiler.profile() as prof:
        F.mse_loss(model(xb), yb).backward()
    names = {e.name for e in prof.events()}
    return len(model.bucket_names), sorted(n for n in names if n.startswith("minddp."))


def test_torch_profiler_shows_bucket_launches_and_the_wait(ranks):
    n_buckets, names = ranks(2).run(_profiled)[0]
    assert names == sorted([f"minddp.launch_bucket_{i}" for i in range(n_buckets)] + ["minddp.wait_buckets"])


class MaybeSecondLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        h = self.a(x)
        return self.b(h) if use_b else h


def _recovers(rank, world_size):
    model = MiniDDP(MaybeSecondLayer(), bucket_cap_mb=1e-4)
    with pytest.raises(RuntimeError, match="'b.weight'"):
        model(torch.randn(2, 4), use_b=False).sum().backward()
    model(torch.randn(2, 4), use_b=True).sum().backward()  # a good step after the error
    names = [n for bucket in model.bucket_names for n in bucket]
    return sorted(names), all(p.grad is not None for p in model.parameters())


def test_a_failed_backward_does_not_spoil_the_next_one(ranks):
    for names, have_grads in ranks(2).run(_recovers):
        assert names == ["a.bias", "a.weight", "b.bias", "b.weight"]  # each once, after the rebuild
        assert have_grads
