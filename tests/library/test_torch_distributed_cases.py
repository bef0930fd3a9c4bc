"""Behaviours torch's large DDP suite (``distributed_test.py``) checks, MiniDDP beside torch's DDP.

Running torch's ``torch/testing/_internal/distributed/distributed_test.py``
against minddp (``scripts/torch_suites/run.py``) found defects the smaller
files did not. Each is reproduced here in our own words; where the
behaviour runs on CPU, torch's DDP does the same thing in the same rank
function, so a difference from torch fails the test.

Silent ones first:

1. A buffer *re-assigned* after wrapping (``m.buf = m.buf + 1``, a running
   average kept out of place): torch reads ``module.named_buffers()`` again
   before each broadcast, so every rank holds rank 0's value; a wrapper that
   broadcast the tensors it listed at construction leaves the ranks' buffers
   drifting apart without an error.
2. ``static_graph=True`` and a graph that changes: a parameter unused in the
   first iteration and used later is an error (torch's words: "Your training
   graph has changed in this iteration"), never a gradient left un-averaged.
3. ``find_unused_parameters=True`` with ``no_sync()``: a parameter one rank
   used only in a ``no_sync`` micro-batch has a gradient there, so it is
   averaged at the synchronized backward (torch's ``local_used_map`` holds
   every hook since the last synchronization); counting only the hooks of
   the synchronized backward leaves it un-averaged, and the ranks drift apart.
4. An undefined gradient (``UndefinedGrad``) fires a hook but leaves
   ``.grad`` None; it must stay None, not become an average of zeros.
"""

import contextlib
import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from test_training_idioms import _batch, _mse_step, _shard, _train_three_ways, PER_RANK

WRAPPERS = {"torch": TorchDDP, "minddp": MiniDDP}  # torch first: the test is checked on it
WITH_GRADIENTS = "minddp with_gradients"  # rank 0's buffers ride in the last bucket


def _wrap(name, module, **kwargs):
    if name == WITH_GRADIENTS:
        return MiniDDP(module, buffer_sync="with_gradients", **kwargs)
    return WRAPPERS[name](module, **kwargs)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


# ------------------------------------------------ 1. buffers re-assigned
class RunningMean(nn.Module):
    """Keeps a running mean of its inputs *out of place*: each forward assigns a new tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return self.lin(x)


def _reassigned_buffers(rank, world_size, wrapper_name, new_buffer):
    torch.manual_seed(0)
    model = _wrap(wrapper_name, RunningMean())
    seen = []
    for step in range(3):
        x, _ = _batch(step, PER_RANK * world_size)
        if not new_buffer:
            pass
        elif rank == 0:  # torch's own test: rank 0 alone re-assigns a buffer between steps
            model.module.register_buffer("offset", torch.full((2,), float(step)))
        elif step == 0:
            model.module.register_buffer("offset", torch.full((2,), -1.0))
        model(_shard(x, rank)).sum().backward()
        model(_shard(x, rank))  # the forward after a synchronized one takes rank 0's buffers
        seen.append([_gather(model.module.mean), _gather(model.module.offset) if new_buffer else None])
    return seen


@pytest.mark.parametrize("new_buffer", [True, False], ids=["and_one_added", "same_layout"])
def test_a_buffer_reassigned_after_wrapping_is_still_synchronized(ranks, new_buffer):
    for name in [*WRAPPERS, WITH_GRADIENTS]:
        per_rank = ranks(2).run(_reassigned_buffers, name, new_buffer)
        for step, (means, offsets) in enumerate(per_rank[0]):
            # after the second forward, both ranks hold rank 0's buffers as they were before it
            if new_buffer:
                assert torch.equal(offsets[0], offsets[1]), f"{name}, step {step}: offset differs between ranks"
            # the mean moves on each rank's own data in the forward itself, from rank 0's value
            x, _ = _batch(step, PER_RANK * 2)
            delta = 0.1 * (_shard(x, 1).mean(0) - _shard(x, 0).mean(0))
            torch.testing.assert_close(means[1] - means[0], delta, msg=f"{name}, step {step}: means drifted")


# ----------------------------------------- 2. static graph, changed graph
class Branchy(nn.Module):
    """``extra`` takes part only when asked: a graph that changes between iterations."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x, use_extra: bool):
        x = self.lin(x)
        return self.extra(x) if use_extra else x


def _changed_static_graph(rank, world_size, wrapper_name, first, second):
    torch.manual_seed(0)
    model = WRAPPERS[wrapper_name](Branchy(), static_graph=True)
    x = torch.randn(4, 8)
    try:
        for use_extra in (first, second, first):
            model(x, use_extra).sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("first, second", [(False, True), (True, False)], ids=["unused_then_used", "used_then_unused"])
