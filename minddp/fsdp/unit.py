"""One unit: the parameters of one ``fully_shard`` call, as DTensors over one flat shard per rank.

Each parameter is sharded on dim 0 as torch FSDP2 shards it (``Shard(0)``:
rank r holds rows ``[r*c, (r+1)*c)``, ``c = ceil(rows / N)``, the last ranks
fewer or none). This rank's rows of every parameter lie in one flat tensor,
``shard``, in the parameters' own dtype (fp32), each padded to ``c`` rows so
every rank's shard has the same length. The module sees each parameter as a
:class:`~torch.distributed.tensor.DTensor` over its rows in ``shard``: full
logical shape, ``placements == (Shard(0),)``, ``to_local()`` a view into
``shard``. So ``nn.init``, a shape-aware optimizer, ``clip_grad_norm_`` and
torch's state-dict helpers treat it as FSDP2's, and an optimizer step in
place writes straight into ``shard``.

Around a forward or backward the unit is *gathered*: every rank's shard,
cast to the compute dtype, is all-gathered (rank after rank), then copied
out (``split_with_sizes_copy``, FSDP2's copy-out) into ``full``, where the
parameters lie one after another, each padded to ``N*c`` rows; the full
parameters (``full_params``, plain tensors) are views over it. They are
created once and kept for the unit's whole life; *freeing* the unit shrinks
``full``'s storage to zero bytes and gathering grows it back. Keeping the
same tensor objects is what lets autograd find them again: the graph of a
forward holds them, and in backward their storage is simply full again.
Their gradients arrive on them (``.grad``, full size, compute dtype),
accumulated by autograd straight into their places in a gradient buffer
laid out like ``full`` (:meth:`gradients_into_send_buffer`);
:meth:`start_reduce_scatter` copies it in rank after rank (one ``torch.cat``,
FSDP2's copy-in), divides by N and sums it over the ranks into this rank's
shard-shaped piece, and :meth:`finish_reduce_scatter` hands each
parameter's rows, in fp32, to its ``.grad`` (a DTensor like the parameter).

A unit built on the meta device holds nothing: ``model.to_empty(device=...)``
(or ``load_state_dict(..., assign=True)``) gives it a real ``shard``
(:meth:`take_values`), and ``reset_parameters()`` / ``nn.init`` fill it.

Life cycle: ``SHARDED -> (start_gather) GATHERING -> (wait_gathered) GATHERED
-> (free) SHARDED``; a reduce-scatter runs beside it (``pending``).
"""

from __future__ import annotations

import enum
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from minddp.ddp.core.weak_hooks import after_accumulation
from minddp.fsdp.checks import REPLACED
from minddp.fsdp.collectives import PendingReduceScatter, all_gather, gloo_collectives, start_reduce_scatter
from minddp.fsdp.policy import MixedPrecisionPolicy

__all__ = ["Place", "SHARD_OF", "ShardedUnit", "UnitState"]

