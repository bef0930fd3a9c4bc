"""Checkpoints of a fully sharded model: full (loads into an unsharded model) and sharded (any world size).

* ``full_state_dict(model, rank0_only=True)`` gives rank 0 the whole model,
  which an unsharded GPT loads and then computes the same loss with, to the bit;
* ``save_sharded`` on 2 ranks, ``load_sharded`` on 3, saved again there and
  loaded back on 2: training then continues bit for bit as if nothing had
  happened (parameters and AdamW's moments and step count, each element
  copied, never recomputed).
"""

import torch

from minddp.fsdp import full_state_dict, load_full_state_dict, load_sharded, save_sharded

from test_fsdp import gpt, micro_batches, shard_gpt

STEPS_BEFORE, STEPS_AFTER = 2, 2


def _rank_batch(step, rank, world_size):
    return micro_batches(step, world_size, {}, rank)[0]


def _full_on_rank0(rank, world_size):
    torch.set_num_threads(1)
    model = shard_gpt(gpt())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = _rank_batch(0, rank, world_size)
    model(x, y).backward()
    opt.step()
    state = full_state_dict(model, rank0_only=True)
    with torch.no_grad():
        sharded_loss = model(x, y).item()  # a collective: every rank runs it
    if rank != 0:
        return state, None
    plain = gpt(seed=1)
    plain.load_state_dict(state)
    with torch.no_grad():
        return {k: v.shape for k, v in state.items()}, (plain(x, y).item(), sharded_loss)


def test_full_state_dict_on_rank0_loads_into_an_unsharded_model(ranks):
    (shapes, (plain_loss, sharded_loss)), (other, _) = ranks(2).run(_full_on_rank0, timeout_s=60)
    assert shapes == {k: v.shape for k, v in gpt().state_dict().items()}
    assert other == {}
    assert plain_loss == sharded_loss


def _train(model, opt, steps, rank, world_size, first_step):
    for step in range(first_step, first_step + steps):
        x, y = _rank_batch(step, rank, world_size)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()


def _fresh(lr=0.01):
    model = shard_gpt(gpt(seed=7))  # other initial values: everything must come from the checkpoint
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _save_after_training(rank, world_size, directory):
    torch.set_num_threads(1)
    model = shard_gpt(gpt())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, STEPS_BEFORE, rank, world_size, 0)
    save_sharded(model, opt, directory)
    _train(model, opt, STEPS_AFTER, rank, world_size, STEPS_BEFORE)
    return full_state_dict(model)


def _reshard(rank, world_size, source, target):
    torch.set_num_threads(1)
    model, opt = _fresh()
    load_sharded(model, opt, source)
    save_sharded(model, opt, target)
    return full_state_dict(model)


def _resume(rank, world_size, directory):
    torch.set_num_threads(1)
    model, opt = _fresh()
    load_sharded(model, opt, directory)
    _train(model, opt, STEPS_AFTER, rank, world_size, STEPS_BEFORE)
    return full_state_dict(model)


def test_sharded_checkpoint_moves_to_3_ranks_and_back_bit_for_bit(ranks, tmp_path):
    on_two, on_three = str(tmp_path / "two"), str(tmp_path / "three")
    uninterrupted = ranks(2).run(_save_after_training, on_two, timeout_s=60)[0]
    at_save = ranks(3).run(_reshard, on_two, on_three, timeout_s=60)
    resumed = ranks(2).run(_resume, on_three, timeout_s=60)[0]
    reference = gpt()
    assert at_save[0].keys() == reference.state_dict().keys()
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


def _load_full(rank, world_size, state):
    torch.set_num_threads(1)
    model, _ = _fresh()
    load_full_state_dict(model, state)
    return full_state_dict(model)


def test_load_full_state_dict_puts_each_piece_in_place(ranks):
    state = gpt(seed=3).state_dict()
    for back in ranks(3).run(_load_full, state, timeout_s=60):
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)