def test_static_graph_refuses_a_graph_that_changed(ranks, first, second):
    for name in WRAPPERS:
        errors = ranks(2).run(_changed_static_graph, name, first, second)
        for error in errors:
            assert error is not None, f"{name}: the changed graph trained silently"
            assert "graph has changed" in error, f"{name}: {error}"


# ----------------------------------------------- 3. pickling and copying
class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _pickled(model, how):
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _train_pickled(rank, world_size, how):
    """A copy (or a save + load) of each wrapper trains like one process on the whole batch."""
    torch.manual_seed(0)
    reference = TwoLayers()
    copies = {}
    for name, wrapper in WRAPPERS.items():
        torch.manual_seed(rank)  # different replicas: only rank 0's weights, broadcast at construction, agree
        copies[name] = _pickled(wrapper(TwoLayers()), how)
    models = {"reference": reference, **copies}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    for step in range(3):
        for name, model in models.items():
            optimizers[name].zero_grad()
            _mse_step(model, step, None if name == "reference" else rank, world_size)
            optimizers[name].step()
        reference_params = dict(reference.named_parameters())
        for name in WRAPPERS:
            for pname, p in copies[name].module.named_parameters():
                torch.testing.assert_close(p, reference_params[pname], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{how} of {name}, step {step}, {pname}: {m}")
    return True


@pytest.mark.parametrize("how", ["deepcopy", "save_and_load"])
def test_a_copied_or_reloaded_wrapper_still_averages(ranks, how):
    assert ranks(2).run(_train_pickled, how) == [True, True]


def _pickle_in_a_subgroup(rank, world_size):
    group = dist.new_group([0, 1])
    model = MiniDDP(TwoLayers(), process_group=group)
    try:
        copy.deepcopy(model)
    except RuntimeError as error:
        return str(error)
    return None


def test_pickling_with_a_process_group_of_ones_own_is_refused_clearly(ranks):
    for error in ranks(2).run(_pickle_in_a_subgroup):
        assert error is not None and "default process group" in error


# -------------------------------- 4. forward_sync_buffers, broadcast_buffers
class CountsInputs(nn.Module):
    """A buffer that differs per rank from the start, and moves in place with each forward."""

    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.full((2,), float(rank)))

    def forward(self, x):
        self.seen.add_(x.detach().mean())
        return self.lin(x)


def _buffer_history(rank, world_size, wrapper_name, kwargs, with_join):
    torch.manual_seed(rank)
    model = WRAPPERS[wrapper_name](CountsInputs(rank), **kwargs)
    history = [_gather(model.module.seen)]  # after construction
    batches = 3 if rank == 0 or not with_join else 1
    with model.join() if with_join else contextlib.nullcontext():
        for step in range(batches):
            x, _ = _batch(step, PER_RANK * world_size)
            model(_shard(x, rank)).sum().backward()
            if not with_join:
                history.append(_gather(model.module.seen))
    history.append(_gather(model.module.seen))  # after the join's end, or after the last step
    return history


BUFFER_ARGUMENTS = [
    {}, {"broadcast_buffers": False}, {"broadcast_buffers": True},
    {"forward_sync_buffers": False}, {"forward_sync_buffers": True},
]


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated")
@pytest.mark.parametrize("kwargs", BUFFER_ARGUMENTS, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()) or "default")
@pytest.mark.parametrize("with_join", [False, True], ids=["even", "join"])
def test_buffers_are_synchronized_when_torch_synchronizes_them(ranks, kwargs, with_join):
    histories = {name: ranks(2).run(_buffer_history, name, kwargs, with_join) for name in WRAPPERS}
    for moment, (mine, torchs) in enumerate(zip(histories["minddp"][0], histories["torch"][0])):
        for rank, (m, t) in enumerate(zip(mine, torchs)):
            torch.testing.assert_close(m, t, msg=lambda msg: f"moment {moment}, rank {rank}'s buffer: {msg}")


# ------------------------------------------ 5. skip_all_reduce_unused_params
class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def test_skip_all_reduce_unused_params_trains_like_torch(ranks):
    kwargs = {"find_unused_parameters": True, "skip_all_reduce_unused_params": True}
    assert ranks(2).run(_train_three_ways, WithUnused, _mse_step, kwargs) == [True, True]


def _count_used_map_collectives(rank, world_size, skip):
    calls = []
    model = MiniDDP(WithUnused(), find_unused_parameters=True, skip_all_reduce_unused_params=skip)
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for step in range(3):
            x, _ = _batch(step, PER_RANK * world_size)
            model(_shard(x, rank)).sum().backward()
    finally:
        dist.all_reduce = real
    return calls.count(torch.int32)  # the used-parameter map travels as int32


