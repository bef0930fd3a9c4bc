"""accelerate with MiniDDP: ``use_minddp()`` at the top of the training script, before ``accelerator.prepare``.

accelerate builds its DDP model as ``torch.nn.parallel.DistributedDataParallel(model, ...)`` and
recognises it with ``isinstance(model, torch.nn.parallel.DistributedDataParallel)``, reading that
attribute at each use (``accelerate/accelerator.py``, ``accelerate/utils/other.py``). So the least
intrusive swap is that one attribute, in each process: accelerate then builds a MiniDDP with the
arguments of ``DistributedDataParallelKwargs``, and its ``no_sync``, ``trigger_sync_in_backward``,
comm hooks, ``join_uneven_inputs`` and ``unwrap_model`` all reach MiniDDP. torch's own class stays
where torch's modules import it from (``torch.nn.parallel.distributed``).
"""

from __future__ import annotations

import torch

from minddp.ddp.wrapper import MiniDDP

__all__ = ["use_minddp", "use_torch_ddp"]

_TORCH_DDP = torch.nn.parallel.DistributedDataParallel


def use_minddp() -> None:
    """From now on, in this process, ``torch.nn.parallel.DistributedDataParallel`` is MiniDDP."""
    torch.nn.parallel.DistributedDataParallel = MiniDDP


def use_torch_ddp() -> None:
    """Undo :func:`use_minddp`."""
    torch.nn.parallel.DistributedDataParallel = _TORCH_DDP
