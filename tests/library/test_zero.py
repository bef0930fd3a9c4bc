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
            if clip:  # the norm is summed over shards, not per tensor: another rounding of the same sum
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(p, q), f"step {step} {name}: differs from torch's ZeroRedundancyOptimizer"
        assert_close_to_reference(mine.module, reference, f"step {step}")
    assert torch.equal(mine.module.frozen.weight, build(0).frozen.weight), "a frozen parameter moved"
    return my_opt.param_groups[0]["lr"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_stage1_equals_torch_zero_and_one_process(ranks, world_size, opt_name):
    lrs = ranks(world_size).run(_stage1_vs_torch, opt_name, "flat", False, timeout_s=120)
    assert lrs[0] == pytest.approx(optimizer_args(opt_name)[1]["lr"] / (1 + STEPS))  # the scheduler was seen


def _standalone_under_join(rank, world_size, opt_name):
    """No wrapper: the optimizer averages (reduce-scatter); rank r has r + 2 batches, under join()."""
    from torch.distributed.algorithms.join import Join

    cls, kw = optimizer_args(opt_name)
    reference = build(0)
    model = build(0)
    ref_opt = cls(groups(reference), **kw)
    opt = ZeroRedundancyOptimizer(groups(model), cls, **kw)
    batches = [r + 2 for r in range(world_size)]
    with Join([opt]):
        for step in range(batches[rank]):
            x, y = batch(step, PER_RANK * world_size)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            opt.zero_grad()
            loss_of(model, x[mine], y[mine]).backward()
            opt.step()
    # The reference: the ranks still in at each step, divided by the initial world size (torch's default).
    for step in range(max(batches)):
        x, y = batch(step, PER_RANK * world_size)
        ref_opt.zero_grad()
        active = [r for r in range(world_size) if batches[r] > step]
        loss = sum(loss_of(reference, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK])
                   for r in active) / world_size
        loss.backward()
        ref_opt.step()
    assert_close_to_reference(model, reference, "after join")


def under_join(rank, world_size, shard_gradients):
    """MiniDDP, rank r has r + 2 batches; a rank out of data still steps and sends its shard (join's hooks)."""
    from torch.distributed.algorithms.join import Join

    cls, kw = optimizer_args("adamw")
    reference = build(0)
    model = MiniDDP(build(rank), bucket_cap_mb=SMALL_CAP_MB)
    ref_opt = cls(groups(reference), **kw)
    opt = ZeroRedundancyOptimizer(groups(model.module), cls, ddp=model, shard_gradients=shard_gradients, **kw)
    batches = [r + 2 for r in range(world_size)]
    with Join([model, opt], divide_by_initial_world_size=True):
        for step in range(batches[rank]):
            x, y = batch(step, PER_RANK * world_size)
            opt.zero_grad()
            loss_of(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
    for step in range(max(batches)):
        x, y = batch(step, PER_RANK * world_size)
        ref_opt.zero_grad()
        active = [r for r in range(world_size) if batches[r] > step]
        sum(loss_of(reference, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK])
            for r in active).div(world_size).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
    assert_close_to_reference(model.module, reference, "after join")


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage1_on_minddp_uneven_inputs_under_join(ranks, world_size):
    ranks(world_size).run(under_join, False, timeout_s=120)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage1_without_wrapper_uneven_inputs_under_join(ranks, world_size):
    ranks(world_size).run(_standalone_under_join, "adamw", timeout_s=120)


