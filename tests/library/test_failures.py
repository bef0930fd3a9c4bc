"""The failures people meet most, in torch's DDP and in MiniDDP: both fail (or warn) where the other does,
and MiniDDP's message names what is at fault (parameter, rank, step) and the fix.

Lesson 23 (``lessons/23_when_ddp_goes_wrong.py``) shows each one with both wrappers' words; these tests
hold the behaviour and the names, not the wording.
"""

import datetime
import os
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from minddp import MiniDDP


class WithExtra(nn.Module):
    """``extra`` is used only when asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_extra=False):
        h = self.body(x)
        return self.extra(h) if use_extra else h


def _error_of(fn) -> str:
    try:
        fn()
    except RuntimeError as error:
        return str(error)
    return ""


def _unused_everywhere(rank, world_size):
    x = torch.randn(2, 4)
    said = {}
    for wrapper in (DistributedDataParallel, MiniDDP):
        model = wrapper(WithExtra())

        def two_steps():
            for _ in range(2):
                model(x).sum().backward()

        said[wrapper.__name__] = _error_of(two_steps)
    return said


def test_an_unused_parameter_fails_in_both_and_minddp_names_it_the_rank_and_the_fix(ranks):
    said = ranks(2).run(_unused_everywhere)
    for rank, words in enumerate(said):
        assert "find_unused_parameters" in words["DistributedDataParallel"], words  # torch: at the next forward
        ours = words["MiniDDP"]
        assert "extra.weight" in ours and "extra.bias" in ours and "body.weight" not in ours, ours
        assert f"rank {rank}" in ours, ours
        assert "find_unused_parameters=True" in ours, ours


def _c_stderr(fn) -> str:
    """``fn()``'s writes to file descriptor 2 (where torch's C++ warnings go)."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        return caught.read().decode(errors="replace")


def _nothing_unused(rank, world_size):
    x = torch.randn(2, 4)
    theirs = DistributedDataParallel(WithExtra(), find_unused_parameters=True)
    torch_said = _c_stderr(lambda: theirs(x, use_extra=True).sum().backward())
    ours = MiniDDP(WithExtra(), find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ours(x, use_extra=True).sum().backward()
    return torch_said, [str(w.message) for w in caught]


def test_find_unused_parameters_with_none_unused_warns_in_both_once_naming_the_rank_and_the_fix(ranks):
    for rank, (torch_said, ours) in enumerate(ranks(2).run(_nothing_unused)):
        assert "find_unused_parameters=True" in torch_said, torch_said
        assert len(ours) == 1, ours  # once, as torch's
        assert f"rank {rank}" in ours[0] and "find_unused_parameters=False" in ours[0], ours[0]


def _some_used(rank, world_size):
    """Used on rank 0 only: the flag is needed, and neither warns on rank 1."""
    model = MiniDDP(WithExtra(), find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 4), use_extra=rank == 0).sum().backward()
    return [str(w.message) for w in caught]


def test_no_warning_where_a_parameter_was_unused(ranks):
    warned = ranks(2).run(_some_used)
    assert len(warned[0]) == 1 and warned[1] == [], warned


def _uneven(rank, world_size):
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    x = torch.randn(2, 4)
    said = {}
    for wrapper in (DistributedDataParallel, MiniDDP):
        model = wrapper(nn.Linear(4, 4), process_group=group)

        def train():
            for _ in range(3 if rank == 0 else 2):  # rank 0 has one batch more
                model(x).sum().backward()

        said[wrapper.__name__] = _error_of(train)
        dist.barrier()
        group = dist.new_group(timeout=datetime.timedelta(seconds=2))  # the timed-out group is left behind
    return said


@pytest.mark.timeout(120)
def test_a_bucket_another_rank_never_sends_times_out_in_both_and_minddp_names_bucket_rank_step_and_fix(ranks):
    said = ranks(2).run(_uneven, timeout_s=90)
    assert said[1] == {"DistributedDataParallel": "", "MiniDDP": ""}, said[1]  # rank 1 ran out of data: done
    torch_said, ours = said[0]["DistributedDataParallel"], said[0]["MiniDDP"]
    assert "timed out" in torch_said.lower(), torch_said
    assert "weight" in ours and "bias" in ours and "rank 0" in ours, ours
    assert "3" in ours.split("\n")[0], ours  # the third synchronized backward
    assert "join()" in ours, ours
    assert "timed out" in ours.lower(), ours  # the process group's own words kept


