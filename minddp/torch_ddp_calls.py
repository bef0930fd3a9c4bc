"""torch's DDP names, beyond its documented API, that frameworks and torch's own tests call on the model.

A base class of :class:`~minddp.ddp.MiniDDP` (methods and read-only
properties on its own state; ``docs/frameworks.md`` lists who calls each):

* ``_get_ddp_logging_data()``: torch's dictionary of what the model is and
  did, for what minddp knows, recorded when torch records it
  (``num_buckets_reduced``: the count of the backward before the last
  synchronized forward; torch samples it after its tenth iteration, MiniDDP
  records it at every one). The keys it has no value for (torch's timings,
  ``bucket_sizes`` of its construction-time buckets, ``can_set_static_graph``,
  its NCCL settings) are absent, as in torch before they are known, so
  ``.get(key)`` answers None. Lightning reads it after every ``fit``.
* ``bucket_bytes_cap``, ``bucket_bytes_cap_list``, ``bucket_bytes_cap_default``:
  the caps in bytes, as torch names them.
* ``_set_params_and_buffers_to_ignore_for_model``, ``_register_builtin_comm_hook``.

(What frameworks call on the reducer: :mod:`minddp.torch_reducer_calls`.)
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from minddp.bucket_assignment import MiB
from minddp.comm_hooks import builtin_comm_hook

__all__ = ["TorchDDPCalls", "ddp_logging_data"]


class TorchDDPCalls:
    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        return ddp_logging_data(self)

    @property
    def bucket_bytes_cap(self) -> int:
        return int((25.0 if self.bucket_cap_mb == "auto" else self.bucket_cap_mb) * MiB)

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        return [int(cap * MiB) for cap in self.bucket_cap_mb_list or ()]

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """Is the first bucket smaller than the others (no cap given)?"""
        return self._first_bucket_cap_mb * MiB < self.bucket_bytes_cap

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]) -> None:
        """Leave these parameters and buffers (by name) out of MiniDDP, before wrapping ``module``: not
        broadcast, not averaged, no hook. For state a library keeps in sync itself (e.g. a sharded
        embedding table). torch's DDP's method of the same (private) name, which such libraries call."""
        module._ddp_params_and_buffers_to_ignore = list(names)

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch's built-in hooks by name, under torch's (private) method name: ``ALLREDUCE`` or ``FP16_COMPRESS``."""
        self.register_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type))


def ddp_logging_data(ddp) -> dict[str, int | str]:
    params = ddp.reducer.params
    data: dict[str, int | str] = {
        "world_size": ddp.world_size,
        "rank": dist.get_rank(ddp.process_group),
        "module_name": type(ddp.module).__name__,
        "device_ids": ",".join(str(i) for i in ddp.device_ids or ()),
        "output_device": ddp.device_ids[0] if ddp.device_ids else -1,
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "backend_name": dist.get_backend(ddp.process_group),
        "has_sync_bn": int(any(type(m).__name__ == "SyncBatchNorm" for m in ddp.module.modules())),
        "is_multi_device_module": int(len({p.device for p in params}) > 1),
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
        "master_port": os.environ.get("MASTER_PORT", "N/A"),
    }
    if ddp.reducer.buckets_reduced_logged is not None:  # recorded at a synchronized forward, as torch's
        data["num_buckets_reduced"] = ddp.reducer.buckets_reduced_logged
    return data