class BigEmbedding(torch.nn.Module):
    """The largest tensor is most of the parameters (an LM's vocabulary)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 16)  # 16,000 of 16,560
        self.fc = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, tokens):
        return self.out(torch.relu(self.fc(self.emb(tokens)))).mean()


def _state_bytes_per_rank(rank, world_size, partition):
    from minddp.zero.memory import optimizer_state_bytes

    torch.manual_seed(0)
    model = BigEmbedding()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition=partition, lr=1e-3)
    model(torch.arange(8).view(2, 4)).backward()
    opt.step()
    plain = torch.optim.AdamW(BigEmbedding().parameters(), lr=1e-3)
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    plain.step()
    return optimizer_state_bytes(opt), optimizer_state_bytes(plain), max(u.piece for u in opt.layout.units)


@pytest.mark.parametrize("world_size", [2, 3])
def test_flat_partition_stays_even_where_greedy_does_not(ranks, world_size):
    flat = ranks(world_size).run(_state_bytes_per_rank, "flat", timeout_s=60)
    greedy = ranks(world_size).run(_state_bytes_per_rank, "greedy", timeout_s=60)
    unsharded = flat[0][1]
    for mine, _, piece in flat:  # AdamW: exp_avg + exp_avg_sq, 4 bytes each, per element; step is a scalar
        assert mine <= unsharded / world_size + 2 * 4 * world_size + 64, (mine, unsharded)
    heaviest = max(b for b, _, _ in greedy)
    assert heaviest > 0.9 * unsharded, "greedy: the embedding's rank holds nearly all the state"


def _add_param_group(rank, world_size):
    """Start with one group, add the other after a step; equals torch's ZeRO doing the same."""
    kw = {"lr": 0.01}
    mine, theirs = MiniDDP(build(rank)), MiniDDP(build(rank))
    g_mine, g_theirs = groups(mine.module), groups(theirs.module)
    my_opt = ZeroRedundancyOptimizer(g_mine[0]["params"], torch.optim.AdamW, ddp=mine, **kw)
    their_opt = TorchZero(g_theirs[0]["params"], torch.optim.AdamW, **kw)
    for step in range(3):
        if step == 1:
            my_opt.add_param_group(g_mine[1])
            their_opt.add_param_group(g_theirs[1])
        x, y = batch(step, PER_RANK * world_size)
        for model, opt in ((mine, my_opt), (theirs, their_opt)):
            opt.zero_grad()
            loss_of(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
            opt.step()
        for (name, p), q in zip(mine.module.named_parameters(), theirs.module.parameters()):
            assert torch.equal(p, q), f"step {step} {name}"


def test_add_param_group_equals_torch_zero(ranks):
    ranks(2).run(_add_param_group, timeout_s=60)


@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_equals_one_process(ranks, world_size):
    ranks(world_size).run(_stage1_vs_torch, "adamw", "greedy", True, timeout_s=120)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_greedy_partition_equals_torch_zero(ranks, opt_name):
    ranks(3).run(_stage1_vs_torch, opt_name, "greedy", False, timeout_s=120)


def _closure(rank, world_size):
    mine, theirs = MiniDDP(build(rank)), MiniDDP(build(rank))
    my_opt = ZeroRedundancyOptimizer(mine.parameters(), torch.optim.SGD, ddp=mine, lr=0.1)
    their_opt = TorchZero(theirs.parameters(), torch.optim.SGD, lr=0.1)
    x, y = batch(0, PER_RANK * world_size)
    x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
    losses = []
    for model, opt in ((mine, my_opt), (theirs, their_opt)):
        def closure(model=model, opt=opt):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            return loss
        losses.append(opt.step(closure).item())
    assert losses[0] == losses[1]
    for p, q in zip(mine.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def test_step_with_a_closure(ranks):
    ranks(2).run(_closure, timeout_s=60)


def test_partitions_without_a_process_group():
    from minddp.zero.partition import flat_units, greedy_units

    tensors = [torch.zeros(1000, 16), torch.zeros(32, 16), torch.zeros(32), torch.zeros(7)]
    (unit,) = flat_units(tensors, 3)
    sizes = [end - start for start, end in unit.ranges]
    assert sum(sizes) == unit.numel == 16551 and max(sizes) - min(sizes) <= 3 - 1
    covered = [s for r in range(3) for s in unit.segments(r)]
    assert sum(s.length for s in covered) == unit.numel  # every element owned once
    assert len(unit.segments(0)) == 1 and unit.segments(0)[0].param is tensors[0]  # a tensor may span ranks
    (greedy,) = greedy_units(tensors, 3, [0, 0, 0])
    sizes = sorted(end - start for start, end in greedy.ranges)
    assert sizes == [32 + 7, 32 * 16, 16000]  # whole tensors: the embedding's rank holds 97%
