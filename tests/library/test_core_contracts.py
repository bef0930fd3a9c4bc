"""The core's contracts: each slot an abstract base class its parts implement, the backward's phase, the policies.

The oracle for the phase is the life cycle torch's reducer follows (armed at
a synchronized forward, reducing from the first hook, done at the end of
backward; nothing armed inside ``no_sync()``); for the policies, the
reducer's own account of what it calls.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable

from minddp import MiniDDP
from minddp.ddp.core.reducer import AllReduce, BackwardPhase, CopyGradients, EveryHookReady, Reducer
from minddp.ddp.core.slots import Communication, GradientTransfer, Observer, Readiness
from minddp.ddp.parts.bucket_views import BucketViews
from minddp.ddp.parts.buffers_in_bucket import RidesInLastBucket
from minddp.ddp.parts.comm_hook import CommHook
from minddp.ddp.parts.gradient_cases import GradientCases
from minddp.ddp.parts.lent_buckets import LentBuckets
from minddp.ddp.parts.static_graph import StaticGraph
from minddp.ddp.parts.unused_parameters import UnusedParameters
from minddp.ddp.policies import Policy, add_policy, backwards_until_buckets_final, remove_policy
from minddp.ddp.torch_surface import TorchReducer

SLOTS = {
    Readiness: [EveryHookReady, UnusedParameters, StaticGraph],
    GradientTransfer: [CopyGradients, GradientCases, BucketViews, LentBuckets, RidesInLastBucket],
    Communication: [AllReduce, CommHook],
}
# The one slot method with a default a part may keep: no room after its bucket's gradients.
DEFAULTED = {"room_after_gradients"}


@pytest.mark.parametrize("slot", [*SLOTS, Policy], ids=lambda s: s.__name__)
def test_a_part_missing_a_method_of_its_slot_fails_where_it_is_constructed(slot):
    required = sorted(slot.__abstractmethods__)
    assert required, "not vacuous: the slot names the methods a part must have"
    public = {name for name, member in vars(slot).items() if inspect.isfunction(member) and not name.startswith("_")}
    assert public - set(required) <= DEFAULTED, f"{slot.__name__}: methods a part could forget silently"
    for missing in required:
        others = {name: (lambda self, *args: None) for name in required if name != missing}
        forgetful = type(f"Without_{missing}", (slot,), others)
        with pytest.raises(TypeError, match=missing):
            forgetful()


@pytest.mark.parametrize("slot", list(SLOTS), ids=lambda s: s.__name__)
def test_every_part_is_a_complete_implementation_of_its_slot(slot):
    for part in SLOTS[slot]:
        assert issubclass(part, slot), f"{part.__name__} is not a {slot.__name__}"
        assert not inspect.isabstract(part), f"{part.__name__} leaves out {sorted(part.__abstractmethods__)}"


def test_the_part_slots_of_the_reducer_are_typed_by_their_base_classes():
    hints = inspect.signature(Reducer.__init__).parameters
    for name, slot in (("readiness", Readiness), ("gradients", GradientTransfer), ("communication", Communication)):
        assert slot.__name__ in str(hints[name].annotation), (name, hints[name].annotation)


def test_torchs_calls_are_methods_of_their_classes():
    for cls, names in ((MiniDDP, ["join", "join_hook", "register_comm_hook", "__getstate__", "__setstate__",
                                  "_register_builtin_comm_hook", "_get_ddp_logging_data"]),
                       (TorchReducer, ["_rebuild_buckets", "_delay_all_reduce"])):
        for name in names:
            owner = getattr(cls, name).__qualname__.split(".")[0]
            assert owner in {c.__name__ for c in cls.__mro__}, name
    assert issubclass(MiniDDP, Joinable), "a torch Joinable, as torch's DDP"


class _PhaseWatch(Observer):
    def __init__(self, reducer):
        self.reducer, self.seen = reducer, []

    def gradient_ready(self, index, param):
        self.seen.append(self.reducer.phase)


class _CountingPolicy(Policy):
    def __init__(self, reducer):
        self.reducer, self.backwards = reducer, 0

    def after_backward(self):
        self.backwards += 1
        assert self.reducer.phase is BackwardPhase.IDLE  # told once .grad is written

    def backwards_until_final(self):
        return 0


def _phases_and_policies(rank, world_size):
    torch.manual_seed(0)
    model = MiniDDP(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    reducer = model.reducer
    watch, policy = _PhaseWatch(reducer), _CountingPolicy(reducer)
    reducer.add_observer(watch)
    add_policy(reducer, policy)
    x, y = torch.randn(3, 4) + rank, torch.randn(3, 2)
    out = {"start": reducer.phase, "pending_before": backwards_until_buckets_final(reducer)}
    loss = F.mse_loss(model(x), y)
    out["after_forward"] = reducer.phase
    loss.backward()
    out["after_backward"], out["in_hooks"] = reducer.phase, set(watch.seen)
    out["pending_after"] = backwards_until_buckets_final(reducer)
    with model.no_sync():
        loss = F.mse_loss(model(x), y)
        out["no_sync_forward"] = reducer.phase
        loss.backward()
    with torch.no_grad():
        model(x)
    out["no_grad_forward"] = reducer.phase
    out["told"] = policy.backwards
    remove_policy(reducer, policy)
    F.mse_loss(model(x), y).backward()
    out["told_after_removal"] = policy.backwards
    return out


def test_the_backward_phase_and_the_policies_follow_a_step(ranks):
    for out in ranks(2).run(_phases_and_policies):
        assert out["start"] is BackwardPhase.IDLE
        assert out["after_forward"] is BackwardPhase.ARMED
        assert out["in_hooks"] == {BackwardPhase.REDUCING}
        assert out["after_backward"] is BackwardPhase.IDLE
        assert out["no_sync_forward"] is BackwardPhase.IDLE and out["no_grad_forward"] is BackwardPhase.IDLE
        assert out["pending_before"] == 1, "the learned order is a policy: one backward to learn from"
        assert out["pending_after"] == 0, "learned after the first backward"
        assert out["told"] == 1, "told at the end of the synchronized backward only"
        assert out["told_after_removal"] == 1


def _torchs_join(rank, world_size):
    torch.manual_seed(0)
    model = MiniDDP(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 2 + rank  # uneven: rank 1 has one more
    with TorchJoin([model]):
        for step in range(batches):
            opt.zero_grad()
            model(torch.full((2, 3), float(step + 1))).sum().backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_torchs_join_runs_minddps_join_hook(ranks):
    params = ranks(2).run(_torchs_join)
    for mine, theirs in zip(*params):  # the joined rank shadowed the extra step, then took rank 1's parameters
        assert torch.equal(mine, theirs)
