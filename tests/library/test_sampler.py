"""minddp.DistributedSampler yields torch's indices, and an exact evaluation mode."""

import itertools

import pytest
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from minddp import DistributedSampler

SIZES = (1, 7, 10, 11, 100, 1000)
REPLICAS = range(1, 8)


def test_index_for_index_equal_to_torch():
    checked = 0
    for n, world, shuffle, drop_last in itertools.product(SIZES, REPLICAS, (False, True), (False, True)):
        data = range(n)
        # Shuffled orders depend on seed + epoch; unshuffled ones on neither.
        settings = [(0, 0), (0, 3), (7, 0), (123, 2)] if shuffle else [(0, 0)]
        for rank in range(world):
            ours = DistributedSampler(data, world, rank, shuffle=shuffle, seed=0, drop_last=drop_last)
            for seed, epoch in settings:
                theirs = TorchSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
                ours.seed = seed
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                expected = list(theirs)
                assert list(ours) == expected, (n, world, rank, shuffle, drop_last, seed, epoch)
                assert len(ours) == len(theirs) == len(expected)
                checked += 1
    assert checked > 1000


def test_epochs_change_the_order_only_through_set_epoch():
    sampler = DistributedSampler(range(100), 2, 0, shuffle=True, seed=5)
    first, again = list(sampler), list(sampler)
    assert first == again
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_ranks_partition_the_padded_order():
    n, world = 11, 4
    shards = [list(DistributedSampler(range(n), world, r, seed=3)) for r in range(world)]
    assert {len(s) for s in shards} == {3}  # padded to 12, 3 per rank
    seen = sorted(i for s in shards for i in s)
    assert set(seen) == set(range(n)) and len(seen) == 12  # exactly one duplicate


@pytest.mark.parametrize("shuffle", [False, True])
def test_evaluation_mode_yields_every_sample_exactly_once(shuffle):
    for n, world in itertools.product((0,) + SIZES, REPLICAS):
        shards = [
            list(DistributedSampler(range(n), world, r, shuffle=shuffle, seed=9, pad=False)) for r in range(world)
        ]
        union = sorted(i for s in shards for i in s)
        assert union == list(range(n)), (n, world)
        lengths = [len(DistributedSampler(range(n), world, r, pad=False)) for r in range(world)]
        assert lengths == [len(s) for s in shards]
        assert max(lengths) - min(lengths) <= 1


def test_empty_dataset_yields_nothing():
    for pad in (True, False):
        sampler = DistributedSampler([], 3, 1, pad=pad)
        assert len(sampler) == 0 and list(sampler) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_replicas=2, rank=2), r"rank must be an int in \[0, 2\).*got 2"),
        (dict(num_replicas=2, rank=-1), r"rank must be an int in \[0, 2\).*got -1"),
        (dict(num_replicas=0, rank=0), r"num_replicas must be an int >= 1, got 0"),
        (dict(num_replicas=2.0, rank=0), r"num_replicas must be an int >= 1, got 2.0"),
        (dict(num_replicas=2, rank=0, pad=False, drop_last=True), r"pad=False .* drop_last=True"),
    ],
)
def test_bad_arguments_say_what_was_given_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedSampler(range(10), **kwargs)


def test_missing_world_without_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"num_replicas=None and rank=0.*no process group is initialized"):
        DistributedSampler(range(10), rank=0)
    with pytest.raises(ValueError, match=r"num_replicas=None and rank=None"):
        DistributedSampler(range(10))


def _sampler_from_group(rank, world_size):
    sampler = DistributedSampler(range(10), shuffle=False)
    return sampler.num_replicas, sampler.rank, list(sampler)


def test_defaults_come_from_the_process_group(ranks):
    results = ranks(3).run(_sampler_from_group)
    assert results == [(3, 0, [0, 3, 6, 9]), (3, 1, [1, 4, 7, 0]), (3, 2, [2, 5, 8, 1])]
