"""``fully_shard(module)``: torch FSDP2's entry point, on flat units.

Applied to each block, then to the root::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())   # after: it steps the shards

Each call makes one :class:`~minddp.fsdp.unit.ShardedUnit` of the parameters
the module owns directly (those of modules already sharded inside it stay
theirs), replaces them in the modules by this rank's shard, hooks the
module's forward, and turns the module into an :class:`FSDPModule` (its class
gains FSDP2's methods, as FSDP2 does). It returns the module.

A parameter tied to one already sharded elsewhere (an embedding and its
head in different units) is *borrowed*: this unit gathers the owner's unit
before its own forward and backward, and the gradient of both uses lands on
the owner's full parameter, so the owner reduces it once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from minddp.fsdp.checks import REPLACED, check_not_data_parallel, check_same_on_every_rank, watch_optimizers
from minddp.fsdp.policy import MixedPrecisionPolicy
from minddp.fsdp.schedule import Schedule
from minddp.fsdp.unit import Place, ShardedUnit

__all__ = ["FSDPModule", "fully_shard", "is_sharded", "units_of"]

_OWNER = "_minddp_fsdp_owner"  # on an original parameter: (unit, index) of its shard
_SHARD_OF = "_minddp_fsdp_shard_of"  # on a shard parameter: its unit


class FSDPModule:
    """What a module gains from ``fully_shard`` (the names of torch's FSDP2)."""

    _fsdp_unit: ShardedUnit

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the full gradients (accumulating) and reduces nothing, until set back."""
        for unit in (units_of(self) if recurse else [self._fsdp_unit]):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for unit in (units_of(self) if recurse else [self._fsdp_unit]):
            unit.reshard_after_forward = reshard_after_forward

    def set_prefetch(self, enabled: bool) -> None:
        """Start the next unit's all-gather while this one computes (on by default; off to measure it)."""
        self._fsdp_unit.schedule.prefetch = enabled

    def unshard(self) -> None:
        """Gather this unit's full parameters now (they stay until :meth:`reshard`)."""
        self._fsdp_unit.wait_gathered()

    def reshard(self) -> None:
        self._fsdp_unit.free()


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a unit's shard (else: a replicated parameter, whose gradient the caller averages)."""
    return hasattr(param, _SHARD_OF)


def units_of(module: nn.Module) -> list[ShardedUnit]:
    """The units inside ``module`` (itself included), in module order."""
    return [m._fsdp_unit for m in module.modules() if isinstance(m, FSDPModule)]


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), **unsupported) -> nn.Module:
    """Shard ``module``'s own parameters over the ranks of ``mesh`` (a 1-D DeviceMesh or a process group)."""
    for key, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"fully_shard: {key} is not supported by minddp.fsdp")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: this {type(module).__name__} is already sharded")
    check_not_data_parallel(module)
    mp_policy = MixedPrecisionPolicy.like(mp_policy)
    group = _process_group(mesh)
    own, places, borrowed, inner = _parameters_of(module)
    held = [qualname for _, qualname in own[:3]] + (["..."] if len(own) > 3 else [])
    name = f"fully_shard({type(module).__name__}: {', '.join(held) or 'no parameters of its own'})"
    signature = [(qualname, tuple(p.shape), str(p.dtype)) for p, qualname in own]
    signature += [(f"{qualname} (tied)", tuple(p.shape), str(p.dtype)) for _, p, qualname in borrowed]
    device = own[0][0].device if own else torch.device("cpu")
    check_same_on_every_rank(name, signature, group, device)
    _check_one_dtype(name, own)

    unit = ShardedUnit(name, [p for p, _ in own], places, group, mp_policy,
                       on_gradient=lambda u: u.schedule.gradients_done(u),
                       lend_buffer=lambda u: u.schedule.lend_send_buffer(u))
    unit.reshard_after_forward = reshard_after_forward
    unit.is_root = bool(inner)
    unit.schedule = Schedule([unit])
    for inner_module in inner:
        unit.schedule.adopt(inner_module._fsdp_unit.schedule)
    for index, ((original, qualname), where) in enumerate(zip(own, places)):
        for owner_module, attr in where:
            owner_module._parameters[attr] = unit.shard_params[index]
        setattr(original, REPLACED, f"{qualname!r} of {name}")
        setattr(original, _OWNER, (unit, index))
        setattr(unit.shard_params[index], _SHARD_OF, unit)
    for place, original, _ in borrowed:
        lender, index = getattr(original, _OWNER)
        place[0]._parameters[place[1]] = lender.shard_params[index]
        unit.borrowed.append((place, lender, index))
        unit.schedule.adopt(lender.schedule)
    watch_optimizers()

    module._fsdp_unit = unit
    module.register_forward_pre_hook(_before_forward(unit, mp_policy), prepend=True, with_kwargs=True)
    module.register_forward_hook(_after_forward(unit, mp_policy))
    module.__class__ = _fsdp_class(type(module))
    return module


