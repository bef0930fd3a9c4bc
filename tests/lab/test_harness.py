"""The harness turns crashes and hangs into failures, and recovers from them."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from minddp_lab.rank_pool import RankError, RankPool


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), os.getpid()


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # rank 0 waits for a rank that never comes


def _rank1_hangs(rank, world_size):
    if rank == 1:
        time.sleep(3600)


def _rank0_exits(rank, world_size):
    if rank == 0:
        os._exit(3)


def _group_rank(rank, world_size):
    return dist.get_rank()  # from the process group, not the argument the pool passed


def test_results_come_back_in_rank_order(ranks):
    assert ranks(3).run(_group_rank) == [0, 1, 2]


def test_pool_reuses_processes(ranks):
    first = ranks(2).run(_all_reduce_rank)
    second = ranks(2).run(_all_reduce_rank)
    assert [pid for _, pid in first] == [pid for _, pid in second]


def test_raising_rank_fails_the_call_with_its_traceback(ranks):
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 raised") as info:
        ranks(2).run(_rank1_raises, timeout_s=30)
    assert "ValueError: rank one is unhappy" in str(info.value)
    assert "_rank1_raises" in str(info.value)  # the traceback, not just the message
    assert info.value.rank == 1
    assert time.monotonic() - start < 15  # rank 0's barrier did not stall us
    # ...and the pool comes back with fresh processes.
    assert [r[0] for r in ranks(2).run(_all_reduce_rank)] == [1.0, 1.0]


def test_hanging_rank_fails_within_the_limit():
    with RankPool(2) as pool:
        start = time.monotonic()
        with pytest.raises(RankError, match=r"did not finish within 2 s"):
            pool.run(_rank1_hangs, timeout_s=2)
        assert time.monotonic() - start < 10
        assert pool._procs == []  # every rank was killed and reaped


def test_dying_rank_is_reported():
    with RankPool(2) as pool:
        with pytest.raises(RankError, match="rank 0 died"):
            pool.run(_rank0_exits, timeout_s=30)
