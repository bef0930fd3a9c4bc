"""MiniDDP under the training code people actually write.

Each test takes an idiom from real training scripts (activation
checkpointing, nanoGPT's accumulation flag, sparse embeddings, a zero bucket
cap, a wider reduction dtype) and checks MiniDDP against the project's
oracle: one process on the whole batch, and torch's own DDP on the same data,
after every optimizer step. Every replica starts from a *different* seed, so
nothing matches unless construction broadcast rank 0's weights, and the
training steps change the weights, so "equal after each step" means the
averaged gradients were right.
"""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

from minddp import MiniDDP

PER_RANK = 4
STEPS = 3


def _batch(step, size, features=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, features, generator=g), torch.randn(size, features, generator=g)


def _shard(t, rank):
    return t[rank * PER_RANK : (rank + 1) * PER_RANK]


def _assert_same_parameters(ours, theirs, what, step):
    theirs = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        # float32: the full batch is reduced in one mean, the shards in a mean
        # per rank then a sum; both ways differ by a few ulp.
        torch.testing.assert_close(p, theirs[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {step}, {name} vs {what}: {m}")


def _train_three_ways(rank, world_size, build, step_fn, mini_kwargs=None, torch_kwargs=None, lr=0.1):
    """SGD on the reference (whole batch), MiniDDP and torch's DDP (shards); compare after each step."""
    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(rank)
    mini = MiniDDP(build(), **(mini_kwargs or {}))
    torch.manual_seed(rank)
    native = TorchDDP(build(), **(torch_kwargs if torch_kwargs is not None else mini_kwargs or {}))
    models = {"reference": reference, "minddp": mini, "torch": native}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=lr) for k, m in models.items()}
    for step in range(STEPS):
        for name, model in models.items():
            optimizers[name].zero_grad()
            step_fn(model, step, None if name == "reference" else rank, world_size)
            optimizers[name].step()
        _assert_same_parameters(mini.module, reference, "one process on the whole batch", step)
        _assert_same_parameters(mini.module, native.module, "torch's DDP", step)
    return True


def _mse_step(model, step, rank, world_size):
    x, y = _batch(step, PER_RANK * world_size)
    if rank is not None:
        x, y = _shard(x, rank), _shard(y, rank)
    F.mse_loss(model(x), y).backward()


