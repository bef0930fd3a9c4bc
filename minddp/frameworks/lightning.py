"""Lightning with MiniDDP: ``Trainer(strategy=MiniDDPStrategy())`` (``MiniDDPStrategy(start_method="spawn")``
for ``ddp_spawn``), with the arguments ``DDPStrategy`` takes, the DDP ones passed on to MiniDDP.

Lightning's ``DDPStrategy`` builds torch's DDP in ``_setup_model`` and, in five places, does
DDP-specific work only ``if isinstance(model, DistributedDataParallel)``: its manual optimization
(``pre_backward``, ``post_backward``, the forward redirection that lowers
``require_backward_grad_sync`` during the forward), its comm hook (on CUDA) and ``teardown``.
This subclass builds a MiniDDP and does the same work for it, with Lightning's own helpers.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook, prepare_for_backward
from pytorch_lightning.strategies.ddp import DDPStrategy, _DDPForwardRedirection
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module

from minddp.ddp.wrapper import MiniDDP

__all__ = ["MiniDDPStrategy"]


class _MiniDDPForwardRedirection(_DDPForwardRedirection):
    """Under manual optimization, the sync flag is lowered inside the forward and raised after it
    (MiniDDP reads it at the end of the forward, as torch's DDP does)."""

    def on_after_inner_forward(self, wrapper_module: Module, original_module: Any) -> None:
        if isinstance(wrapper_module, MiniDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: Module, original_module: Any) -> None:
        if isinstance(wrapper_module, MiniDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


class MiniDDPStrategy(DDPStrategy):
    strategy_name = "minddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_redirection = _MiniDDPForwardRedirection()

    def _setup_model(self, model: Module) -> MiniDDP:
        return MiniDDP(model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":  # as DDPStrategy: comm hooks on CUDA only
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)

    def pre_backward(self, closure_loss: Tensor) -> None:
        if isinstance(self.model, MiniDDP) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)  # arms the reducer, as for torch's DDP

    def post_backward(self, closure_loss: Tensor) -> None:
        model, module = self.model, self.lightning_module
        if (isinstance(model, MiniDDP) and module is not None and not module.automatic_optimization
                and model.static_graph and not getattr(self, "_pl_static_graph_delay_done", False)):
            model.reducer._delay_all_reduce()
            self._pl_static_graph_delay_done = True

    def teardown(self) -> None:
        if isinstance(self.model, MiniDDP):
            if not self.model.static_graph and self.model._get_ddp_logging_data().get("can_set_static_graph"):
                rank_zero_info("Your model can run with static graph optimizations: pass "
                               "`MiniDDPStrategy(static_graph=True)` to enable them.")
            self.model = self.lightning_module  # unwrap, as DDPStrategy does
        super().teardown()