class Checkpointed(nn.Module):
    """Two blocks under reentrant activation checkpoints."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return checkpoint(self.b, checkpoint(self.a, x, use_reentrant=True), use_reentrant=True)


def _reentrant(rank, world_size):
    x = torch.randn(2, 4, requires_grad=True)
    said = {}
    for wrapper in (DistributedDataParallel, MiniDDP):
        model = wrapper(Checkpointed(), find_unused_parameters=True)
        said[wrapper.__name__] = _error_of(lambda: model(x).sum().backward())
    return said


def test_reentrant_checkpoints_with_find_unused_fail_in_both_and_minddp_names_the_parameter_and_fixes(ranks):
    for said in ranks(2).run(_reentrant):
        assert "mark a variable ready only once" in said["DistributedDataParallel"], said
        ours = said["MiniDDP"]
        assert "b.bias" in ours or "b.weight" in ours, ours
        assert "use_reentrant=False" in ours and "static_graph=True" in ours, ours


def _static_graph_accumulation(rank, world_size):
    x = torch.randn(2, 4) + rank
    said, grads = {}, {}
    for wrapper in (DistributedDataParallel, MiniDDP):
        model = wrapper(nn.Linear(4, 1), static_graph=True)

        def accumulate():
            for _ in range(2):
                model.zero_grad()
                with model.no_sync():
                    model(x).sum().backward()
                model(x).sum().backward()

        said[wrapper.__name__] = _error_of(accumulate)
        grads[wrapper.__name__] = model.module.weight.grad
    plain = MiniDDP(nn.Linear(4, 1))
    plain.zero_grad()
    with plain.no_sync():
        plain(x).sum().backward()
    plain(x).sum().backward()
    return said, torch.equal(grads["MiniDDP"], plain.module.weight.grad)


def test_static_graph_with_no_sync_fails_in_torch_and_accumulates_right_in_minddp(ranks):
    for said, same in ranks(2).run(_static_graph_accumulation):
        assert "expect_autograd_hooks_" in said["DistributedDataParallel"], said  # torch 2.15's internal assert
        assert said["MiniDDP"] == "" and same, said


def _evaluation_on_rank_0(rank, world_size):
    dist.barrier()
    x = torch.randn(2, 4)
    said = {}
    for wrapper in (DistributedDataParallel, MiniDDP):
        group = dist.new_group(timeout=datetime.timedelta(seconds=2))
        model = wrapper(nn.Linear(4, 4), process_group=group)

        def step_evaluate_step():
            model(x).sum().backward()
            if rank == 0:
                dist.barrier(group=group)  # an evaluation's collective, on rank 0 only
            model(x).sum().backward()

        said[wrapper.__name__] = _error_of(step_evaluate_step)
        dist.barrier()
    return said


@pytest.mark.timeout(120)
def test_a_collective_on_one_rank_only_fails_every_rank_in_both_and_minddp_names_the_bucket_and_causes(ranks):
    said = ranks(2).run(_evaluation_on_rank_0, timeout_s=90)
    for wrapper in ("DistributedDataParallel", "MiniDDP"):
        assert all(words[wrapper] for words in said), said  # every rank raised, none hung
    ours = said[1]["MiniDDP"]  # rank 1 waited in the gradients' all-reduce
    if "closed" not in ours.lower():  # (rank 0 may have given up first and closed the connection)
        assert "rank 1" in ours and "weight" in ours and "barrier()" in ours, ours


def _collectives_per_step(rank, world_size, **kwargs):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d" and "wait" not in func.__name__:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for wrapper in (DistributedDataParallel, MiniDDP):
            model = wrapper(WithExtra(), **kwargs)
            for _ in range(2):  # the order learned, the buckets rebuilt
                _c_stderr(lambda: model(torch.randn(2, 4), use_extra=True).sum().backward())
            Count.calls = 0
            with Count():
                model(torch.randn(2, 4), use_extra=True).sum().backward()
            counts[wrapper.__name__] = Count.calls
    return counts


@pytest.mark.parametrize("kwargs", [{}, {"bucket_cap_mb": 1e-6}, {"find_unused_parameters": True}],
                         ids=["default", "tiny buckets", "find_unused"])
def test_a_step_launches_as_many_collectives_in_both(ranks, kwargs):
    counts = ranks(2).run(_collectives_per_step, **kwargs)[0]
    assert counts["MiniDDP"] == counts["DistributedDataParallel"] > 0, counts


def _prefixed_state_dict(rank, world_size):
    said = {}
    for wrapper in (DistributedDataParallel, MiniDDP):
        state = wrapper(WithExtra()).state_dict()
        said[wrapper.__name__] = _error_of(lambda: WithExtra().load_state_dict(state))
    return said


def test_a_wrapped_state_dict_loaded_unwrapped_fails_the_same_in_both_naming_the_prefixed_keys(ranks):
    said = ranks(2).run(_prefixed_state_dict)[0]
    assert said["MiniDDP"] == said["DistributedDataParallel"] and "module.body.weight" in said["MiniDDP"], said


def test_both_samplers_repeat_the_order_without_set_epoch_and_pad_by_repeating():
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    from minddp.sampler import DistributedSampler

    for make in (TorchSampler, DistributedSampler):
        sampler = make(range(5), num_replicas=2, rank=0, seed=0)
        assert list(sampler) == list(sampler)  # the same order, epoch after epoch
        sampler.set_epoch(1)
        assert list(sampler) != list(make(range(5), num_replicas=2, rank=0, seed=0))
    both = [i for r in range(2) for i in TorchSampler(range(5), num_replicas=2, rank=r, shuffle=False)]
    assert len(both) == 6 and len(set(both)) == 5  # padding: one sample twice
    exact = [i for r in range(2)
             for i in DistributedSampler(range(5), num_replicas=2, rank=r, shuffle=False, pad=False)]
    assert sorted(exact) == list(range(5))


def _batchnorm_on_cpu(rank, world_size):
    from minddp.sync_batchnorm import SyncBatchNorm

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)) + 2 * rank  # each rank's own slice
    try:
        nn.SyncBatchNorm(3)(x)
        theirs = ""
    except ValueError as error:
        theirs = str(error)
    return theirs, SyncBatchNorm(3)(x).mean(0)


def test_torch_syncbatchnorm_refuses_cpu_and_minddps_normalizes_over_every_rank(ranks):
    said = ranks(2).run(_batchnorm_on_cpu)
    assert all("GPU" in theirs for theirs, _ in said), said
    means = [mean for _, mean in said]
    assert (means[0] - means[1]).abs().min() > 1  # each rank's slice is not normalized on its own ...
    torch.testing.assert_close(means[0] + means[1], torch.zeros(3), atol=1e-5, rtol=0)  # ... but the whole batch
