"""minddp.fsdp's ``fully_shard`` trains a GPT as one process on the whole batch.

Oracle, after every step (fp32): one process, unsharded model and optimizer,
on the concatenated batch, to float32 rounding (averaging per-rank means
sums in another order than one mean over the whole batch: rtol 1e-5, atol
1e-6, as tests/library/test_zero.py). With SGD: the GPT's key bias has a gradient
that is zero but for rounding (softmax ignores a constant added to every
key), and AdamW would turn that noise into steps of the learning rate's
size. (Against torch's ``fully_shard``, bit for bit: tests/library/test_fsdp_torch_peer.py.)

The cases (``VARIANTS``): per block and root; activation checkpointing of
both kinds; the tied embedding and head in different units, either way
round; only Linear and Embedding layers sharded (the course adapter of the
package docstring), also under reentrant checkpoints; frozen parameters; an
unused parameter; a block used twice; gradient accumulation with sync off;
gradient clipping over shards (the norm returned too). On 3 ranks as well
for two of them: pieces of unequal length, a tensor split across ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minddp.fsdp import FSDPModule, MixedPrecisionPolicy, clip_grad_norm_, full_state_dict, fully_shard, is_sharded
from minddp_lab.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
PER_RANK, STEPS = 2, 3


def gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG.__dict__, **overrides}))


def tokens(step: int, size: int):
    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, CFG.vocab_size, (size, CFG.block_size + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def shard_gpt(model: GPT, how: str = "blocks+root", **kwargs) -> GPT:
    if how == "tied-apart":  # embedding and head (one tied weight) in different units
        fully_shard(model.wte, **kwargs)
        fully_shard(model.head, **kwargs)
    if how == "head-apart":  # the head's unit owns the tied weight; the root borrows it for the embedding
        fully_shard(model.head, **kwargs)
    if how == "leaves":  # only Linear and Embedding layers; LayerNorms stay replicated; no root
        return get_fsdp(model)
    if how == "block-linears":  # the first unit backward meets is inside a block (checkpointed)
        for block in model.blocks:
            get_fsdp(block)
        return model
    for block in dict.fromkeys(model.blocks):  # a block used twice is sharded once
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


# The adapter of minddp/fsdp/__init__.py's docstring, as a course's tests would use it.
def get_fsdp(module, compute_dtype=None):
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype)
    for sub in list(module.modules()):
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            fully_shard(sub, mp_policy=policy)
    return module


def fsdp_on_after_backward(model, optimizer):
    for p in model.parameters():
        if p.grad is not None and not is_sharded(p):
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def fsdp_gather_full_params(model):
    return full_state_dict(model)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def build(variant: dict) -> GPT:
    model = gpt(**variant.get("config", {}))
    if variant.get("block_used_twice"):  # one unit, two forwards and two backwards per step
        model.blocks[1] = model.blocks[0]
    if variant.get("unused"):  # the root unit never gets all its gradients: reduced at the end of backward
        model.unused = nn.Linear(4, 4)
    if variant.get("frozen"):
        model.wpe.requires_grad_(False)
        model.blocks[0].fc.requires_grad_(False)
    return model


def micro_batches(step: int, world_size: int, variant: dict, rank: int | None = None):
    """This step's micro-batches (several when accumulating), for one rank or (None) for all."""
    count = variant.get("accumulate", 1)
    out = []
    for micro in range(count):
        x, y = tokens(step * count + micro, PER_RANK * world_size)
        if rank is not None:
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        out.append((x, y))
    return out


def one_process_run(steps: int, world_size: int, variant: dict):
    """Full states (and clipped norms) after each step of one process on every rank's batch at once."""
    model = build(variant)
    opt = sgd(model.parameters())
    states, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        for x, y in micro_batches(step, world_size, variant):
            model(x, y).backward()
        if "clip" in variant:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), variant["clip"]).item())
        opt.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states, norms


def _train_gpt(rank, world_size, steps, variant):
    torch.set_num_threads(1)
    model = shard_gpt(build(variant), variant.get("shard", "blocks+root"))
    opt = sgd(model.parameters())
    states, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        batches = micro_batches(step, world_size, variant, rank)
        for index, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(index == len(batches) - 1) if isinstance(model, FSDPModule) else None
            model(x, y).backward()
        fsdp_on_after_backward(model, opt)  # outside every unit: replicated, averaged here
        if "clip" in variant:
            norms.append(clip_grad_norm_(model, variant["clip"]).item())
        opt.step()
        states.append(fsdp_gather_full_params(model))
    return states, norms


def assert_states_close(ours, reference, rtol=1e-5, atol=1e-6):
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


VARIANTS = {
    "blocks+root": {},
    "checkpoint-non-reentrant": {"config": {"checkpoint": "non-reentrant"}},
    "checkpoint-reentrant": {"config": {"checkpoint": "reentrant"}},
    "tied-apart": {"shard": "tied-apart"},
    "head-apart": {"shard": "head-apart"},
    "leaves-only": {"shard": "leaves"},
    "leaves-only-reentrant": {"shard": "leaves", "config": {"checkpoint": "reentrant"}},
    "block-linears-reentrant": {"shard": "block-linears", "config": {"checkpoint": "reentrant"}},
    "frozen": {"frozen": True},
    "unused-parameter": {"unused": True},
    "block-used-twice": {"block_used_twice": True, "config": {"checkpoint": "non-reentrant"}},
    "accumulate": {"accumulate": 2},
    "clip": {"clip": 0.05},
}


@pytest.mark.parametrize("world_size, variant", [(2, v) for v in VARIANTS] + [(3, "blocks+root"), (3, "tied-apart")])
def test_gpt_equals_one_process(ranks, world_size, variant):
    results = ranks(world_size).run(_train_gpt, STEPS, VARIANTS[variant], timeout_s=60)
    reference, reference_norms = one_process_run(STEPS, world_size, VARIANTS[variant])
    for states, norms in results:
        for step in range(STEPS):
            assert_states_close(states[step], reference[step])
        torch.testing.assert_close(norms, reference_norms, rtol=1e-5, atol=0)
