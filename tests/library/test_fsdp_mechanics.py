"""What fully_shard does to a model, and when it gathers, frees and reduces.

* the module keeps its parameter names, and each name now holds this rank's
  fp32 piece: the pieces of all ranks add up to the model;
* per step a GPT with B blocks sharded per block and at the root issues
  1 + 2B all-gathers (the root once: it stays gathered from its forward into
  its backward; each block in forward and again in backward) and 1 + B
  reduce-scatters, as torch's FSDP2 does (17 and 9 for 8 blocks), and from
  the second step one all-gather fewer (the last block stays gathered); activation
  checkpointing adds none (the recomputed forward finds its unit gathered);
  gradient accumulation with sync off reduces nothing;
* with ``reshard_after_forward=False`` a unit stays gathered from its
  forward to the end of its backward: one all-gather per unit;
* from the second step, a block's all-gather has started before its forward
  (prefetched while the previous block computed);
* between steps, every unit holds only its shard (the full storage is 0 bytes).
"""

import pytest
import torch

from minddp.fsdp import FSDPModule, full_state_dict
from minddp.fsdp.fully_shard import units_of
from minddp.fsdp.unit import UnitState

from test_fsdp import gpt, micro_batches, shard_gpt


def rank_batch(step, rank, world_size):
    return micro_batches(step, world_size, {}, rank)[0]


