"""torch's DDP names, beyond its documented API and the path of a gradient, as MiniDDP answers them.

Frameworks, libraries and torch's own tests call these on a DDP model
(``docs/frameworks.md`` lists who calls each): pickling (``torch.save``,
``copy.deepcopy``), leaving some parameters to the caller, torch's
built-in comm hooks by name, the ``Joinable`` protocol of
``torch.distributed.algorithms.join``, the caps in bytes as torch names
them (``bucket_bytes_cap``, ``bucket_bytes_cap_list``,
``bucket_bytes_cap_default``), and ``_get_ddp_logging_data()``: torch's
dictionary of what the model is and did, for what minddp knows, recorded
when torch records it (``num_buckets_reduced``: the count of the backward
before the last synchronized forward; torch samples it after its tenth
iteration, MiniDDP records it at every one). The keys it has no value for
(torch's timings, ``bucket_sizes`` of its construction-time buckets,
``can_set_static_graph``, its NCCL settings) are absent, as in torch before
they are known, so ``.get(key)`` answers None. Lightning reads it after
every ``fit``. None of them is on the path of a gradient, so they live
here, and :class:`minddp.ddp.wrapper.MiniDDP` names each as one of its methods
(``__getstate__ = torch_ddp_calls.getstate``). (What frameworks call on the
reducer: :mod:`minddp.ddp.torch_reducer_calls`.)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from minddp.ddp.bucket_assignment import MiB
from minddp.ddp.default_hooks import builtin_comm_hook
from minddp.ddp.join import Join

__all__ = ["getstate", "setstate", "ignore_params_and_buffers", "register_builtin_comm_hook", "join",
           "join_process_group", "join_device", "ddp_logging_data", "bucket_bytes_cap", "bucket_bytes_cap_list",
           "bucket_bytes_cap_default"]

# Rebuilt by setstate, never pickled: the process group, the reducer (its hooks are on these very
# parameters) and the parts and policies around it.
NOT_PICKLED = ("process_group", "reducer", "_observer", "bucket_planner", "join_context", "_join_hook",
               "buffer_policy", "_replica_checks", "_profiler_ranges")


def getstate(ddp) -> dict:
    """``MiniDDP.__getstate__``: what ``torch.save`` and ``copy.deepcopy`` keep: the module and the settings,
    not the process group or the reducer; :func:`setstate` builds them again, as torch's DDP does. Only
    with the default process group, the one a loading process can name."""
    if ddp.process_group is not dist.group.WORLD and ddp.process_group != dist.distributed_c10d._get_default_group():
        raise RuntimeError(
            "MiniDDP can be pickled or copied only when it uses the default process group (constructed "
            "without process_group=): a process loading it could not name the group it used")
    state = dict(nn.Module.__getstate__(ddp) if hasattr(nn.Module, "__getstate__") else ddp.__dict__)
    for name in NOT_PICKLED:
        state.pop(name, None)
    return state


def setstate(ddp, state: dict) -> None:
    """``MiniDDP.__setstate__``: the settings back, then the reducer and its parts built again."""
    nn.Module.__setstate__(ddp, state)
    ddp.process_group = dist.group.WORLD
    ddp._build_reducer()


def ignore_params_and_buffers(module: nn.Module, names: list[str]) -> None:
    """Leave these parameters and buffers (by name) out of MiniDDP, before wrapping ``module``: not
    broadcast, not averaged, no hook. For state a library keeps in sync itself (e.g. a sharded
    embedding table). torch's DDP's method of the same (private) name, which such libraries call."""
    module._ddp_params_and_buffers_to_ignore = list(names)


def register_builtin_comm_hook(ddp, comm_hook_type: dist.BuiltinCommHookType) -> None:
    """torch's built-in hooks by name, under torch's (private) method name: ``ALLREDUCE`` or ``FP16_COMPRESS``."""
    ddp.register_comm_hook(ddp.process_group, builtin_comm_hook(comm_hook_type))
    ddp.reducer.communication.name = str(comm_hook_type)  # torch's logging data names a built-in by its type


def join(ddp, divide_by_initial_world_size: bool = True, enable: bool = True,
         throw_on_early_termination: bool = False) -> Join:
    """``with model.join():`` lets ranks with fewer batches finish early (:mod:`minddp.ddp.join`,
    :mod:`minddp.ddp.parts.uneven_inputs`); ``throw_on_early_termination=True``: every rank
    raises as soon as one has run out instead."""
    return Join([ddp], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)


def join_process_group(ddp) -> dist.ProcessGroup:
    """The ranks a ``Join`` exchanges its flags over (the ``Joinable`` protocol)."""
    return ddp.process_group


def join_device(ddp) -> torch.device:
    """Where a ``Join``'s flags live (the ``Joinable`` protocol)."""
    return ddp.device

def bucket_bytes_cap(ddp) -> int:
    """The cap in bytes, as torch names it."""
    return int((25.0 if ddp.bucket_cap_mb == "auto" else ddp.bucket_cap_mb) * MiB)


def bucket_bytes_cap_list(ddp) -> list[int]:
    return [int(cap * MiB) for cap in ddp.bucket_cap_mb_list or ()]


def bucket_bytes_cap_default(ddp) -> bool:
    """Is the first bucket smaller than the others (no cap given)?"""
    return ddp._first_bucket_cap_mb * MiB < bucket_bytes_cap(ddp)


def device_ids(ddp) -> list[int] | None:
    """torch's attribute: ``[the GPU's index]`` when ``device_ids`` was given for a GPU module, else None."""
    return None if ddp._input_device is None or ddp.device.type == "cpu" else [ddp.device.index]


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
    if ddp.reducer.communication.comm_hook is not None:
        data["comm_hook"] = ddp.reducer.communication.name
    return data
