"""What torch's DDP offers beyond the path of a gradient, as MiniDDP answers it.

Frameworks, libraries and torch's own tests call these on a DDP model:
pickling (``torch.save``, ``copy.deepcopy``), leaving some parameters to
the caller, torch's built-in comm hooks by name, and the ``Joinable``
protocol of ``torch.distributed.algorithms.join``. None of them is on the
path of a gradient, so they live here, and :class:`minddp.ddp.MiniDDP`
names each as one of its methods (``__getstate__ = torch_surface.getstate``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minddp.comm_hooks import builtin_comm_hook
from minddp.join import Join

__all__ = ["getstate", "setstate", "ignore_params_and_buffers", "register_builtin_comm_hook",
           "join", "join_process_group", "join_device"]

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


def join(ddp, divide_by_initial_world_size: bool = True, enable: bool = True,
         throw_on_early_termination: bool = False) -> Join:
    """``with model.join():`` lets ranks with fewer batches finish early (:mod:`minddp.join`,
    :mod:`minddp.features.uneven_inputs`); ``throw_on_early_termination=True``: every rank
    raises as soon as one has run out instead."""
    return Join([ddp], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)


def join_process_group(ddp) -> dist.ProcessGroup:
    """The ranks a ``Join`` exchanges its flags over (the ``Joinable`` protocol)."""
    return ddp.process_group


def join_device(ddp) -> torch.device:
    """Where a ``Join``'s flags live (the ``Joinable`` protocol)."""
    return ddp.device
