"""Shared fixtures: rank pools that live for the whole test session.

``ranks(n)`` returns a :class:`minddp_lab.rank_pool.RankPool` of ``n`` Gloo ranks.
Pools are started once and reused, since starting a rank (importing torch,
meeting over TCP) costs more than most tests; a failing test restarts only
its own pool.
"""

import pytest
import torch

from minddp_lab.rank_pool import RankPool

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def _pools():
    pools: dict[int, RankPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks(_pools):
    def get(world_size: int) -> RankPool:
        if world_size not in _pools:
            _pools[world_size] = RankPool(world_size)
        return _pools[world_size]

    return get
