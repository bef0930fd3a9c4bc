"""ZeRO stage 1: ``minddp.zero.ZeroRedundancyOptimizer`` against torch's and against one process.

Oracles, after every step:

* torch's ``torch.distributed.optim.ZeroRedundancyOptimizer``, fed the same
  averaged gradients (a second MiniDDP with the same buckets: on 3 ranks
  Gloo's sum order depends on the buffer, so torch's DDP with other buckets
  differs in the last bit): **bit for bit**. The sharded step does the same elementwise
  arithmetic on the same values (SGD and AdamW on CPU run the single-tensor
  kernels elementwise: a flat shard or a parameter tensor, each element gets
  the same operations in the same order, so the same bits);
* one process on the whole batch with the unsharded optimizer: to float32
  rounding, since averaging per-rank means sums in another order than one
  mean over the whole batch (a few ulp per step, which AdamW's division by
  sqrt(v) can amplify on tiny gradients: rtol 1e-5 and an atol of 1e-6).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from minddp import MiniDDP
from minddp.zero import ZeroRedundancyOptimizer

VOCAB, WIDTH, SEQ = 40, 8, 5
PER_RANK = 2
STEPS = 4
SMALL_CAP_MB = 1e-3  # ~1 KB: several buckets


class TinyLM(nn.Module):
    """Embedding tied to the head, a frozen layer, LayerNorm and an MLP: every case in one small model."""

    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens):
        x = self.emb(tokens)
        x = x + self.frozen(x)
        x = x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        return self.head(x)


def build(seed: int, vocab: int = VOCAB) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(vocab)


def batch(step: int, size: int, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def groups(model, wd=0.1):
    """Two groups, different weight decay: matrices decay, vectors do not (nanoGPT's rule)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def optimizer_args(name):
    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 0.01}


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def assert_close_to_reference(model, reference, what):
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {name}: {m}")


def _stage1_vs_torch(rank, world_size, opt_name, partition, clip):
    cls, kw = optimizer_args(opt_name)
    reference = build(0)
    mine = MiniDDP(build(rank), bucket_cap_mb=SMALL_CAP_MB)
    theirs = MiniDDP(build(rank), bucket_cap_mb=SMALL_CAP_MB)  # the same buckets: the same sums
    ref_opt = cls(groups(reference), **kw)
    my_opt = ZeroRedundancyOptimizer(groups(mine.module), cls, ddp=mine, partition=partition, **kw)
    their_opt = TorchZero(groups(theirs.module), cls, **kw)
    scheds = [schedule(o) for o in (ref_opt, my_opt, their_opt)]
    for step in range(STEPS):
        x, y = batch(step, PER_RANK * world_size)
        mine_slice = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for model, opt, full in ((reference, ref_opt, True), (mine, my_opt, False), (theirs, their_opt, False)):
            opt.zero_grad()
            loss_of(model, x if full else x[mine_slice], y if full else y[mine_slice]).backward()
            if clip:
                if opt is my_opt:
                    norm = opt.clip_grad_norm_(0.05)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        for s in scheds:
            s.step()
        for (name, p), q in zip(mine.module.named_parameters(), theirs.module.parameters()):
            assert torch.equal(p, q), f"step {step} {name}: differs from torch's ZeroRedundancyOptimizer"
        assert_close_to_reference(mine.module, reference, f"step {step}")
    assert torch.equal(mine.module.frozen.weight, build(0).frozen.weight), "a frozen parameter moved"
    return my_opt.param_groups[0]["lr"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_stage1_equals_torch_zero_and_one_process(ranks, world_size, opt_name):
    lrs = ranks(world_size).run(_stage1_vs_torch, opt_name, "flat", False, timeout_s=120)
    assert lrs[0] == pytest.approx(optimizer_args(opt_name)[1]["lr"] / (1 + STEPS))  # the scheduler was seen