def _shards(rank, world_size):
    torch.set_num_threads(1)
    reference = gpt()
    model = gpt()
    returned = shard_gpt(model)
    from torch.distributed.tensor import DTensor, Shard

    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    named = {n: (tuple(p.to_local().shape), p.dtype, p.to_local().numel(), tuple(p.shape))
             for n, p in model.named_parameters()}
    full = {n: p.numel() for n, p in reference.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    return returned is model, isinstance(model, FSDPModule), named, (full, shapes)


def test_names_stay_and_each_holds_this_ranks_piece(ranks):
    results = ranks(3).run(_shards, timeout_s=60)
    for same, is_fsdp, named, full in results:
        assert same and is_fsdp
        assert list(named) == list(full[0])
        # Shard(0) as FSDP2: full logical shape, each rank some rows (torch.chunk's), all of its columns
        for name, (local, dtype, _, logical) in named.items():
            assert logical == full[1][name] and dtype == torch.float32
            assert local[1:] == logical[1:]
    for name, numel in results[0][3][0].items():
        assert sum(r[2][name][2] for r in results) == numel, name


def _count_collectives(rank, world_size, checkpoint, accumulate_off, reshard_after_forward=True):
    torch.set_num_threads(1)
    model = shard_gpt(gpt(checkpoint=checkpoint), reshard_after_forward=reshard_after_forward)
    units = units_of(model)
    counts = []
    for step in range(2):
        x, y = rank_batch(step, rank, world_size)
        before = (sum(u.gathers for u in units), sum(u.reduce_scatters for u in units))
        model.set_requires_gradient_sync(not accumulate_off)
        model(x, y).backward()
        counts.append((sum(u.gathers for u in units) - before[0], sum(u.reduce_scatters for u in units) - before[1]))
        assert all(u.state is UnitState.SHARDED and u.full.untyped_storage().nbytes() == 0 for u in units)
        assert all(u.full_params[0].grad is None for u in units) or accumulate_off
    return counts


@pytest.mark.parametrize("checkpoint", [None, "non-reentrant", "reentrant"])
def test_collectives_per_step(ranks, checkpoint):
    """The first step gathers the root once and each block twice (forward, backward), FSDP2's
    count; from the second the last block of the forward stays gathered into its backward
    (which comes next), one all-gather fewer; not under a reentrant checkpoint, whose forward
    runs without autograd (nothing to keep it for: it is recomputed in backward). Each unit is
    reduced once."""
    blocks = 2
    second = 1 + 2 * blocks if checkpoint == "reentrant" else 2 * blocks
    for counts in ranks(2).run(_count_collectives, checkpoint, False, timeout_s=60):
        assert counts == [(1 + 2 * blocks, 1 + blocks), (second, 1 + blocks)]


def test_without_reshard_after_forward_each_unit_is_gathered_once(ranks):
    blocks = 2
    for counts in ranks(2).run(_count_collectives, None, False, False, timeout_s=60):
        assert counts == [(1 + blocks, 1 + blocks)] * 2


def test_accumulating_without_sync_reduces_nothing(ranks):
    for counts in ranks(2).run(_count_collectives, None, True, timeout_s=60):
        assert [reduced for _, reduced in counts] == [0, 0]


def _state_at_forward(rank, world_size):
    torch.set_num_threads(1)
    model = shard_gpt(gpt())
    seen = []
    last = model.blocks[-1]
    last.register_forward_pre_hook(lambda *_: seen.append(last._fsdp_unit.state), prepend=True)
    for step in range(2):
        x, y = rank_batch(step, rank, world_size)
        model(x, y).backward()
    return seen


def test_the_next_block_is_prefetched_from_the_second_step(ranks):
    for seen in ranks(2).run(_state_at_forward, timeout_s=60):
        assert seen[0] is UnitState.SHARDED  # first step: no order known yet
        assert seen[1] in (UnitState.GATHERING, UnitState.GATHERED)


def _in_flight_after_each_unit(rank, world_size):
    torch.set_num_threads(1)
    model = shard_gpt(gpt())
    units = units_of(model)
    schedule = units[0].schedule
    seen = []
    original = schedule.gradients_done

    def counting(unit):
        original(unit)
        seen.append(sum(u.pending is not None for u in units))

    schedule.gradients_done = counting
    x, y = rank_batch(0, rank, world_size)
    model(x, y).backward()
    return seen


def test_one_reduce_scatter_in_flight_at_a_time(ranks):
    """Each launched reduce-scatter holds a full-size send buffer until waited for: waiting
    for the previous one at the next launch keeps one unit's gradient alive, not the model's."""
    for seen in ranks(2).run(_in_flight_after_each_unit, timeout_s=60):
        assert seen == [1, 1, 1]


def _seeded_by_rank(rank, world_size):
    torch.set_num_threads(1)
    model = shard_gpt(gpt(seed=rank))  # a forgotten seed: every rank initialized differently
    return full_state_dict(model)


def test_every_rank_starts_from_rank0s_weights(ranks):
    """As MiniDDP does: a rank that initialized differently would otherwise contribute its own
    pieces, and the sharded model would be a patchwork no rank ever had."""
    expected = gpt(seed=0).state_dict()
    for state in ranks(2).run(_seeded_by_rank, timeout_s=60):
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage held by a live (gc-visible) tensor.

    A DTensor is a wrapper with no storage of its own: its local tensor is counted."""
    import gc

    from torch.distributed.tensor import DTensor

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.device.type == "cpu" \
                and not obj.is_sparse:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _bytes_after_sharding(rank, world_size):
    import time

    torch.set_num_threads(1)
    before = _live_tensor_bytes()
    model = gpt()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_gpt(model)
    # Gloo's worker thread lets go of a finished collective's tensors (rank 0's pieces
    # for the first scatter) a moment after the call returns: look again, up to 10 times.
    for _ in range(10):
        held = _live_tensor_bytes() - before
        if held <= 0.6 * whole:
            break
        time.sleep(0.02)
    return held, whole


def test_after_sharding_a_rank_holds_its_shard_not_the_whole_model(ranks):
    # Not vacuous: the units' layouts kept the original full parameters
    # alive (+4 bytes per parameter on every rank), 1.5 x the model at N = 2.
    for held, whole in ranks(2).run(_bytes_after_sharding):
        assert held <= 0.6 * whole, f"{held} bytes live after sharding a model of {whole}"


def _launches_and_waits(rank, world_size):
    from minddp.fsdp.fully_shard import units_of

    torch.set_num_threads(1)
    model = shard_gpt(gpt())
    events = []

    def recorded(unit, what, method):
        def call(*args):
            record = what != "wait" or unit.pending is not None
            result = method(*args)  # (making room may wait for another unit: that comes first)
            if record:
                events.append(f"{what} {'root' if unit.is_root else 'block'}")
            return result
        return call

    for unit in units_of(model):
        unit._lend_buffer = recorded(unit, "fill", unit._lend_buffer)  # when it takes a send buffer
        unit.start_reduce_scatter = recorded(unit, "launch", unit.start_reduce_scatter)
        unit.finish_reduce_scatter = recorded(unit, "wait", unit.finish_reduce_scatter)
    for step in range(2):
        x, y = rank_batch(step, rank, world_size)
        model(x, y).backward()
    return events


def test_a_reduce_scatter_is_waited_for_before_the_next_unit_fills_its_send_buffer(ranks):
    """Each send buffer is a full unit of gradients, filled as they arrive: waiting for the
    previous reduce-scatter *before* the next block's first gradient goes into a buffer of its
    own keeps one block's alive, not two (the step's memory peak). Not vacuous: waiting at the
    launch instead reads fill, launch, fill, wait, launch. The root's gradients come first (the
    final LayerNorm) and last (the embedding): it fills its buffer at its launch, not before."""
    one_step = ["fill block", "launch block", "wait block", "fill block", "launch block", "wait block",
                "fill root", "launch root", "wait root"]
    for events in ranks(2).run(_launches_and_waits, timeout_s=60):
        assert events == one_step * 2, events


def _collectives_of_one_backward(rank, world_size):
    from c10d_calls import RecordedCollectives

    torch.set_num_threads(1)
    model = shard_gpt(gpt())
    x, y = rank_batch(0, rank, world_size)
    loss = model(x, y)
    with RecordedCollectives() as recorded:
        loss.backward()
    return recorded.calls


def test_on_gloo_a_units_gradients_are_reduced_by_one_exchange_at_two_ranks_one_all_reduce_at_more(ranks):
    """Gloo's reduce_scatter_tensor clones its whole input and all-reduces the clone (torch 2.14).
    At two ranks a unit's halves are exchanged instead (one all-to-all, half the bytes); at three,
    the unit's own send buffer is all-reduced in place: the same all-reduce, without the clone."""
    blocks = 2
    for calls in ranks(2).run(_collectives_of_one_backward, timeout_s=60):
        assert [c for c in calls if "gather" not in c] == ["alltoall_base_"] * (1 + blocks), calls
    for calls in ranks(3).run(_collectives_of_one_backward, timeout_s=60):
        assert [c for c in calls if "gather" not in c] == ["allreduce_"] * (1 + blocks), calls