Place = tuple[nn.Module, str]  # where a parameter is registered: (module, attribute name)
SHARD_OF = "_minddp_fsdp_shard_of"  # on a shard parameter: its unit


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class _Geometry:
    """Where one parameter's rows lie: in every rank's shard, and in the unit's full buffer."""

    def __init__(self, shape: torch.Size, world_size: int, rank: int, shard_offset: int):
        self.shape = shape
        self.numel = shape.numel()
        self.rows = shape[0]
        self.row_numel = math.prod(shape[1:])
        self.chunk_rows = -(-self.rows // world_size)  # FSDP2's (torch.chunk's) rows per rank
        self.padded = self.chunk_rows * self.row_numel  # elements each rank sends for it
        self.shard_offset = shard_offset  # where its rows start in a rank's shard
        self.full_offset = world_size * shard_offset  # where it starts in the unit's full buffer
        self.first_row = min(rank * self.chunk_rows, self.rows)
        self.my_rows = min(self.rows, self.first_row + self.chunk_rows) - self.first_row
        self.local_shape = torch.Size((self.my_rows, *shape[1:]))
        self.stride = _contiguous_strides(shape)


class ShardedUnit:
    """One flat shard of some parameters (seen as DTensors), and the collectives that gather and reduce it."""

    def __init__(self, name: str, params: list[nn.Parameter], places: list[list[Place]],
                 mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                 on_gradient: Callable[["ShardedUnit"], None],
                 lend_buffer: Callable[["ShardedUnit"], torch.Tensor] | None = None):
        """``params``: the unit's own parameters (distinct); ``places[i]``: where ``params[i]`` sits."""
        self.name = name
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.places = places
        self.names = [f"{type(where[0][0]).__name__}.{where[0][1]}" for where in places]
        self.state = UnitState.SHARDED
        self.requires_gradient_sync = True
        self.borrowed: list[tuple[Place, "ShardedUnit", int]] = []  # tied parameters owned by another unit
        self.reshard_after_forward = True
        self.is_root = False  # around other units: kept gathered from its forward into backward
        self.schedule = None  # the Schedule of the model's units, set by fully_shard
        self.forward_prefetch: list["ShardedUnit"] | None = None  # set_modules_to_forward_prefetch
        self.backward_prefetch: list["ShardedUnit"] | None = None
        self._on_gradient = on_gradient
        self._lend_buffer = lend_buffer or _own_buffer  # this step's gradient buffer, zeros (the Schedule lends one)
        self._send: torch.Tensor | None = None  # this step's gradients, laid out like ``full`` (reduce dtype)
        self._gathered: torch.Tensor | None = None  # the all-gather's output, rank after rank, until copied out
        self._gather_work = None
        self.pending: PendingReduceScatter | None = None  # a launched reduce-scatter, until waited for
        self.gradients_in = 0
        self.gathers = self.reduce_scatters = 0  # collectives launched so far (for tests and lessons)
        self.trained = [p.requires_grad for p in params]
        self.master_dtype = params[0].dtype if params else torch.float32
        self.compute_dtype = policy.compute_dtype(self.master_dtype)
        self.reduce_dtype = policy.communication_dtype(self.master_dtype)
        self.geometry: list[_Geometry] = []
        offset = 0
        for p in params:
            self.geometry.append(_Geometry(p.shape, self.world_size, self.rank, offset))
            offset += self.geometry[-1].padded
        self.piece = offset  # every rank's shard length: what each sends in a collective
        # Each parameter's elements this rank holds, in its flattened parameter: (first, how many).
        self.spans = [(g.first_row * g.row_numel, g.my_rows * g.row_numel) for g in self.geometry]
        device = params[0].device if params else torch.device(mesh.device_type)
        with torch.no_grad():
            self._build(device)
            if device.type != "meta":
                self._take_rank0s_values([p.detach() for p in params])

    @property
    def is_meta(self) -> bool:
        return self.shard.device.type == "meta"

    @property
    def device(self) -> torch.device:
        return self.shard.device

    def _build(self, device: torch.device) -> None:
        """This rank's shard (uninitialized), its DTensor parameters, and the full buffer with its views, on ``device``."""
        self.on_gloo = gloo_collectives(self.group, device)
        self.shard = torch.empty(self.piece, dtype=self.master_dtype, device=device)
        self.locals = [self.shard[g.shard_offset: g.shard_offset + g.my_rows * g.row_numel].view(g.local_shape)
                       for g in self.geometry]
        self.shard_params = [nn.Parameter(self.as_dtensor(local, g), requires_grad=trained)
                             for local, g, trained in zip(self.locals, self.geometry, self.trained)]
        for p in self.shard_params:
            setattr(p, SHARD_OF, self)
        self.full_params: list[nn.Parameter] = []
        self.gradients_expected = sum(self.trained)
        if device.type == "meta":  # nothing to gather until the model is materialized
            self.full = torch.empty(0, dtype=self.compute_dtype, device=device)
            return
        self.full = torch.empty(self.world_size * self.piece, dtype=self.compute_dtype, device=device)
        # Each parameter's region of ``full``: N * c rows, viewed as (rank, its padded rows) for the copy-out.
        self._regions = [self.full[g.full_offset: g.full_offset + self.world_size * g.padded].view(self.world_size, -1)
                         for g in self.geometry]
        for g, trained in zip(self.geometry, self.trained):
            over_full = torch.empty(0, dtype=self.compute_dtype, device=device)
            over_full.set_(self.full.untyped_storage(), g.full_offset, g.shape, g.stride)
            self.full_params.append(nn.Parameter(over_full, requires_grad=trained))
        after_accumulation(self._gradient_arrived, [p for p in self.full_params if p.requires_grad])
        self.full.untyped_storage().resize_(0)

    def as_dtensor(self, local: torch.Tensor, g: _Geometry) -> DTensor:
        """``local`` (this rank's rows of parameter ``g``) as the Shard(0) DTensor of the full parameter."""
        return DTensor.from_local(local, self.mesh, (Shard(0),), run_check=False, shape=g.shape, stride=g.stride)

    def _rank_major(self, fulls: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Full tensors, one per parameter, as every rank's shard end to end (``N x piece``): the copy-in."""
        regions = []
        for full, g in zip(fulls, self.geometry):
            padded = torch.zeros(self.world_size * g.padded, dtype=dtype, device=full.device)
            padded[: g.numel].copy_(full.reshape(-1))
            regions.append(padded.view(self.world_size, g.padded))
        return torch.cat(regions, dim=1) if regions else torch.zeros(self.world_size, 0, dtype=dtype)

    def _take_rank0s_values(self, originals: list[torch.Tensor]) -> None:
        """Every rank's rows from rank 0's parameters, as MiniDDP starts from rank 0's weights.

        Otherwise a rank that initialized differently (a forgotten seed) would
        shard its own values, and the model would be a patchwork no rank had.
        One scatter per unit, once: each rank receives only its shard. (FSDP2
        trusts every rank to have initialized alike; a model built on meta is
        initialized after sharding, each rank its own rows, as FSDP2's.)"""
        if not self.geometry:
            return
        if self.world_size == 1:
            self.shard.copy_(self._rank_major(originals, self.master_dtype)[0])
            return
        pieces = None
        if self.rank == 0:
            pieces = list(self._rank_major(originals, self.master_dtype).unbind(0))
        dist.scatter(self.shard, pieces, src=dist.get_global_rank(self.group, 0), group=self.group)

    # ------------------------------------------------------------ materializing, loading
    def take_values(self, now: list[torch.Tensor]) -> None:
        """Make ``shard`` hold ``now[i]`` (what the module holds at parameter i's place after
        ``Module._apply`` or ``load_state_dict(assign=True)``: a DTensor of this rank's rows, or the
        full tensor), building the shard on that device first if the unit was on meta; then make
        fresh DTensor parameters over it (the old ones are flagged, so an optimizer holding one fails)."""
        if not self.geometry:
            return
        values = [v.to_local() if isinstance(v, DTensor) else v for v in now]
        if all(v.data_ptr() == mine.data_ptr() and v.device == mine.device for v, mine in zip(values, self.locals)):
            return  # converted in place (``model.to`` its own device and dtype): nothing to do
        real = [v.device for v in values if v.device.type != "meta"]
        stale = list(self.shard_params)
        with torch.no_grad():
            if self.is_meta and real:
                self._build(real[0])
            for value, mine, g, name in zip(values, self.locals, self.geometry, self.names):
                if value.device.type == "meta" and not self.is_meta:
                    raise RuntimeError(
                        f"{self.name}: parameter {name!r} is still on the meta device while the others hold "
                        "values (a key missing from the state dict loaded with assign=True?); load every "
                        "parameter, or call model.to_empty(device=...) and initialize it")
                if value.shape == g.shape and g.local_shape != g.shape:
                    value = value[g.first_row: g.first_row + g.my_rows]  # a full tensor: this rank's rows
                if value.shape != g.local_shape:
                    raise ValueError(f"{self.name}: parameter {name!r} got a tensor of shape {tuple(value.shape)}; "
                                     f"expected this rank's rows {tuple(g.local_shape)} or the full {tuple(g.shape)}")
                if not self.is_meta:
                    mine.copy_(value)
            self.shard_params = [nn.Parameter(self.as_dtensor(local, g), requires_grad=trained)
                                 for local, g, trained in zip(self.locals, self.geometry, self.trained)]
            for old, new, name in zip(stale, self.shard_params, self.names):
                setattr(new, SHARD_OF, self)
                setattr(old, REPLACED, f"{name!r} of {self.name} (replaced again after to_empty/.to/load)")

    def register_shards(self) -> None:
        """Put the shard parameters back in their modules (own places and tied ones borrowed from a lender)."""
        for param, places in zip(self.shard_params, self.places):
            for module, attr in places:
                module._parameters[attr] = param
        for (module, attr), lender, index in self.borrowed:
            module._parameters[attr] = lender.shard_params[index]

    def registered(self) -> list[torch.Tensor]:
        """What the modules hold now at each parameter's first place."""
        return [places[0][0]._parameters[places[0][1]] for places in self.places]

    # ------------------------------------------------------------ gather / free
    def start_gather(self) -> None:
        """Launch the all-gather of every rank's shard (a no-op unless sharded)."""
        if self.state is not UnitState.SHARDED:
            return
        if self.is_meta and self.geometry:
            raise RuntimeError(
                f"{self.name}: its parameters are on the meta device (no values yet). After fully_shard, "
                "call model.to_empty(device=...) and initialize them (model.reset_parameters() or nn.init), "
                "or load a state dict, before running the model")
        for _, lender, _ in self.borrowed:
            lender.start_gather()
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        if self.geometry:
            self.gathers += 1
            send = self.shard.to(self.compute_dtype)
            if self.world_size > 1:
                self._gathered = torch.empty(self.world_size * self.piece, dtype=self.compute_dtype,
                                             device=self.device)
                self._gather_work = all_gather(self._gathered, send, group=self.group, async_op=True)
            else:
                self._gathered = send
        self.state = UnitState.GATHERING

    def _copy_out(self) -> None:
        """The gathered shards (rank after rank) into ``full`` (parameter after parameter): FSDP2's copy-out."""
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
        if self._gathered is not None:
            torch.split_with_sizes_copy(self._gathered.view(self.world_size, self.piece),
                                        [g.padded for g in self.geometry], dim=1, out=self._regions)
            self._gathered = None

    def wait_gathered(self) -> None:
        """Gather (or finish the prefetch) and let the modules see the full parameters."""
        self.start_gather()
        for _, lender, _ in self.borrowed:
            lender.wait_gathered()
        if self.state is UnitState.GATHERING:
            self._copy_out()
            self.state = UnitState.GATHERED
        # As FSDP2: while gathered, the modules hold the full parameters (``model.parameters()`` too).
        for full, places in zip(self.full_params, self.places):
            for module, name in places:
                module._parameters[name] = full
        for (module, name), lender, index in self.borrowed:
            module._parameters[name] = lender.full_params[index]

    def free(self, free_lenders: bool = True) -> None:
        """Back to the shard: drop the full storage; the modules see their shard parameters again."""
        if self.state is UnitState.GATHERING:
            if self._gather_work is not None:
                self._gather_work.wait()
            self._gather_work = self._gathered = None
        self.register_shards()
        if free_lenders:
            for _, lender, _ in self.borrowed:
                lender.free()
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    # ------------------------------------------------------------ gradients
    def _gradient_arrived(self, _: torch.Tensor) -> None:
        self.gradients_in += 1
        if self.gradients_in == self.gradients_expected:
            self._on_gradient(self)

    def _send_buffer(self) -> torch.Tensor:
        """This step's send buffer, zeros (a gradient that never comes counts as zeros), taken once."""
        if self._send is None:
            self._send = self._lend_buffer(self)
        return self._send

    def gradients_into_send_buffer(self) -> None:
        """Before the unit's backward: each parameter's ``.grad`` becomes its place in the gradient buffer.

        Autograd then accumulates every gradient straight into it (as DDP's
        ``gradient_as_bucket_view`` does into a bucket): no full-size
        ``.grad`` beside the buffer, no Python per gradient. Only when
        gradients are reduced in their own dtype (else they are copied, and
        cast, at the launch).
        """
        if not self.geometry or self.reduce_dtype != self.compute_dtype:
            return
        grads = self._send_buffer()
        for full, g in zip(self.full_params, self.geometry):
            if full.requires_grad:
                place = grads[g.full_offset: g.full_offset + g.numel].view(g.shape)
                if full.grad is not None and full.grad.data_ptr() != place.data_ptr():
                    place.copy_(full.grad)  # accumulated before (sync off, or a tied use elsewhere)
                full.grad = place

    def start_reduce_scatter(self) -> None:
        """Average the unit's gradients over the ranks (async); this rank keeps its rows."""
        if not self.geometry or self.pending is not None:
            return
        grads = self._send_buffer()
        for full, g in zip(self.full_params, self.geometry):
            place = grads[g.full_offset: g.full_offset + g.numel]
            if full.grad is not None and full.grad.data_ptr() != place.data_ptr():
                place.copy_(full.grad.reshape(-1))  # a gradient that did not land in its place: copied (and cast)
            full.grad = None
        # [Note: copy-in] The reduce-scatter wants rank 0's rows of every
        # parameter, then rank 1's, ...; the buffer holds parameter after
        # parameter. One cat of (rank, rows) views reorders it (FSDP2's chunk_cat).
        send = torch.cat([grads[g.full_offset: g.full_offset + self.world_size * g.padded].view(self.world_size, -1)
                          for g in self.geometry], dim=1).view(-1)
        self._send = None
        # One division by N for the whole unit, before the sum, as DDP divides (the same rounding as its).
        send.mul_(1.0 / self.world_size)
        self.reduce_scatters += 1
        self.pending = start_reduce_scatter(send, self.piece, self.rank, self.group, self.on_gloo)

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter; add each parameter's rows, in the master dtype, to its ``.grad`` (a DTensor)."""
        if self.pending is None:
            return
        piece = self.pending.wait(self.master_dtype)
        self.pending = None
        for shard_param, g in zip(self.shard_params, self.geometry):
            if not shard_param.requires_grad:
                continue
            rows = piece[g.shard_offset: g.shard_offset + g.my_rows * g.row_numel].view(g.local_shape)
            if shard_param.grad is None:
                shard_param.grad = self.as_dtensor(rows, g)
            else:
                shard_param.grad.to_local().add_(rows)

    def has_gradients(self) -> bool:
        return any(full.grad is not None for full in self.full_params)

    def gather_master(self) -> list[torch.Tensor]:
        """The unit's full parameters in the master dtype (new tensors, shaped as the originals; a collective)."""
        if not self.geometry:
            return []
        if self.is_meta:
            return [torch.empty(g.shape, dtype=self.master_dtype, device="meta") for g in self.geometry]
        gathered = torch.empty(self.world_size * self.piece, dtype=self.master_dtype, device=self.device)
        if self.world_size > 1:
            all_gather(gathered, self.shard.detach(), group=self.group)
        else:
            gathered.copy_(self.shard.detach())
        per_rank = gathered.view(self.world_size, self.piece)
        return [per_rank[:, g.shard_offset: g.shard_offset + g.padded].reshape(-1)[: g.numel].view(g.shape).clone()
                for g in self.geometry]


def _own_buffer(unit: ShardedUnit) -> torch.Tensor:
    return torch.zeros(unit.full.numel(), dtype=unit.reduce_dtype, device=unit.full.device)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