def test_skip_all_reduce_unused_params_exchanges_the_used_map_once(ranks):
    assert ranks(2).run(_count_used_map_collectives, False) == [3, 3]
    assert ranks(2).run(_count_used_map_collectives, True) == [1, 1]


# -------------------------------------- 6. join(throw_on_early_termination)
def _throwing_join(rank, world_size, wrapper_name):
    model = WRAPPERS[wrapper_name](TwoLayers())
    steps = 0
    try:
        with model.join(throw_on_early_termination=True):
            for step in range(4 if rank == 0 else 2):
                x, _ = _batch(step, PER_RANK * world_size)
                model(_shard(x, rank)).sum().backward()
                steps += 1
    except RuntimeError as error:
        return steps, str(error)
    return steps, None


def test_join_can_throw_on_every_rank_once_one_runs_out(ranks):
    for name in WRAPPERS:
        (steps0, error0), (steps1, error1) = ranks(2).run(_throwing_join, name)
        assert (steps0, steps1) == (2, 2), name
        assert "Detected at least one rank that exhausted inputs" in error0, (name, error0)
        assert "Rank 1 exhausted all inputs" in error1, (name, error1)


# ------------------------------------------- 7, 8. device_mesh, per-bucket caps
def _mesh_step_kwargs():
    from torch.distributed.device_mesh import init_device_mesh

    return {"device_mesh": init_device_mesh("cpu", (dist.get_world_size(),))}


def _train_on_a_mesh(rank, world_size):
    return _train_three_ways(rank, world_size, TwoLayers, _mse_step, _mesh_step_kwargs())


def test_device_mesh_names_the_ranks_like_torch(ranks):
    assert ranks(2).run(_train_on_a_mesh) == [True, True]


def _mesh_and_group(rank, world_size):
    kwargs = _mesh_step_kwargs()
    try:
        MiniDDP(TwoLayers(), process_group=dist.group.WORLD, **kwargs)
    except RuntimeError as error:
        return str(error)


def test_device_mesh_and_process_group_together_are_refused(ranks):
    for error in ranks(2).run(_mesh_and_group):
        assert "Cannot specify both process_group and device_mesh" in error


def _per_bucket_caps(rank, world_size):
    model = MiniDDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), bucket_cap_mb_list=[0.01, 0.02, 1])
    return [len(names) for names in model.bucket_names]


def test_bucket_cap_mb_list_gives_each_bucket_its_own_cap(ranks):
    # Before the first backward, torch fills the caps in registration order (weight 16 KiB, bias 256 B)
    # and launches the last bucket first. Cap 1 (10 KiB) closes after the first weight; cap 2 (20 KiB)
    # after the bias, a weight, a bias and the weight that passes it; cap 3 (1 MiB) holds the rest.
    assert ranks(2).run(_per_bucket_caps)[0] == [3, 4, 1]


def test_bucket_cap_mb_list_trains_like_torch(ranks):
    kwargs = {"bucket_cap_mb_list": [0.0001, 1]}
    assert ranks(2).run(_train_three_ways, TwoLayers, _mse_step, kwargs) == [True, True]


# ------------------------------------------ 9. nothing to train
def _nothing_to_train(rank, world_size, wrapper_name):
    try:
        WRAPPERS[wrapper_name](nn.Linear(4, 4).requires_grad_(False))
    except RuntimeError as error:
        return str(error)


def test_a_module_with_nothing_to_train_is_a_runtime_error(ranks):
    for name in WRAPPERS:
        assert all(error for error in ranks(2).run(_nothing_to_train, name)), name


