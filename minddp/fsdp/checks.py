"""Misuse caught early, each with an error that names what is at fault.

* a module already wrapped for data parallelism (MiniDDP or torch's DDP):
  its hooks would all-reduce gradients that no longer exist;
* ranks that built different models: their all-gathers would pair up the
  wrong pieces and train garbage without a word;
* an optimizer built before ``fully_shard``: it holds the original, full
  parameters, which no longer take part in training. ``fully_shard`` flags
  them (:data:`REPLACED`), and a step pre-hook on every torch optimizer
  refuses to step one. The same hook catches a parameter tied to a module
  outside every unit (that module still holds the original).
"""

from __future__ import annotations

import zlib

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
import torch.distributed as dist
from torch import nn

__all__ = ["REPLACED", "check_not_data_parallel", "check_same_on_every_rank", "watch_optimizers"]

REPLACED = "_minddp_fsdp_replaced_by"  # on an original parameter: its name, and the unit now holding it
_watching = False


def check_not_data_parallel(module: nn.Module) -> None:
    from minddp.ddp.wrapper import MiniDDP

    for name, sub in module.named_modules():
        if isinstance(sub, (MiniDDP, nn.parallel.DistributedDataParallel)):
            where = f"its submodule {name!r}" if name else "the module"
            raise TypeError(
                f"fully_shard: {where} is already wrapped by {type(sub).__name__}; shard the plain "
                "module instead (fully sharded data parallel replaces DDP, it does not go inside it)")


def check_same_on_every_rank(unit_name: str, signature: list[tuple[str, tuple[int, ...], str]],
                             group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank must shard the same parameters (names, shapes, dtypes) in this call.

    ``device``: where the parameters live (NCCL only moves CUDA tensors)."""
    digest = torch.tensor([zlib.crc32(repr(signature).encode())], dtype=torch.int64, device=device)
    if dist.get_world_size(group) == 1:
        return
    everyone = [torch.zeros_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, digest, group=group)
    if all(int(d) == int(digest) for d in everyone):
        return
    signatures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, signature, group=group)
    for rank, theirs in enumerate(signatures):
        if theirs != signatures[0]:
            diff = next((f"{a} against {b}" for a, b in zip(signatures[0], theirs) if a != b),
                        f"{len(signatures[0])} parameters against {len(theirs)}")
            raise RuntimeError(
                f"{unit_name}: rank {rank} has a different model from rank 0 "
                f"(rank 0's parameter against rank {rank}'s: {diff}); every rank must build the same model")


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, *_) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            replaced = getattr(p, REPLACED, None)
            if replaced is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the original parameter {replaced}, which fully_shard "
                    f"replaced by this rank's shard (shape {tuple(p.shape)}). Build the optimizer after "
                    "fully_shard, from model.parameters(). (If this parameter is tied to a module outside "
                    "every fully_shard unit, put both users in one unit, e.g. shard their common parent.)")


def watch_optimizers() -> None:
    """Install, once per process, the step pre-hook that refuses replaced parameters."""
    global _watching
    if not _watching:
        register_optimizer_step_pre_hook(_refuse_replaced_parameters)
        _watching = True
