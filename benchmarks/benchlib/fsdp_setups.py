"""The peers of ``fsdp_peers.py``: one GPT, AdamW, six ways to spread it over the ranks.

Each :func:`build` returns a :class:`Setup`: the model to call, the optimizer
to step, and how to read the full parameters back (for the equality check).
Every setup starts from the same weights (seed 0 on every rank) and eats the
same batches, so after the same steps their parameters must agree to
float32 rounding.

========== ==================================================================
torch-ddp  torch's ``DistributedDataParallel``
ddp        ``minddp.MiniDDP``
stage1     ``MiniDDP`` + ``minddp.zero.ZeroRedundancyOptimizer`` (optimizer state sharded)
stage2     the same with ``shard_gradients=True`` (gradients sharded too)
stage3     ``minddp.fsdp.fully_shard`` per block, then the root (everything sharded)
fsdp2      torch's ``fully_shard`` per block, then the root, on ``init_device_mesh("cpu", (N,))``
========== ==================================================================
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from minddp_lab.models import GPT, GPTConfig

SETUPS = ("torch-ddp", "ddp", "stage1", "stage2", "stage3", "fsdp2")
LR = 1e-3


def have_stage3() -> bool:
    """``minddp.fsdp`` is built on its own branch; until it is merged, stage 3 is left out (and said so)."""
    return importlib.util.find_spec("minddp.fsdp") is not None


@dataclass
class Setup:
    name: str
    model: nn.Module  # call model(tokens, targets) -> loss
    optimizer: torch.optim.Optimizer
    full_parameters: Callable[[], dict[str, torch.Tensor]]  # every parameter, unsharded, by its GPT name


def gpt_config(quick: bool) -> GPTConfig:
    return GPTConfig(n_layer=2, n_embd=32) if quick else GPTConfig()


def units(cfg: GPTConfig) -> dict[str, int]:
    """Parameters per ``fully_shard`` unit: each block, and the root (embeddings, final LayerNorm; head tied)."""
    model = GPT(cfg)
    sizes = {f"blocks.{i}": sum(p.numel() for p in b.parameters()) for i, b in enumerate(model.blocks)}
    sizes["root"] = sum(p.numel() for p in model.parameters()) - sum(sizes.values())
    return sizes


def batch(cfg: GPTConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s 4 sequences for ``step``: the same for every setup."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def build(name: str, cfg: GPTConfig) -> Setup:
    torch.manual_seed(0)
    net = GPT(cfg)
    if name in ("torch-ddp", "ddp", "stage1", "stage2"):
        return _replicated(name, net)
    if name == "stage3":
        from minddp.fsdp import full_state_dict, fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        names = [n for n, _ in GPT(cfg).named_parameters()]
        return Setup(name, net, torch.optim.AdamW(net.parameters(), lr=LR),
                     lambda: {n: t for n, t in full_state_dict(net).items() if n in names})
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in net.blocks:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(net, mesh=mesh)
        return Setup(name, net, torch.optim.AdamW(net.parameters(), lr=LR),
                     lambda: {n: p.full_tensor().detach() for n, p in net.named_parameters()})
    raise ValueError(f"unknown setup {name!r}: one of {', '.join(SETUPS)}")


def _replicated(name: str, net: nn.Module) -> Setup:
    if name == "torch-ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
    else:
        from minddp import MiniDDP

        model = MiniDDP(net)
    if name in ("stage1", "stage2"):
        from minddp.zero import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model,
                                                             shard_gradients=name == "stage2", lr=LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return Setup(name, model, opt, lambda: {n: p.detach() for n, p in net.named_parameters()})


def train_step(setup: Setup, cfg: GPTConfig, rank: int, step: int) -> None:
    """zero_grad, forward, backward, step: the whole step, as the memory peak and the timings take it."""
    setup.optimizer.zero_grad(set_to_none=True)
    x, y = batch(cfg, rank, step)
    setup.model(x, y).backward()
    setup.optimizer.step()


@contextlib.contextmanager
def collectives_made_local(on: bool):
    """While on: ``minddp.fsdp``'s units gather by a local copy and reduce by reading their own piece.

    A floor for timing, never a setup to train with (the gradients are wrong): the stage-3 step with no
    communication at all, everything else (hooks, sharded optimizer, freeing) as it is.
    """
    from minddp.fsdp import collectives, unit

    if not on:
        yield
        return

    def gather(full, piece, group=None, async_op=False):
        full.view(-1, piece.numel()).copy_(piece)  # every "rank's" piece is this rank's

    def reduce(send, piece, rank, group, on_gloo):
        return collectives.PendingReduceScatter(None, send, send[rank * piece: (rank + 1) * piece], True)

    saved = unit.all_gather, unit.start_reduce_scatter
    unit.all_gather, unit.start_reduce_scatter = gather, reduce
    try:
        yield
    finally:
        unit.all_gather, unit.start_reduce_scatter = saved