def _process_group(mesh) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: torch.distributed is not initialized (call init_process_group first)")
    if mesh is None:
        return dist.group.WORLD
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(f"fully_shard: mesh must be 1-D (got {mesh.ndim} dimensions); HSDP is not supported")
        return mesh.get_group()
    raise TypeError(f"fully_shard: mesh must be a DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")


def _parameters_of(module: nn.Module):
    """The parameters ``module`` owns directly: ``own`` (distinct), their ``places``, the
    ``borrowed`` ones (tied to an earlier unit) and the sharded modules found ``inner``."""
    own: list[tuple[nn.Parameter, str]] = []
    places: list[list[Place]] = []
    borrowed: list[tuple[Place, nn.Parameter, str]] = []
    inner: list[nn.Module] = []
    index_of: dict[int, int] = {}
    seen: set[int] = set()

    def visit(sub: nn.Module, prefix: str) -> None:
        if id(sub) in seen:
            return
        seen.add(id(sub))
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            qualname = prefix + attr
            if hasattr(p, _SHARD_OF):
                raise ValueError(
                    f"fully_shard({type(module).__name__}): parameter {qualname!r} is already a shard of "
                    f"{getattr(p, _SHARD_OF).name}, a unit around this one or sharing its parameter from "
                    "outside. Apply fully_shard to inner modules before outer ones, and put a parameter "
                    "shared by two modules in the unit of the module sharded first")
            if hasattr(p, REPLACED):
                borrowed.append(((sub, attr), p, qualname))
            elif id(p) in index_of:
                places[index_of[id(p)]].append((sub, attr))
            else:
                index_of[id(p)] = len(own)
                own.append((p, qualname))
                places.append([(sub, attr)])
        for child_name, child in sub._modules.items():
            if child is None:
                continue
            if isinstance(child, FSDPModule):
                inner.append(child)
            else:
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return own, places, borrowed, inner


def _check_one_dtype(name: str, own: list[tuple[nn.Parameter, str]]) -> None:
    for p, qualname in own:
        if p.dtype != own[0][0].dtype or p.device != own[0][0].device:
            raise ValueError(
                f"{name}: parameter {qualname!r} is {p.dtype} on {p.device} but {own[0][1]!r} is "
                f"{own[0][0].dtype} on {own[0][0].device}; one unit holds one dtype on one device")
        if not p.is_floating_point():
            raise ValueError(f"{name}: parameter {qualname!r} is {p.dtype}; only floating-point parameters shard")


def _before_forward(unit: ShardedUnit, policy: MixedPrecisionPolicy):
    cast_to = policy.param_dtype if policy.cast_forward_inputs else None

    def hook(module: nn.Module, args, kwargs):
        unit.schedule.before_forward(unit)
        if cast_to is not None:
            args, kwargs = tree_map(lambda t: _cast(t, cast_to), (args, kwargs))
        return args, kwargs

    return hook


def _after_forward(unit: ShardedUnit, policy: MixedPrecisionPolicy):
    def hook(module: nn.Module, args, output):
        if policy.output_dtype is not None:
            output = tree_map(lambda t: _cast(t, policy.output_dtype), output)
        return unit.schedule.after_forward(unit, output)

    return hook


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]
