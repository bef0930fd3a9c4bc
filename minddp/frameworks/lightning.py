"""Lightning with MiniDDP: ``Trainer(strategy=MiniDDPStrategy())`` (``MiniDDPStrategy(start_method="spawn")``
for ``ddp_spawn``), with the arguments ``DDPStrategy`` takes, the DDP ones passed on to MiniDDP. For
``pytorch_lightning.Trainer`` and for the unified ``lightning.Trainer`` alike: ``MiniDDPStrategy(...)`` is
built on the ``DDPStrategy`` of the package the script imported (:mod:`minddp.frameworks.packages`).

Lightning's ``DDPStrategy`` builds torch's DDP in ``_setup_model`` and, in five places, does
DDP-specific work only ``if isinstance(model, DistributedDataParallel)``: its manual optimization
(``pre_backward``, ``post_backward``, the forward redirection that lowers
``require_backward_grad_sync`` during the forward), its comm hook (on CUDA) and ``teardown``.
This subclass builds a MiniDDP and does the same work for it, with Lightning's own helpers.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from torch import Tensor
from torch.nn import Module

from minddp.ddp.wrapper import MiniDDP
from minddp.frameworks.packages import OnePerPackage, built_on, find_built

__all__ = ["MiniDDPStrategy"]

PACKAGES = ("pytorch_lightning", "lightning.pytorch")


class _MiniDDPForwardRedirection:
    """On the package's ``_DDPForwardRedirection``: under manual optimization, the sync flag is lowered inside
    the forward and raised after it (MiniDDP reads it at the end of the forward, as torch's DDP does)."""

    def on_after_inner_forward(self, wrapper_module: Module, original_module: Any) -> None:
        if isinstance(wrapper_module, MiniDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: Module, original_module: Any) -> None:
        if isinstance(wrapper_module, MiniDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


class MiniDDPStrategy(OnePerPackage):
    """Lightning's ``DDPStrategy`` with a MiniDDP for a model: ``MiniDDPStrategy(**ddp_kwargs)``, or
    ``MiniDDPStrategy(package="lightning.pytorch")`` when both Lightning packages are imported."""

    strategy_name = "minddp"
    packages, base = PACKAGES, "strategies.ddp.DDPStrategy"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        redirection = _MiniDDPForwardRedirection
        self._forward_redirection = built_on(redirection, self.package, _BASES[redirection])()

    def _setup_model(self, model: Module) -> MiniDDP:
        return MiniDDP(model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":  # as DDPStrategy: comm hooks on CUDA only
            register = _lightning(self.package, "overrides.distributed")._register_ddp_comm_hook
            register(model=self.model, ddp_comm_state=self._ddp_comm_state, ddp_comm_hook=self._ddp_comm_hook,
                     ddp_comm_wrapper=self._ddp_comm_wrapper)

    def pre_backward(self, closure_loss: Tensor) -> None:
        if isinstance(self.model, MiniDDP) and not self.lightning_module.automatic_optimization:
            # arms the reducer, as for torch's DDP
            _lightning(self.package, "overrides.distributed").prepare_for_backward(self.model, closure_loss)

    def post_backward(self, closure_loss: Tensor) -> None:
        model, module = self.model, self.lightning_module
        if (isinstance(model, MiniDDP) and module is not None and not module.automatic_optimization
                and model.static_graph and not getattr(self, "_pl_static_graph_delay_done", False)):
            model.reducer._delay_all_reduce()
            self._pl_static_graph_delay_done = True

    def teardown(self) -> None:
        if isinstance(self.model, MiniDDP):
            if not self.model.static_graph and self.model._get_ddp_logging_data().get("can_set_static_graph"):
                _lightning(self.package, "utilities.rank_zero").rank_zero_info(
                    "Your model can run with static graph optimizations: pass `MiniDDPStrategy(static_graph=True)` "
                    "to enable them.")
            self.model = self.lightning_module  # unwrap, as DDPStrategy does
        super().teardown()


def _lightning(package: str, module: str) -> ModuleType:
    return importlib.import_module(f"{package}.{module}")


_BASES = {MiniDDPStrategy: MiniDDPStrategy.base,
          _MiniDDPForwardRedirection: "strategies.ddp._DDPForwardRedirection"}


def __getattr__(name: str) -> type:
    return find_built(name, _BASES, PACKAGES)
