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

from torch.distributed.device_mesh import DeviceMesh

from minddp.fsdp.checks import REPLACED, check_not_data_parallel, check_same_on_every_rank, watch_optimizers
from minddp.fsdp.policy import MixedPrecisionPolicy
from minddp.fsdp.schedule import Schedule
from minddp.fsdp.unit import SHARD_OF as _SHARD_OF
from minddp.fsdp.unit import Place, ShardedUnit, UnitState

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "is_sharded", "units_of"]

_OWNER = "_minddp_fsdp_owner"  # on an original parameter: (unit, index) of its shard


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

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Right after this unit is gathered for its forward, start gathering ``modules``' units (FSDP2's)."""
        self._fsdp_unit.forward_prefetch = _units_named("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Right after this unit is gathered for its backward, start gathering ``modules``' units (FSDP2's)."""
        self._fsdp_unit.backward_prefetch = _units_named("set_modules_to_backward_prefetch", modules)

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """Gather this unit's full parameters now (they stay until :meth:`reshard`).

        ``async_op=True``: only launch the all-gather and return a handle whose ``wait()`` finishes it
        (the unit's forward waits for it anyway)."""
        if async_op:
            self._fsdp_unit.start_gather()
            return UnshardHandle(self._fsdp_unit)
        self._fsdp_unit.wait_gathered()
        return None

    def reshard(self) -> None:
        self._fsdp_unit.free()

    def _apply(self, fn, recurse: bool = True):
        """``to_empty``, ``.to``, ``.cuda``, ``.half``, ...: materialize a meta unit; refuse a real conversion.

        [Note: Module._apply] Every one of those calls ``Module._apply(fn)``,
        which gives each parameter a new tensor (``param.data = ...`` or
        ``swap_tensors``), cutting it off from the unit's ``shard``. So each
        unit first asks ``fn`` what it would make of its parameters (on an
        empty tensor of their dtype and device) and refuses a change of
        dtype or device, except from meta: then, after ``_apply``, the unit
        builds its shard on the new device and wraps it in fresh DTensors."""
        units = units_of(self) if recurse else [self._fsdp_unit]
        for unit in units:
            _check_conversion(unit, fn)
        result = super()._apply(fn, recurse)
        _take_registered_values(units)
        return result

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"copy.deepcopy / copy.copy / pickle of a fully_shard'ed {type(self).__name__}: not supported by "
            "minddp.fsdp (its parameters are this rank's shards, wired into its units' collectives). Copy "
            "the model before fully_shard, or save its state with "
            "torch.distributed.checkpoint.state_dict.get_model_state_dict")

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)


def _refused(name: str, why: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"FSDPModule.{name}: not supported by minddp.fsdp; {why}")

    method.__name__ = name
    method.__doc__ = f"Refused: {why}"
    return method


_NO_HSDP = "minddp.fsdp shards over a 1-D mesh only (no HSDP, so no all-reduce across replicas)"
for _name, _why in {
    "set_is_last_backward": "every backward reduces and waits for its gradients at its end; "
                            "to accumulate without reducing use set_requires_gradient_sync(False)",
    "set_reshard_after_backward": "every unit is freed after its backward",
    "set_requires_all_reduce": _NO_HSDP,
    "set_all_reduce_hook": _NO_HSDP,
    "set_post_optim_event": "there are no CUDA streams to order here: the all-gather follows the optimizer step",
    "set_reduce_scatter_divide_factor": "gradients are always averaged over the ranks (divided by N)",
    "set_gradient_divide_factor": "gradients are always averaged over the ranks (divided by N)",
    "set_force_sum_reduction_for_comms": "gradients are always averaged over the ranks (divided by N)",
    "set_unshard_in_backward": "a unit is always gathered again for its backward",
    "set_custom_all_gather": "the unit's all-gather is minddp.fsdp.collectives'",
    "set_custom_reduce_scatter": "the unit's reduce-scatter is minddp.fsdp.collectives'",
    "set_allocate_memory_from_process_group_for_comm": "buffers are ordinary torch tensors",
}.items():
    setattr(FSDPModule, _name, _refused(_name, _why))


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather (FSDP2's)."""

    def __init__(self, unit: ShardedUnit):
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_gathered()


def _units_named(method: str, modules) -> list[ShardedUnit]:
    units = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"FSDPModule.{method}: {type(module).__name__} is not fully_shard'ed; pass modules "
                            "that fully_shard was applied to")
        units.append(module._fsdp_unit)
    return units