# ------------------------------------------------------ activation checkpointing
class Chain(nn.Module):
    """An input layer, then three blocks; ``checkpointed`` names the blocks recomputed in backward.

    The input layer makes the first block's input require a gradient, as an
    embedding does in a real model: a reentrant checkpoint whose inputs need
    no gradient computes none for its parameters (torch warns about it).
    """

    def __init__(self, checkpointed=(), reentrant=True, reuse_middle=False):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.a, self.b, self.c = (nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.checkpointed, self.reentrant, self.reuse_middle = set(checkpointed), reentrant, reuse_middle

    def _run(self, name, x):
        block = getattr(self, name)
        if name in self.checkpointed:
            return checkpoint(block, x, use_reentrant=self.reentrant)
        return block(x)

    def forward(self, x):
        x = self._run("a", self.inp(x))
        x = self._run("b", x)
        if self.reuse_middle:
            x = self._run("b", x)
        return self._run("c", x)


PLACEMENTS = {"first": ("a",), "middle": ("b",), "last": ("c",), "every": ("a", "b", "c")}


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_activation_checkpointing_anywhere_matches_one_process_and_torch_ddp(ranks, placement, reentrant):
    # The reentrant checkpoint of the *last* block runs its own backward pass
    # first, nested inside the outer one; an end-of-backward taken at the end
    # of that inner pass would find a's and b's gradients missing.
    build = functools.partial(Chain, PLACEMENTS[placement], reentrant)
    assert ranks(2).run(_train_three_ways, build, _mse_step, {"bucket_cap_mb": 1e-4}) == [True, True]


def test_a_checkpointed_block_used_twice_without_reentrancy(ranks):
    # Non-reentrant checkpointing recomputes inside the outer pass: the block's
    # two uses add up in one .grad, one hook call each, as without checkpoints.
    build = functools.partial(Chain, ("b",), reentrant=False, reuse_middle=True)
    assert ranks(2).run(_train_three_ways, build, _mse_step, {"bucket_cap_mb": 1e-4}) == [True, True]


def test_a_reentrant_block_used_twice_with_static_graph_matches_torch_ddp(ranks):
    # Two nested passes each deliver b's gradient; with static_graph=True
    # (torch's DDP needs it too) the first step counts the hooks and later
    # steps reduce b's gradient at its second hook, when it is complete.
    build = functools.partial(Chain, ("b",), reentrant=True, reuse_middle=True)
    kwargs = {"bucket_cap_mb": 1e-4, "static_graph": True}
    assert ranks(2).run(_train_three_ways, build, _mse_step, kwargs) == [True, True]


def _reentrant_reuse(rank, world_size):
    torch.manual_seed(0)
    mini = MiniDDP(Chain(("b",), reentrant=True, reuse_middle=True))
    x, y = _batch(0, PER_RANK)
    try:
        F.mse_loss(mini(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_reentrant_block_used_twice_is_refused_clearly(ranks):
    # Two nested passes each deliver b's gradient: without static_graph there
    # is no telling which hook is the last; torch's DDP refuses it too. The
    # error must name the parameter.
    for message in ranks(2).run(_reentrant_reuse):
        assert "'b.0.weight' produced a gradient twice" in message or "'b.0.bias' produced a gradient twice" in message


class EveryBlockCheckpointed(nn.Module):
    """Every parameter inside a reentrant checkpoint: each gradient hook fires in a nested pass."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8)

    def forward(self, x):
        return checkpoint(self.b, checkpoint(self.a, x, use_reentrant=True), use_reentrant=True)


def _input_needing_grad_step(model, step, rank, world_size):
    x, y = _batch(step, PER_RANK * world_size)
    if rank is not None:
        x, y = _shard(x, rank), _shard(y, rank)
    # A reentrant checkpoint whose inputs need no gradient computes none for its
    # parameters (torch warns): here the input stands for an embedding's output.
    F.mse_loss(model(x.requires_grad_(True)), y).backward()


@pytest.mark.parametrize("find_unused", [False, True], ids=["static_only", "find_unused"])
def test_static_graph_with_every_parameter_under_reentrant_checkpoints_matches_torch_ddp(ranks, find_unused):
    # The outer pass runs no hook at all: the first backward, which reduces
    # everything at its end, must still see that end (torch's _DDPSink).
    kwargs = {"static_graph": True, "find_unused_parameters": find_unused}
    assert ranks(2).run(_train_three_ways, EveryBlockCheckpointed, _input_needing_grad_step, kwargs) == [True, True]


def _penalty_before_the_first_backward(rank, world_size):
    """A gradient penalty's ``torch.autograd.grad`` (of the input: no parameter's hook fires) before each
    backward of a static graph; the averaged gradients against each rank's own, averaged by hand."""
    x = _shard(_batch(0, PER_RANK * world_size)[0], rank).requires_grad_(True)
    torch.manual_seed(0)
    reference = nn.Linear(8, 8)
    torch.manual_seed(0)
    mini = MiniDDP(nn.Linear(8, 8), static_graph=True)
    for model in (reference, mini):
        for _ in range(2):  # (accumulated: the second backward reduces by the learned counts)
            y = model(x)
            (grad_x,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
            (y.pow(2).sum() + grad_x.pow(2).sum()).backward()
    for p, q in zip(mini.module.parameters(), reference.parameters()):
        torch.distributed.all_reduce(q.grad)
        torch.testing.assert_close(p.grad, q.grad / world_size, rtol=1e-5, atol=1e-6)
    return True


def test_static_graph_learns_from_the_backward_and_not_from_a_gradient_penalty_before_it(ranks):
    # The first backward's output hook fires in the penalty's pass too, where
    # no parameter gets a gradient: that pass must not end the first backward.
    assert ranks(2).run(_penalty_before_the_first_backward) == [True, True]


class CheckpointedWithUnused(Chain):
    def __init__(self):
        super().__init__(("c",), reentrant=True)
        self.never_used = nn.Linear(8, 8)


def _missing_under_checkpoint(rank, world_size):
    mini = MiniDDP(CheckpointedWithUnused())
    x, y = _batch(0, PER_RANK)
    with pytest.raises(RuntimeError) as raised:
        F.mse_loss(mini(x), y).backward()  # raised here, at the end of this backward
    return str(raised.value)


def test_a_parameter_that_really_got_no_gradient_is_still_named_at_the_end_of_backward(ranks):
    for message in ranks(2).run(_missing_under_checkpoint):
        assert "never_used.weight" in message and "find_unused_parameters=True" in message


# ------------------------------------------------ nanoGPT's accumulation flag
class Counter:
    calls = 0


def counting_allreduce_hook(counter, bucket):
    """A comm hook that all-reduces exactly as the default and counts its calls."""
    counter.calls += 1
    world = torch.distributed.get_world_size()
    fut = torch.distributed.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _accumulate(rank, world_size, idiom):
    micro_steps, optimizer_steps = 4, 2
    counts = {}
    models = {}
    for name, wrapper in (("minddp", MiniDDP), ("torch", TorchDDP)):
        torch.manual_seed(rank)
        model = wrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))
        counter = Counter()
        model.register_comm_hook(counter, counting_allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(optimizer_steps):
            for micro in range(micro_steps):
                x, y = _batch(step * micro_steps + micro, PER_RANK * world_size)
                last = micro == micro_steps - 1
                if idiom == "flag":  # nanoGPT: model.require_backward_grad_sync = (micro == last)
                    model.require_backward_grad_sync = last
                    F.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
                else:
                    with contextlib.nullcontext() if last else model.no_sync():
                        F.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
            opt.step()
            opt.zero_grad()
        counts[name], models[name] = counter.calls, model
    _assert_same_parameters(models["minddp"].module, models["torch"].module, "torch's DDP", optimizer_steps)
    return counts


@pytest.mark.parametrize("idiom", ["flag", "no_sync"])
def test_gradient_accumulation_communicates_once_per_optimizer_step(ranks, idiom):
    # One bucket (the model is tiny) and 2 optimizer steps of 4 micro-steps:
    # 2 all-reduces, as torch's DDP issues. Before the flag was honoured,
    # MiniDDP issued 8 and the gradients still came out right.
    for counts in ranks(2).run(_accumulate, idiom):
        assert counts == {"minddp": 2, "torch": 2}


# ----------------------------------------------------------- sparse gradients
class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 8)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))


