"""The reducer's hook points, used the way the policies above it use them.

Mechanism below, policy above: the learned bucket order, the lab's bucket
planner (``minddp_lab.auto``) and ZeRO stage 2 drive the reducer only through its documented
interface: an observer they add (``add_observer``, here an ``ArrivalOrder``),
``add_policy`` (told at the end of each backward), ``rebuild``, and lent buckets
(``use_bucket_storage`` and ``set_gradients``, by ``lend_buckets``). Each
test here is a small policy of its own, and the oracle is torch's DDP on
the same shards.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp.ddp.core.buckets import BucketStorage
from minddp.ddp.parts.lent_buckets import lend_buckets
from minddp.ddp.policies import ArrivalOrder, Policy, add_policy

STEPS = 3


def _tower():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


class OneBucketPerLayerInArrivalOrder(Policy):
    """A policy: after the second backward, one parameter per bucket, in the order gradients came."""

    def __init__(self, reducer):
        self.reducer, self.backwards, self.rebuilt_with = reducer, 0, None
        self.arrivals = ArrivalOrder()
        reducer.add_observer(self.arrivals)
        add_policy(reducer, self)

    def backwards_until_final(self):
        return 0 if self.rebuilt_with else 2 - self.backwards

    def after_backward(self):
        self.backwards += 1
        if self.backwards == 2:
            order = list(dict.fromkeys(self.arrivals.indices))
            self.rebuilt_with = order
            self.reducer.rebuild(order, 0, None)


def _policy_rebuilds(rank, world_size):
    mini, native = MiniDDP(_tower(), learn_bucket_order=False), TorchDDP(_tower())
    policy = OneBucketPerLayerInArrivalOrder(mini.reducer)
    before = len(mini.bucket_names)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mini, native)]
    for step in range(STEPS):
        x, y = _batch(step, rank)
        for model, opt in zip((mini, native), opts):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        for p, q in zip(mini.parameters(), native.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    return before, len(mini.bucket_names), policy.rebuilt_with


def test_a_policy_rebuilds_the_buckets_from_the_arrival_log(ranks):
    # Not vacuous: the buckets change (1 -> 8) mid-training, and the order
    # the policy read is the real backward order (last layer first).
    for before, after, order in ranks(2).run(_policy_rebuilds):
        assert (before, after) == (1, 8)
        assert order == [7, 6, 5, 4, 3, 2, 1, 0]


class LendingPool(BucketStorage):
    """Lends buffers from a free list; counts what is out."""

    keep_buffers = False

    def __init__(self):
        self.free, self.out, self.most_out, self.allocated = [], 0, 0, 0

    def take(self, numel, dtype, device):
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        for k, buffer in enumerate(self.free):
            if buffer.numel() == numel and buffer.dtype == dtype:
                return self.free.pop(k)
        self.allocated += 1
        return torch.full((numel,), float("nan"), dtype=dtype, device=device)  # dirty on purpose

    def give_back(self, buffer):
        self.out -= 1
        self.free.append(buffer)


def _blocking_allreduce(state, bucket):
    """Averages before it returns: its future is done at once, so the reducer reclaims every bucket early."""
    buffer = bucket.buffer().div_(torch.distributed.get_world_size())
    torch.distributed.all_reduce(buffer)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def _lent_buffers(rank, world_size, as_view):
    mini = MiniDDP(_tower(), bucket_cap_mb=16 * 17 * 4 / 2**20, gradient_as_bucket_view=as_view)
    mini.register_comm_hook(None, _blocking_allreduce)
    native = TorchDDP(_tower())
    pool = LendingPool()
    taken = {}

    def take(bucket):  # the result goes elsewhere (as stage 2's shards), not into .grad
        for p, slot in zip(bucket.parameters(), bucket.gradients()):
            taken[id(p)] = slot.clone()
        return True

    x, y = _batch(0, rank)
    F.mse_loss(mini(x), y).backward()  # the first backward: the learned order rebuilds the buckets
    lend_buckets(mini.reducer, pool, on_reduced=lambda bucket: False)  # declined: .grad written as usual
    mini.zero_grad(set_to_none=True)
    native.zero_grad(set_to_none=True)
    F.mse_loss(mini(x), y).backward()
    F.mse_loss(native(x), y).backward()
    for p, q in zip(mini.parameters(), native.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    mini.reducer.gradients.on_reduced = take
    results = []
    for step in range(1, STEPS):
        x, y = _batch(step, rank)
        mini.zero_grad(set_to_none=True)
        native.zero_grad(set_to_none=True)
        F.mse_loss(mini(x), y).backward()
        F.mse_loss(native(x), y).backward()
        for p, q in zip(mini.parameters(), native.parameters()):
            if as_view:  # a slot of a buffer that went back is never left as .grad
                assert p.grad is None
            torch.testing.assert_close(taken[id(p)], q.grad, rtol=1e-6, atol=1e-7)
        results.append((pool.out, pool.allocated))
    return results, len(mini.bucket_names)


def test_a_lending_storage_gets_every_buffer_back_and_the_averages_are_right(ranks):
    # The pool hands out NaN-filled buffers: a slot not overwritten before
    # the all-reduce would poison the average. Every buffer is back after
    # each backward (out == 0), and no more were ever allocated than buckets.
    # A backward whose buckets the hook declines (as ZeRO stage 2's first,
    # all-reduced one) writes .grad as usual, with a bucket offered once
    # (it used to be waited for twice: "waited on before it was launched").
    for as_view in (False, True):
        for results, buckets in ranks(2).run(_lent_buffers, as_view):
            assert buckets == 4
            for out, allocated in results:
                assert out == 0 and allocated <= buckets
