"""Misuse of fully_shard fails at once, on every rank, with a message naming the culprit.

Each case runs on 2 ranks and returns the message (so the pool is not
restarted); the ranks raise the same error, none is left waiting.
"""

import pytest
import torch
from torch import nn

from minddp import MiniDDP
from minddp.fsdp import fully_shard
from minddp_lab.models import GPT, GPTConfig

from test_fsdp import gpt, micro_batches, shard_gpt


def _message(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _wrapped_by_miniddp(rank, world_size):
    return _message(lambda: fully_shard(MiniDDP(nn.Linear(4, 4))))


def _parent_before_child(rank, world_size):
    model = gpt()
    fully_shard(model)
    return _message(lambda: fully_shard(model.blocks[0]))


def _twice(rank, world_size):
    block = fully_shard(nn.Linear(4, 4))
    return _message(lambda: fully_shard(block))


def _optimizer_built_before(rank, world_size):
    model = gpt()
    opt = torch.optim.AdamW(model.parameters())
    shard_gpt(model)
    x, y = micro_batches(0, world_size, {}, rank)[0]
    model(x, y).backward()
    return _message(opt.step)


def _tied_outside_every_unit(rank, world_size):
    model = gpt()
    fully_shard(model.wte)  # the head, tied to it, is in no unit: it still holds the original weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = micro_batches(0, world_size, {}, rank)[0]
    model(x, y).backward()
    return _message(opt.step)


def _different_models(rank, world_size):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16 if rank == 0 else 32))
    return _message(lambda: fully_shard(model.blocks[0]))


CASES = {
    "wrapped by MiniDDP": (_wrapped_by_miniddp, ["TypeError", "MiniDDP", "already wrapped"]),
    "parent before child": (_parent_before_child, ["ValueError", "'ln_1.weight'", "inner modules before outer"]),
    "sharded twice": (_twice, ["ValueError", "already sharded"]),
    "optimizer built before": (_optimizer_built_before, ["AdamW", "'wte.weight' of fully_shard(GPT", "Build the optimizer after"]),
    "tied outside every unit": (_tied_outside_every_unit, ["SGD", "'weight' of fully_shard(Embedding: weight)", "tied"]),
    "different models": (_different_models, ["rank 1 has a different model", "ln_1.weight"]),
}


@pytest.mark.parametrize("case", CASES)
def test_misuse_names_the_culprit(ranks, case):
    fn, words = CASES[case]
    for message in ranks(2).run(fn, timeout_s=60):
        for word in words:
            assert word in message, message

