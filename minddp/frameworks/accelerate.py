"""accelerate (and transformers' Trainer, built on it) with MiniDDP: ``use_minddp()`` at the top of the
training script, before ``accelerator.prepare`` / ``Trainer(...)``.

accelerate builds its DDP model as ``torch.nn.parallel.DistributedDataParallel(model, ...)`` and
recognises it with ``isinstance(model, torch.nn.parallel.DistributedDataParallel)``, reading that
attribute at each use (``accelerate/accelerator.py``, ``accelerate/utils/other.py``). So the least
intrusive swap is that one attribute, in each process: accelerate then builds a MiniDDP with the
arguments of ``DistributedDataParallelKwargs``, and its ``no_sync``, ``trigger_sync_in_backward``,
comm hooks, ``join_uneven_inputs`` and ``unwrap_model`` all reach MiniDDP. torch's own class stays
where torch's modules import it from (``torch.nn.parallel.distributed``).

Code that took torch's class by name before the swap, or from ``torch.nn.parallel.distributed``
(Lightning's ``DDPStrategy``, Fabric's), still builds torch's DDP: the swap cannot reach it. That would
train with torch's DDP while the user believes MiniDDP runs, so while the swap is on, building torch's
class raises, naming the code that did and the way to MiniDDP from there (:func:`_refuse_torchs_class`).
"""

from __future__ import annotations

import sys

import torch
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from minddp.ddp.wrapper import MiniDDP

__all__ = ["use_minddp", "use_torch_ddp"]

_TORCH_INIT = TorchDDP.__init__

# Where the swap cannot reach, the way in: (module prefix, what to use there)
_DOORS = (
    (("lightning_fabric", "lightning.fabric"),
     "use Fabric(strategy=MiniDDPStrategy()) with minddp.frameworks.fabric.MiniDDPStrategy"),
    (("pytorch_lightning", "lightning.pytorch"),
     "use Trainer(strategy=MiniDDPStrategy()) with minddp.frameworks.lightning.MiniDDPStrategy"),
)


def use_minddp() -> None:
    """From now on, in this process, ``torch.nn.parallel.DistributedDataParallel`` is MiniDDP, and building
    torch's class (by a name the swap cannot reach) raises, naming the fix. :func:`use_torch_ddp` undoes both."""
    torch.nn.parallel.DistributedDataParallel = MiniDDP
    TorchDDP.__init__ = _refuse_torchs_class


def use_torch_ddp() -> None:
    """Undo :func:`use_minddp`."""
    torch.nn.parallel.DistributedDataParallel = TorchDDP
    TorchDDP.__init__ = _TORCH_INIT


def _refuse_torchs_class(self: TorchDDP, *args: object, **kwargs: object) -> None:
    caller = _caller_module()
    fix = next((fix for prefixes, fix in _DOORS if caller.startswith(prefixes)),
               f"{caller} holds torch's class by its own name: call use_minddp() before importing it, or build "
               "minddp.MiniDDP there")
    raise RuntimeError(
        f"use_minddp() is on, but {caller} builds torch's DistributedDataParallel, which use_minddp() cannot "
        f"replace there: this model would train with torch's DDP, not MiniDDP. To train with MiniDDP, {fix}; "
        "to train with torch's DDP, call minddp.frameworks.accelerate.use_torch_ddp() first.")


def _caller_module() -> str:
    """The module of the code that called torch's ``DistributedDataParallel(...)`` (past any subclass's
    ``__init__`` in torch itself)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch."):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"
