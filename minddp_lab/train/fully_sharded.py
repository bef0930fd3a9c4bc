"""``--zero 3``: the trainer's model fully sharded with ``minddp.fsdp``, and what changes around it.

Stage 3 replaces the DDP wrapper: every direct child of the model that
holds parameters becomes a ``fully_shard`` unit, then the root (FSDP2's usual
"each block, then the model", with the MNIST models' layers as blocks). The
model's parameters are then this rank's flat shards, and after backward
each shard's ``.grad`` holds its averaged gradient, so plain SGD steps them:
1/N of the momentum, 1/N of the update.

Three things the trainer does with a whole model must then go through the
shards, and :class:`FullyShardedSGD` and the functions here do them:

* **clipping**: the global norm is the square root of the sum, over the
  ranks, of each rank's squared shard norms (one all-reduce; a shard holds
  only real elements, so nothing is counted twice);
* **checkpoints**: ``last.pt`` keeps the whole model and the whole
  optimizer state in torch's format, as under ``--zero 0``: a run resumes on
  another number of ranks or with another ``--zero``. The momentum buffers
  travel the way the weights do: each shard's momentum is put where its
  parameter lives, gathered (or scattered) by ``minddp.fsdp``'s
  ``full_state_dict`` / ``load_full_state_dict``, and the weights put back;
* **evaluation**: every forward of a sharded model is a collective, and the
  held-out split gives ranks unequal numbers of batches (every sample once),
  so the evaluation runs on a whole copy of the model, gathered once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from minddp.fsdp import FSDPModule, clip_grad_norm_, full_state_dict, fully_shard, load_full_state_dict

__all__ = ["shard_model", "is_fully_sharded", "model_state_dict", "whole_copy", "no_gradient_sync",
           "FullyShardedSGD"]


def shard_model(model: nn.Module) -> nn.Module:
    """Each direct child with parameters a unit, then the root; returns ``model``, sharded."""
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    return fully_shard(model)


def is_fully_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict (a collective under stage 3: call it on every rank)."""
    return full_state_dict(model) if is_fully_sharded(model) else model.state_dict()


def whole_copy(model: nn.Module, build: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """An unsharded copy of ``model`` (``build()`` makes an empty one) for collective-free evaluation."""
    if not is_fully_sharded(model):
        return model
    with torch.random.fork_rng(devices=[]):  # its initial weights are thrown away: draw nothing from the run's RNG
        copy = build().to(device)
    copy.load_state_dict(full_state_dict(model))
    return copy


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep the full gradients and reduce nothing (gradient accumulation)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class FullyShardedSGD(torch.optim.SGD):
    """SGD over a sharded model's shards, with the global clipping norm and whole-model checkpoints."""

    def __init__(self, model: nn.Module, **defaults: Any):
        if not is_fully_sharded(model):
            raise TypeError(f"FullyShardedSGD steps a fully_shard'ed model, got a plain {type(model).__name__}")
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        super().__init__(model.parameters(), **defaults)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every shard's gradient so that the norm over all ranks is at most ``max_norm`` (a collective)."""
        return clip_grad_norm_(self.model, max_norm)

    def consolidated_state_dict(self) -> dict[str, Any]:
        """torch's SGD format over the whole parameters, momentum gathered (a collective: every rank)."""
        state = super().state_dict()
        params = list(self.model.parameters())
        momentum = {name: self.state[p].get("momentum_buffer") for name, p in zip(self.names, params)}
        whole = self._through_the_weights(lambda: full_state_dict(self.model), momentum)
        for index, name in enumerate(self.names):
            if momentum[name] is not None:
                state["state"][index] = {"momentum_buffer": whole[name]}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a whole-model SGD state (any ranks, any ``--zero``); keep this rank's piece of each momentum."""
        full = {name: state_dict["state"].get(index, {}).get("momentum_buffer") for index, name in enumerate(self.names)}
        whole = full_state_dict(self.model)  # every name load_full_state_dict asks for (buffers too), shaped
        whole.update({name: m for name, m in full.items() if m is not None})

        def scatter() -> dict[str, torch.Tensor]:
            load_full_state_dict(self.model, whole)  # each rank keeps its piece, in the shards
            return {name: p.detach().clone() for name, p in self.model.named_parameters()}

        pieces = self._through_the_weights(scatter, {})
        mine = {"state": {index: {"momentum_buffer": pieces[name]} for index, name in enumerate(self.names)
                          if full[name] is not None},
                "param_groups": state_dict["param_groups"]}
        super().load_state_dict(mine)

    def _through_the_weights(self, collective: Callable[[], dict], into_shards: dict) -> dict:
        """Put ``into_shards`` (name -> shard tensor) where the weights are, run ``collective``, put the weights back."""
        params = dict(self.model.named_parameters())
        kept = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, value in into_shards.items():
                params[name].copy_(value if value is not None else torch.zeros_like(params[name]))
            try:
                return collective()
            finally:
                for name, p in params.items():
                    p.copy_(kept[name])