# ------------------------- parameters and buffers a library synchronizes itself
class PartlyPrivate(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.shared, self.private = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("own_counter", torch.full((2,), float(rank)))

    def forward(self, x):
        self.own_counter += 1
        return self.private(self.shared(x))


IGNORED = ["private.weight", "private.bias", "own_counter"]


def _train_partly_private(rank, world_size):
    results = {}
    for name, wrapper in WRAPPERS.items():
        torch.manual_seed(rank)
        module = PartlyPrivate(rank)
        wrapper._set_params_and_buffers_to_ignore_for_model(module, IGNORED)
        model = wrapper(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            optimizer.zero_grad()
            _mse_step(model, step, rank, world_size)
            optimizer.step()
        results[name] = {k: _gather(v.detach()) for k, v in module.state_dict().items()}
    return results


def test_parameters_and_buffers_left_to_the_user_are_neither_averaged_nor_broadcast(ranks):
    per_rank = ranks(2).run(_train_partly_private)[0]
    for key, torchs in per_rank["torch"].items():
        for rank, (mine, theirs) in enumerate(zip(per_rank["minddp"][key], torchs)):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} on rank {rank}: {m}")
    assert not torch.equal(*per_rank["minddp"]["private.weight"])  # each rank kept its own
    assert torch.equal(*per_rank["minddp"]["shared.weight"])


class RankShaped(nn.Module):
    """A private layer whose shape depends on the rank (a library keeps it in sync itself, or not at all)."""

    def __init__(self, rank):
        super().__init__()
        self.shared, self.private = nn.Linear(8, 8), nn.Linear(8, 1 + rank)
        self.register_buffer("private_buffer", torch.zeros(1 + rank))

    def forward(self, x):
        return self.shared(x), self.private(x)


def _ignore_rank_shaped(rank, world_size, wrapper_name):
    module = RankShaped(rank)
    WRAPPERS[wrapper_name]._set_params_and_buffers_to_ignore_for_model(module, ["private.weight", "private.bias",
                                                                                "private_buffer"])
    model = WRAPPERS[wrapper_name](module)
    shared, private = model(torch.randn(2, 8))
    (shared.sum() + private.sum()).backward()
    return _gather(module.shared.weight.grad)[1].equal(_gather(module.shared.weight.grad)[0])


def test_parameters_left_to_the_user_may_differ_in_shape_between_ranks(ranks):
    for name in WRAPPERS:
        assert ranks(2).run(_ignore_rank_shaped, name) == [True, True], name


def _construct_with(rank, world_size, wrapper_name, kwargs):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        WRAPPERS[wrapper_name](TwoLayers(), **kwargs)
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("kwargs", [{"broadcast_buffers": True}, {"broadcast_buffers": False},
                                    {"broadcast_buffers": False, "forward_sync_buffers": True}],
                         ids=["True", "False", "and_forward_sync_buffers"])
def test_broadcast_buffers_is_deprecated_as_in_torch(ranks, kwargs):
    for name in WRAPPERS:
        warned = ranks(2).run(_construct_with, name, kwargs)[0]
        assert any("broadcast_buffers" in w for w in warned), (name, warned)
    assert ranks(2).run(_construct_with, "minddp", {"forward_sync_buffers": False})[0] == []


def _profiled_search(rank, world_size, wrapper_name):
    model = WRAPPERS[wrapper_name](WithUnused(), find_unused_parameters=True)
    for _ in range(3):  # steps before the profiler starts, as in torch's own test
        model(torch.randn(2, 8)).sum().backward()
    with torch.profiler.profile() as profile:
        model(torch.randn(2, 8)).sum().backward()
    return sum(event.name.endswith("search_unused_parameters") for event in profile.events())


def test_the_unused_parameter_search_is_named_in_torchs_profiler(ranks):
    for name in WRAPPERS:
        assert ranks(2).run(_profiled_search, name) == [1, 1], name


class _TakesTurns(nn.Module):
    """torch's ``SimpleConditionalModel``: rank 0 uses a then b, the others c then d, one per forward."""

    def __init__(self, rank):
        super().__init__()
        self.rank, self.turn = rank, 0
        self.a, self.b, self.c, self.d = (nn.Linear(1, 1) for _ in range(4))

    def forward(self, x):
        first, second = (self.a, self.b) if self.rank == 0 else (self.c, self.d)
        self.turn ^= 1
        return (first if self.turn else second)(x)


def _no_sync_then_sync_with_unused(rank, world_size):
    grads = {}
    for name, wrapper in WRAPPERS.items():
        torch.manual_seed(0)
        model = wrapper(_TakesTurns(rank), find_unused_parameters=True)
        g = torch.Generator().manual_seed(rank)
        with model.no_sync():
            model(torch.rand(1, generator=g)).sum().backward()
        model(torch.rand(1, generator=g)).sum().backward()
        grads[name] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return grads


def test_a_parameter_used_only_under_no_sync_is_averaged_like_torch(ranks):
    results = ranks(2).run(_no_sync_then_sync_with_unused)
    for grads in results:
        assert all(g is not None for g in grads["torch"]), "torch averages every parameter some rank used"
        assert all(m is not None and torch.equal(m, t) for m, t in zip(grads["minddp"], grads["torch"])), grads
    assert all(torch.equal(a, b) for a, b in zip(results[0]["minddp"], results[1]["minddp"])), "ranks differ"


def _undefined_gradient(rank, world_size):
    torch.manual_seed(0)
    model = MiniDDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), find_unused_parameters=True)
    torch._C._functions.UndefinedGrad()(model(torch.ones(1, 2)).sum()).backward()
    return [p.grad is None for p in model.parameters()]


def test_an_undefined_gradient_leaves_grad_none_like_torch(ranks):
    for none in ranks(2).run(_undefined_gradient):
        assert all(none), f"every .grad must stay None, got {none}"
