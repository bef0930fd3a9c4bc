"""Reduce-scatter and all-gather as pairwise sends (minddp/zero/pairwise.py), against torch's own on Gloo.

The values are drawn across seven orders of magnitude, so that a different
order of summation shows in the last bits: at 3 ranks the check of the rank
order below is not vacuous (Gloo's ring sums in another order, and differs).
"""

import torch
import torch.distributed as dist

from minddp.zero import pairwise

PIECE = 1001


def _spread_values(rank, world_size):
    torch.manual_seed(rank)
    return torch.randn(world_size * PIECE) * 10.0 ** torch.randint(-3, 4, (world_size * PIECE,))


def _reduce_scatter_both_ways(rank, world_size):
    torch.set_num_threads(1)
    send = _spread_values(rank, world_size)
    theirs = torch.empty(PIECE)
    dist.reduce_scatter_tensor(theirs, send.clone())
    ours = pairwise.reduce_scatter(send, PIECE, dist.group.WORLD).wait()
    into = torch.full((PIECE,), float("nan"))
    returned = pairwise.reduce_scatter(send, PIECE, dist.group.WORLD, out=into).wait()
    everyone = [torch.empty_like(send) for _ in range(world_size)]
    dist.all_gather(everyone, send)
    in_rank_order = everyone[0][rank * PIECE: (rank + 1) * PIECE].clone()
    for other in everyone[1:]:
        in_rank_order += other[rank * PIECE: (rank + 1) * PIECE]
    untouched = torch.equal(send, _spread_values(rank, world_size))
    return theirs, ours, returned is into and torch.equal(into, ours), in_rank_order, untouched


def test_two_ranks_reduce_scatter_equals_gloos_bit_for_bit(ranks):
    for theirs, ours, into_out, _, untouched in ranks(2).run(_reduce_scatter_both_ways, timeout_s=60):
        assert torch.equal(ours, theirs)  # a + b == b + a: the same bits as any all-reduce
        assert into_out and untouched


def test_three_ranks_sum_in_rank_order(ranks):
    differs = 0
    for theirs, ours, into_out, in_rank_order, untouched in ranks(3).run(_reduce_scatter_both_ways, timeout_s=60):
        assert torch.equal(ours, in_rank_order)
        assert into_out and untouched
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * theirs.abs().max().item())
        differs += not torch.equal(ours, theirs)
    assert differs, "Gloo's ring and the rank order agreed everywhere: the values do not test the order"


def _all_gather_both_ways(rank, world_size):
    torch.set_num_threads(1)
    mine = torch.arange(PIECE, dtype=torch.float32) + 1000 * rank
    theirs = torch.empty(world_size * PIECE)
    dist.all_gather_into_tensor(theirs, mine)
    ours = torch.full((world_size * PIECE,), float("nan"))
    pairwise.all_gather(ours, mine, dist.group.WORLD).wait()
    return theirs, ours


def test_all_gather_receives_every_piece_into_place(ranks):
    for world_size in (2, 3):
        for theirs, ours in ranks(world_size).run(_all_gather_both_ways, timeout_s=60):
            assert torch.equal(ours, theirs)


def _on_gloo(rank, world_size):
    return pairwise.runs_pairwise(dist.group.WORLD, torch.device("cpu"))


def test_used_on_gloo_on_cpu(ranks):
    assert all(ranks(2).run(_on_gloo, timeout_s=60))


def _collectives_called(rank, world_size):
    from c10d_calls import RecordedCollectives

    torch.set_num_threads(1)
    send, whole = _spread_values(rank, world_size), torch.empty(world_size * PIECE)
    with RecordedCollectives() as recorded:
        pairwise.reduce_scatter(send, PIECE, dist.group.WORLD).wait()
        pairwise.all_gather(whole, send[:PIECE].clone(), dist.group.WORLD).wait()
    return recorded.calls


def test_at_two_ranks_each_is_one_exchange_not_sends_and_receives(ranks):
    """One all-to-all runs on Gloo's worker thread like any collective (half the CPU of the
    all-reduce in a real step); sends and receives are posted one by one from the caller."""
    for calls in ranks(2).run(_collectives_called, timeout_s=60):
        assert calls == ["alltoall_base_", "alltoall_base_"], calls
    for calls in ranks(3).run(_collectives_called, timeout_s=60):
        assert "alltoall_base_" not in calls and calls.count("send") == 4, calls


def _in_a_group_of_two(rank, world_size):
    torch.set_num_threads(1)
    pair = dist.new_group([1, 2])  # every rank takes part in making it
    if rank == 0:
        return None
    me = dist.get_rank(pair)
    send = torch.arange(2 * PIECE, dtype=torch.float32) * (rank + 1)
    summed = pairwise.reduce_scatter(send, PIECE, pair).wait()
    whole = torch.empty(2 * PIECE)
    pairwise.all_gather(whole, torch.full((PIECE,), float(rank)), pair).wait()
    return summed, send[me * PIECE: (me + 1) * PIECE] * 5 / (rank + 1), whole


def test_the_exchange_works_in_a_group_of_two_out_of_three(ranks):
    """Ranks 1 and 2 of three: the group's own ranks (0 and 1) choose what is sent, not the global ones."""
    for result in ranks(3).run(_in_a_group_of_two, timeout_s=60)[1:]:
        summed, expected, whole = result
        assert torch.equal(summed, expected)  # (rank 1's x2) + (rank 2's x3) = x5
        assert torch.equal(whole, torch.cat([torch.full((PIECE,), 1.0), torch.full((PIECE,), 2.0)]))
