"""What torch's DDP offers beyond its documented API, and what frameworks call on it.

accelerate, Lightning, transformers and torch's own test suites reach past
``DistributedDataParallel``'s documented arguments: they pickle and copy the
model, read its logging data and bucket caps, call private methods on it and
on its C++ reducer (``docs/frameworks.md`` lists who calls each). None of it
is on the path of a gradient, so none of it is in the core: ``MiniDDP``
inherits :class:`TorchSurface`, and its reducer is a :class:`TorchReducer`,
the core's :class:`~minddp.ddp.core.reducer.Reducer` with torch's two private
methods beside it. Each answers with torch's effect, or refuses naming the
call: a framework that calls one expecting work done must never get a silent
nothing.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from minddp.ddp.core.assignment import MiB
from minddp.ddp.core.reducer import Reducer
from minddp.ddp.default_hooks import builtin_comm_hook

__all__ = ["TorchReducer", "TorchSurface", "NOT_PICKLED"]

# Built again by __setstate__, never pickled: the process group, the reducer (its hooks are on these very
# parameters) and the parts and policies around it.
NOT_PICKLED = ("process_group", "reducer", "_observer", "_join_hook", "buffer_policy", "_replica_checks",
               "_profiler_ranges")


class TorchReducer(Reducer):
    """The core's reducer, with the two private methods of torch's C++ reducer that frameworks call."""

    def _rebuild_buckets(self) -> bool:
        """torch's ``reducer._rebuild_buckets()``: rebuild the buckets now if a rebuild is due, and say whether
        it did (True once, after the backward that showed the order, as torch's); first, refuse if the previous
        backward started reducing and never finished (Lightning calls it before each manual backward)."""
        if self.phase.in_backward:
            raise self.missing_gradients_error()
        return self.rebuild_if_due()

    def _delay_all_reduce(self) -> None:
        """torch's ``reducer._delay_all_reduce()``, its static-graph first step: reduce every bucket at the end
        of the first backward (Lightning calls it after a manual backward with ``static_graph=True``). MiniDDP's
        ``static_graph`` does exactly that at the end of its first backward (:mod:`minddp.ddp.parts.static_graph`):
        afterwards there is nothing left to reduce. Anything else is refused."""
        if not self.options.static_graph or not self.backwards_done or self.phase.in_backward:
            raise RuntimeError(
                "MiniDDP's reducer._delay_all_reduce(): only after the first backward of a model constructed "
                "with static_graph=True (whose gradients MiniDDP has then reduced already); here "
                f"static_graph={self.options.static_graph}, {self.backwards_done} backward(s) done")


class TorchSurface:
    """``MiniDDP``'s methods under torch's DDP names beyond its documented API."""

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch's built-in hooks by name, under torch's (private) method name: ``ALLREDUCE`` or ``FP16_COMPRESS``."""
        self.register_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type))
        self.reducer.communication.name = str(comm_hook_type)  # torch's logging data names a built-in by its type

    def __getstate__(self) -> dict:
        """What ``torch.save`` and ``copy.deepcopy`` keep: the module and the settings, not the process group
        or the reducer; :meth:`__setstate__` builds them again, as torch's DDP does. Only with the default
        process group, the one a loading process can name."""
        if self.process_group is not dist.group.WORLD and \
                self.process_group != dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "MiniDDP can be pickled or copied only when it uses the default process group (constructed "
                "without process_group=): a process loading it could not name the group it used")
        state = dict(nn.Module.__getstate__(self) if hasattr(nn.Module, "__getstate__") else self.__dict__)
        for name in NOT_PICKLED:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        """The settings back, then the reducer and its parts built again."""
        nn.Module.__setstate__(self, state)
        self.process_group = dist.group.WORLD
        self._build_reducer()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]) -> None:
        """Leave these parameters and buffers (by name) out of MiniDDP, before wrapping ``module``: not
        broadcast, not averaged, no hook. For state a library keeps in sync itself (e.g. a sharded
        embedding table). torch's DDP's method of the same (private) name, which such libraries call."""
        module._ddp_params_and_buffers_to_ignore = list(names)

    @property
    def bucket_bytes_cap(self) -> int:
        """The cap in bytes, as torch names it."""
        return int(self.bucket_cap_mb * MiB)

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        return [int(cap * MiB) for cap in self.bucket_cap_mb_list or ()]

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """Is the first bucket smaller than the others (no cap given)?"""
        return self._first_bucket_cap_mb * MiB < self.bucket_bytes_cap

    @property
    def device_ids(self) -> list[int] | None:
        """torch's attribute: ``[the GPU's index]`` when ``device_ids`` was given for a GPU module, else None."""
        return None if self._input_device is None or self.device.type == "cpu" else [self.device.index]

    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch's dictionary of what the model is and did, for what MiniDDP knows, recorded when torch records
        it (``num_buckets_reduced``: the count of the backward before the last synchronized forward; torch
        samples it after its tenth iteration, MiniDDP records it at every one). The keys it has no value for
        (torch's timings, ``bucket_sizes`` of its construction-time buckets, ``can_set_static_graph``, its
        NCCL settings) are absent, as in torch before they are known, so ``.get(key)`` answers None.
        Lightning reads it after every ``fit``."""
        params = self.reducer.params
        data: dict[str, int | str] = {
            "world_size": self.world_size,
            "rank": dist.get_rank(self.process_group),
            "module_name": type(self.module).__name__,
            "device_ids": ",".join(str(i) for i in self.device_ids or ()),
            "output_device": self.device_ids[0] if self.device_ids else -1,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "backend_name": dist.get_backend(self.process_group),
            "has_sync_bn": int(any(type(m).__name__ == "SyncBatchNorm" for m in self.module.modules())),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
            "master_port": os.environ.get("MASTER_PORT", "N/A"),
        }
        if self.reducer.buckets_reduced_logged is not None:  # recorded at a synchronized forward, as torch's
            data["num_buckets_reduced"] = self.reducer.buckets_reduced_logged
        if self.reducer.communication.comm_hook is not None:
            data["comm_hook"] = self.reducer.communication.name
        return data
