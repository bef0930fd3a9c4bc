"""minddp.fsdp against torch's own ``fully_shard`` (FSDP2, CPU, Gloo), step by step, bit for bit.

Two ranks, the same seed, the same batches, AdamW on both. Why equal bits:
both gather the same fp32 values, so forward and backward compute the same
numbers; both average two gradients (a division by two is exact and a sum
of two the same in either order); AdamW's step is elementwise, so sharding
by rows (FSDP2) or flat (ours) gives each element the same arithmetic.
Buffers (BatchNorm's running statistics) are not sharded by either: each rank
keeps its own, from its own batch.

Mixed precision too: with the same policy both gather the same fp32 shard
cast to fp16/bf16, compute the same low-precision forward and backward, and
reduce the same gradients in the same dtype (with ``reduce_dtype=None``: in
``param_dtype`` up to torch 2.14, in the parameters' own fp32 from 2.15); what FSDP2 gets against fp32
training (3 AdamW steps: parameters up to 0.03 apart in bf16), we get too,
to the bit.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from minddp.fsdp import MixedPrecisionPolicy, full_state_dict, fully_shard
from minddp_lab.models import GPT, GPTConfig, build_model

STEPS = 3
GPT_CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _gpt(shard, mesh):
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    for block in model.blocks:
        shard(block, mesh=mesh)
    return shard(model, mesh=mesh)


def _cnn(shard, mesh):
    torch.manual_seed(0)
    model = build_model("cnn")  # conv-BN-ReLU x 3, Linear
    for layer in model:
        if isinstance(layer, (nn.Conv2d, nn.BatchNorm2d, nn.Linear)):
            shard(layer, mesh=mesh)
    return shard(model, mesh=mesh)


def _batch(name, step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    if name == "gpt":
        t = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.block_size + 1), generator=g)
        return t[:, :-1], t[:, 1:]
    return torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)


def _loss(name, model, x, y):
    return model(x, y) if name == "gpt" else F.cross_entropy(model(x), y)


def _torch_full_state(model):
    params = {n: p.full_tensor() for n, p in model.named_parameters(remove_duplicate=False)}
    return {n: (params[n] if n in params else v.detach().clone()) for n, v in model.state_dict().items()}


def _train_both(rank, world_size, name, param_dtype=None, reduce_dtype=None, policy_class=MixedPrecisionPolicy):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    build = _gpt if name == "gpt" else _cnn
    ours = build(lambda m, mesh: fully_shard(m, mesh=mesh, mp_policy=policy_class(param_dtype, reduce_dtype)), mesh)
    theirs = build(lambda m, mesh: torch_fully_shard(m, mesh=mesh, mp_policy=TorchPolicy(param_dtype, reduce_dtype)),
                   mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
    differences = []
    for step in range(STEPS):
        x, y = _batch(name, step, rank)
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            _loss(name, model, x, y).backward()
            opt.step()
        mine, peer = full_state_dict(ours), _torch_full_state(theirs)
        assert mine.keys() == peer.keys(), (sorted(mine), sorted(peer))
        differences.append([k for k in peer if not torch.equal(mine[k], peer[k])])
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in ours.parameters())
    return differences


def test_gpt_equals_torch_fully_shard_bit_for_bit(ranks):
    for differences in ranks(2).run(_train_both, "gpt", timeout_s=90):
        assert differences == [[]] * STEPS


def test_cnn_with_batchnorm_equals_torch_fully_shard_bit_for_bit(ranks):
    for differences in ranks(2).run(_train_both, "cnn", timeout_s=90):
        assert differences == [[]] * STEPS


@pytest.mark.parametrize("param_dtype, reduce_dtype, policy_class", [
    (torch.bfloat16, None, MixedPrecisionPolicy), (torch.float16, None, MixedPrecisionPolicy),
    (torch.float16, torch.float32, TorchPolicy)])  # torch's policy object works with ours too
def test_gpt_mixed_precision_equals_torch_fully_shard_bit_for_bit(ranks, param_dtype, reduce_dtype, policy_class):
    for differences in ranks(2).run(_train_both, "gpt", param_dtype, reduce_dtype, policy_class, timeout_s=90):
        assert differences == [[]] * STEPS


def test_reduce_dtype_default_follows_the_installed_torch():
    """With reduce_dtype=None FSDP2 reduced in param_dtype up to torch 2.14 and reduces in the parameters'
    own dtype from 2.15 (the bit-for-bit tests above hold on either only if minddp follows)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    expected = torch.float32 if torch.__version__ >= (2, 15) else torch.bfloat16
    assert policy.communication_dtype(torch.float32) == expected
    assert MixedPrecisionPolicy(torch.bfloat16, torch.float16).communication_dtype(torch.float32) == torch.float16


@pytest.mark.skipif(not hasattr(TorchPolicy, "_resolve_for_param"), reason="param_dtype_override_fn is torch 2.15's")
def test_torch_policy_with_a_per_parameter_override_is_refused_by_name():
    torch_policy = TorchPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: None)
    with pytest.raises(ValueError, match="param_dtype_override_fn"):
        MixedPrecisionPolicy.like(torch_policy)
