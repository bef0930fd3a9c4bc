"""Lightning Fabric with MiniDDP: ``Fabric(strategy=MiniDDPStrategy())`` (``MiniDDPStrategy(start_method="spawn")``
for ``ddp_spawn``), with the arguments Fabric's ``DDPStrategy`` takes, the DDP ones passed on to MiniDDP.

Fabric's ``DDPStrategy`` imported ``DistributedDataParallel`` by name from ``torch.nn.parallel.distributed``
when it was imported, so :func:`minddp.frameworks.accelerate.use_minddp` cannot reach it: it builds torch's
class whatever that function swapped (``use_minddp()`` then refuses, naming this strategy). It uses that name
in three places: ``setup_module`` builds the model, ``get_module_state_dict`` / ``load_module_state_dict``
unwrap it, and ``_DDPBackwardSyncControl.no_backward_sync`` refuses any other wrapper ("Blocking backward sync
is only possible if the module ... is wrapped in `DistributedDataParallel`"). This subclass does the three
for MiniDDP. For the standalone ``lightning_fabric`` and for the unified ``lightning.fabric`` alike
(:mod:`minddp.frameworks.packages`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn import Module

from minddp.ddp.wrapper import MiniDDP
from minddp.frameworks.packages import OnePerPackage, built_on, find_built

__all__ = ["MiniDDPStrategy"]

PACKAGES = ("lightning_fabric", "lightning.fabric")


class MiniDDPStrategy(OnePerPackage):
    """Fabric's ``DDPStrategy`` with a MiniDDP for a model: ``MiniDDPStrategy(**ddp_kwargs)``, or
    ``MiniDDPStrategy(package="lightning.fabric")`` when both Lightning packages are imported."""

    strategy_name = "minddp"
    packages, base = PACKAGES, "strategies.ddp.DDPStrategy"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _NoSyncForMiniDDP(self._backward_sync_control)

    def setup_module(self, module: Module) -> MiniDDP:
        device_ids = self._determine_ddp_device_ids()
        # as Fabric's DDPStrategy: built on a side stream on CUDA (https://pytorch.org/docs/stable/notes/cuda.html#id5)
        with torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext():
            return MiniDDP(module, device_ids=device_ids, **self._ddp_kwargs)

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return super().get_module_state_dict(module.module if isinstance(module, MiniDDP) else module)

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(module.module if isinstance(module, MiniDDP) else module, state_dict,
                                       strict=strict)


class _NoSyncForMiniDDP:
    """Fabric's backward-sync control taking a MiniDDP too: ``fabric.no_backward_sync(model)`` is its
    ``no_sync()``, as for torch's DDP; anything else goes to Fabric's own control (which refuses it)."""

    def __init__(self, fabrics: Any):
        self.fabrics = fabrics

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if enabled and isinstance(module, MiniDDP):
            return module.no_sync()
        return self.fabrics.no_backward_sync(module, enabled)


_BASES = {MiniDDPStrategy: MiniDDPStrategy.base}


def __getattr__(name: str) -> type:
    return find_built(name, _BASES, PACKAGES)