def _token_step(model, step, rank, world_size):
    g = torch.Generator().manual_seed(7 + step)
    tokens = torch.randint(0, 20, (PER_RANK * world_size, 3), generator=g)
    y = torch.randn(PER_RANK * world_size, 8, generator=g)
    if rank is not None:
        tokens, y = _shard(tokens, rank), _shard(y, rank)
    F.mse_loss(model(tokens), y).backward()
    if isinstance(model, MiniDDP):
        assert model.module.embed.weight.grad.is_sparse  # as torch's DDP leaves it (SparseAdam needs it)


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_sparse_embedding_gradients_are_averaged_like_torch_ddp(ranks, as_view):
    kwargs = {"gradient_as_bucket_view": as_view}
    assert ranks(2).run(_train_three_ways, SparseBag, _token_step, kwargs) == [True, True]


# -------------------------------------------------------------- bucket cap 0
def _zero_cap(rank, world_size):
    torch.manual_seed(0)
    mini = MiniDDP(Chain(), bucket_cap_mb=0)
    mini(torch.randn(4, 8)).sum().backward()  # (before it, one bucket: torch's, until the order is known)
    mini(torch.randn(4, 8))  # the next synchronized forward rebuilds, as torch's
    return len(mini.bucket_names), [len(b) for b in mini.bucket_names]


def test_bucket_cap_zero_means_one_parameter_per_bucket(ranks):
    for count, sizes in ranks(2).run(_zero_cap):
        assert count == 8 and sizes == [1] * 8
    assert ranks(2).run(_train_three_ways, Chain, _mse_step, {"bucket_cap_mb": 0}) == [True, True]