def _both_reduce_scatters(rank, world_size):
    import torch.distributed as dist

    from minddp.fsdp.collectives import start_reduce_scatter

    torch.set_num_threads(1)
    piece = 1001
    torch.manual_seed(rank)
    send = torch.randn(world_size * piece) * 10.0 ** torch.randint(-3, 4, (world_size * piece,))
    theirs = torch.empty(piece)
    dist.reduce_scatter_tensor(theirs, send.clone())
    ours = start_reduce_scatter(send.clone(), piece, rank, dist.group.WORLD, on_gloo=True)
    real = start_reduce_scatter(send.clone(), piece, rank, dist.group.WORLD, on_gloo=False)
    return theirs, ours.wait(torch.float32), real.wait(torch.float64)


def test_the_gloo_forms_equal_gloos_reduce_scatter_bit_for_bit(ranks):
    """Values over seven decades, so a different summation order would show in the last bits
    (at two ranks there is one order: ``a + b == b + a``)."""
    for world_size in (2, 3):  # the exchange, then the all-reduce in place
        for theirs, ours, real in ranks(world_size).run(_both_reduce_scatters, timeout_s=60):
            assert torch.equal(ours, theirs)
            assert real.dtype == torch.float64 and torch.equal(real, theirs.double())


class _Sandwich(torch.nn.Module):
    """``outer`` used twice, around ``inner``: outer's backward begins, inner's runs whole, outer's ends."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.outer, self.inner = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(self.outer(x))))


def _sandwich(rank, world_size):
    from minddp.fsdp import full_state_dict, fully_shard

    torch.set_num_threads(1)
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    reference = _Sandwich()
    sum(reference(x).pow(2).mean() for x in batches).div(world_size).backward()
    model = _Sandwich()
    fully_shard(model.outer), fully_shard(model.inner), fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(2):  # the second step lends the send buffer with every order known
        optimizer.zero_grad()
        model(batches[rank]).pow(2).mean().backward()
    optimizer.step()
    stepped = full_state_dict(model)
    return {name: (stepped[name], p.detach() - p.grad) for name, p in reference.named_parameters()}


def test_a_unit_whose_backward_begins_inside_anothers_gets_a_send_buffer_of_its_own(ranks):
    """``inner``'s backward runs while ``outer`` (used before and after it) is still filling
    its send buffer: ``inner`` must not be lent that buffer. Not vacuous: lending it makes
    both units' gradients share memory, and ``outer``'s weights move by ``inner``'s."""
    for results in ranks(2).run(_sandwich, timeout_s=60):
        for name, (ours, expected) in results.items():
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6, msg=name)


def _buffers_lent(rank, world_size):
    from minddp.fsdp.fully_shard import units_of

    torch.set_num_threads(1)
    model = shard_gpt(gpt())
    lent = []
    for unit in units_of(model):
        unit._lend_buffer = lambda u, lend=unit._lend_buffer: lent.append(lend(u)) or lent[-1]
    for step in range(2):
        x, y = rank_batch(step, rank, world_size)
        model(x, y).backward()
    return [t.untyped_storage().data_ptr() for t in lent], len(units_of(model))


def test_one_send_buffer_is_lent_to_every_unit_of_a_step(ranks):
    """The same storage, unit after unit (not a fresh one each time: a finished collective's
    tensors may be let go by Gloo's thread a moment late, and two would then be alive)."""
    for pointers, units in ranks(2).run(_buffers_lent, timeout_s=60):
        assert len(pointers) == 2 * units
        assert len(set(pointers[:units])) == 1 and len(set(pointers[units:])) == 1, pointers
