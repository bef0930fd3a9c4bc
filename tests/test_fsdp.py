"""minddp.fsdp's ``fully_shard`` trains as one process on the whole batch, and as torch's ``fully_shard``.

Oracles, after every step (fp32):

* one process, unsharded model and optimizer, on the concatenated batch:
  to float32 rounding (averaging per-rank means sums in another order than
  one mean over the whole batch: rtol 1e-5, atol 1e-6, as tests/test_zero.py).
  With SGD: the GPT's key bias has a gradient that is zero but for rounding
  (softmax ignores a constant added to every key), and AdamW would turn that
  noise into steps of the learning rate's size;
* torch's FSDP2 (``fully_shard`` over ``init_device_mesh("cpu", (2,))``) on
  2 ranks: bit for bit. Both all-gather the same fp32 values, average two
  gradients (a division by 2 is exact, and a sum of two is in either order
  the same), and AdamW is elementwise, so sharded flat or by rows, each
  element gets the same arithmetic.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minddp.fsdp import fully_shard, full_state_dict
from minddp.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
PER_RANK, STEPS = 2, 3


def gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG.__dict__, **overrides}))


def tokens(step: int, size: int):
    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, CFG.vocab_size, (size, CFG.block_size + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def shard_gpt(model: GPT, **kwargs) -> GPT:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def one_process_run(steps: int, world_size: int, make=gpt):
    """Full states after each step of one process on every rank's batch at once."""
    model = make()
    opt = sgd(model.parameters())
    states = []
    for step in range(steps):
        x, y = tokens(step, PER_RANK * world_size)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def rank_batch(step: int, rank: int, world_size: int):
    x, y = tokens(step, PER_RANK * world_size)
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def _train_gpt(rank, world_size, steps, overrides):
    torch.set_num_threads(1)
    model = shard_gpt(gpt(**overrides))
    opt = sgd(model.parameters())
    states, losses = [], []
    for step in range(steps):
        x, y = rank_batch(step, rank, world_size)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        states.append(full_state_dict(model))
    return states, losses


def assert_states_close(ours, reference, rtol=1e-5, atol=1e-6):
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_gpt_per_block_and_root_equals_one_process(ranks, world_size):
    results = ranks(world_size).run(_train_gpt, STEPS, {}, timeout_s=60)
    reference = one_process_run(STEPS, world_size)
    for states, _ in results:
        for step in range(STEPS):
            assert_states_close(states[step], reference[step])