def _check_conversion(unit: ShardedUnit, fn) -> None:
    probe = fn(torch.empty(0, dtype=unit.master_dtype, device=unit.device))
    if not isinstance(probe, torch.Tensor):
        return
    same = probe.dtype == unit.master_dtype and probe.device == unit.device
    materializing = unit.is_meta and probe.dtype == unit.master_dtype
    if not (same or materializing):
        raise NotImplementedError(
            f"{unit.name}: model.to / .cuda / .cpu / .half / .float / .to_empty (nn.Module._apply) would turn "
            f"its sharded parameters from {unit.master_dtype} on {unit.device} into {probe.dtype} on "
            f"{probe.device}; minddp.fsdp does not move or convert sharded parameters. Move or convert the "
            "model before fully_shard (or build it under torch.device('meta') and call "
            "model.to_empty(device=...) after), and use MixedPrecisionPolicy(param_dtype=...) to compute "
            "in another dtype")


def _take_registered_values(units: list[ShardedUnit]) -> None:
    """After ``_apply`` or ``load_state_dict``: every unit takes what its modules now hold, then re-registers."""
    for unit in units:
        if unit.state is not UnitState.SHARDED:
            raise RuntimeError(f"{unit.name}: converted or loaded while gathered; call model.reshard() first")
        unit.take_values(unit.registered())
    for unit in units:
        unit.register_shards()


def _after_load(module: nn.Module, incompatible_keys) -> None:
    _take_registered_values(units_of(module))


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
    own, places, borrowed, inner = _parameters_of(module)
    device = own[0][0].device if own else None
    mesh = _device_mesh(mesh, device)
    group = mesh.get_group()
    held = [qualname for _, qualname in own[:3]] + (["..."] if len(own) > 3 else [])
    name = f"fully_shard({type(module).__name__}: {', '.join(held) or 'no parameters of its own'})"
    signature = [(qualname, tuple(p.shape), str(p.dtype)) for p, qualname in own]
    signature += [(f"{qualname} (tied)", tuple(p.shape), str(p.dtype)) for _, p, qualname in borrowed]
    check_same_on_every_rank(name, signature, group, torch.device(mesh.device_type))
    _check_one_dtype(name, own)

    unit = ShardedUnit(name, [p for p, _ in own], places, mesh, mp_policy,
                       on_gradient=lambda u: u.schedule.gradients_done(u),
                       lend_buffer=lambda u: u.schedule.lend_send_buffer(u))
    unit.names = [qualname for _, qualname in own]
    unit.reshard_after_forward = reshard_after_forward
    unit.is_root = bool(inner)
    unit.schedule = Schedule([unit])
    for inner_module in inner:
        unit.schedule.adopt(inner_module._fsdp_unit.schedule)
    for index, (original, qualname) in enumerate(own):
        setattr(original, REPLACED, f"{qualname!r} of {name}")
        setattr(original, _OWNER, (unit, index))
    for place, original, _ in borrowed:
        lender, index = getattr(original, _OWNER)
        unit.borrowed.append((place, lender, index))
        unit.schedule.adopt(lender.schedule)
    unit.register_shards()
    watch_optimizers()

    module._fsdp_unit = unit
    module.register_forward_pre_hook(_before_forward(unit, mp_policy), prepend=True, with_kwargs=True)
    module.register_forward_hook(_after_forward(unit, mp_policy))
    module.register_load_state_dict_post_hook(_after_load)
    module.__class__ = _fsdp_class(type(module))
    return module


def _device_mesh(mesh, device: torch.device | None) -> DeviceMesh:
    """The 1-D DeviceMesh the unit's DTensors live on (FSDP2's: the whole world when none is given)."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: torch.distributed is not initialized (call init_process_group first)")
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"fully_shard: mesh must be 1-D (got {mesh.ndim} dimensions); HSDP (replicate x shard) and "
                "2-D parallelism are not supported by minddp.fsdp: pass a 1-D mesh, e.g. "
                "init_device_mesh('cpu', (world_size,))")
        return mesh
    if mesh is not None and not isinstance(mesh, dist.ProcessGroup):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    group = mesh if mesh is not None else dist.group.WORLD
    if device is None or device.type == "meta":
        device_type = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    else:
        device_type = device.type
    return DeviceMesh.from_group(group, device_type)


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
        if p.dim() == 0:
            raise ValueError(f"{name}: parameter {qualname!r} is a 0-dim tensor, which has no dim 0 to shard; "
                             "make it shape (1,), or keep it out of every unit")


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
