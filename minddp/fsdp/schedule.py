"""When units gather, free and reduce: the step as the units of one model see it.

Every unit of a model shares one :class:`Schedule` (``fully_shard`` on an
outer module merges the schedules of the units inside it; units with no
common sharded ancestor keep one each). It is told five things, by the
module hooks of :mod:`minddp.fsdp.fully_shard`, a gradient hook on the unit's
outputs, and a hook on each full parameter's gradient accumulation; it
decides the rest:

* ``before_forward(unit)``: gather the unit (the prefetch may have started
  it), and start gathering the unit that came next last time (or the
  units ``set_modules_to_forward_prefetch`` named);
* ``after_forward(unit, output)``: free the unit (unless its backward comes
  first: the root, the outermost unit, and the last unit of the forward),
  and ask to be told when a gradient reaches the output
  (``register_multi_grad_hook``);
* ``before_backward(unit)``: gather it again, prefetch the next unit of the
  last backward's order, and point its gradients into its send buffer;
* ``lend_send_buffer(unit)`` (the unit needs a buffer for its gradients,
  which autograd accumulates into it): wait for the previous unit's
  reduce-scatter and lend the step's one send buffer again;
* ``gradients_done(unit)`` (every parameter's gradient is in): launch its
  reduce-scatter, and free it.

At the end of the backward pass (a callback autograd runs when the pass is
over) it reduces what never got all its gradients, waits for every
reduce-scatter, writes the shards' ``.grad`` and frees every unit.

Orders are recorded in the first step and replayed for prefetching after:
the same model runs the same units in the same order on every rank, so the
collectives stay in the same order everywhere.

Activation checkpointing runs a unit's forward again *inside* backward;
there (``_in_backward``) a forward gathers but never frees and never hooks
the output: the unit is freed when its gradients are done. The reentrant
kind runs a nested backward pass per checkpoint: the step ends with the
first pass a unit saw, or with any pass after which no unit waits for a
gradient. (When the first unit to see a gradient sits inside a reentrant
checkpoint, with no unit around it, that first pass is a nested one: each
nested pass then ends a "step" of its own, which stays correct, each waiting
for what it launched, but backward prefetching stops and a unit with an
unused parameter is never reduced. Wrap the root, or use ``use_reentrant=False``.)

A unit used twice in one forward is gathered twice; its parameters'
gradients accumulate over both uses before their hooks fire, so it is
reduced once.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from minddp.fsdp.unit import ShardedUnit

__all__ = ["Schedule"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Order:
    """The order units ran in: recorded once, then a guide for prefetching."""

    def __init__(self) -> None:
        self.recorded: list[ShardedUnit] = []
        self.complete = False
        self._position = 0

    def next_to_prefetch(self, unit: ShardedUnit) -> ShardedUnit | None:
        if not self.complete:
            self.recorded.append(unit)
            return None
        position, self._position = self._position, self._position + 1
        expected = self.recorded[position] if position < len(self.recorded) else None
        if expected is not unit:  # this step went another way: stop guessing
            self._position = len(self.recorded) + 1
            return None
        return self.recorded[position + 1] if position + 1 < len(self.recorded) else None

    def ends_with(self, unit: ShardedUnit) -> bool:
        return self.complete and bool(self.recorded) and self.recorded[-1] is unit

    def step_over(self) -> None:
        self.complete = True
        self._position = 0


class Schedule:
    """The shared step state of every unit of one model."""

    def __init__(self, units: list[ShardedUnit] | None = None):
        self.units: list[ShardedUnit] = units or []
        self.prefetch = True
        self._forward_order = _Order()
        self._backward_order = _Order()
        self._reset_step()

    def _reset_step(self) -> None:
        self._buffer: torch.Tensor | None = None  # the send buffer, lent to one unit at a time (none between steps)
        self._filling: ShardedUnit | None = None  # the unit it is lent to, until that unit launches
        self._ran_forward: list[ShardedUnit] = []
        self._gradients_done: set[int] = set()
        self._launched: list[ShardedUnit] = []
        self._depth = 0
        self._first_pass: int | None = None
        self._watched_passes: set[int] = set()

    def adopt(self, other: "Schedule") -> None:
        """Take over another schedule's units (an outer ``fully_shard`` over inner ones)."""
        for unit in other.units:
            if unit not in self.units:
                self.units.append(unit)
                unit.schedule = self

    # ------------------------------------------------------------ forward
    def before_forward(self, unit: ShardedUnit) -> None:
        if _in_backward():  # recomputed by activation checkpointing
            self._watch_this_pass()
            unit.wait_gathered()
            return
        if unit not in self._ran_forward:
            self._ran_forward.append(unit)
        self._depth += 1
        unit.wait_gathered()
        if torch.is_grad_enabled():
            self._prefetch(self._forward_order.next_to_prefetch(unit), unit.forward_prefetch)

    def after_forward(self, unit: ShardedUnit, output) -> object:
        if _in_backward():
            return output
        self._depth -= 1
        hooked = False
        if torch.is_grad_enabled():
            needing = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if needing:
                register_multi_grad_hook(needing, lambda _: self.before_backward(unit), mode="any")
                hooked = True
        # A root (the outermost unit, around others) has its backward first:
        # freeing it would only gather it again (FSDP2 keeps its root too).
        # So has the last unit of the forward (known from the first step on),
        # right after the root's: keeping it saves one all-gather per step.
        first_back = unit.is_root and self._depth == 0 or self._forward_order.ends_with(unit)
        keep = (hooked and first_back) or not unit.reshard_after_forward
        if not keep:
            unit.free()
        return output

    # ------------------------------------------------------------ backward
    def before_backward(self, unit: ShardedUnit) -> None:
        self._watch_this_pass()
        unit.wait_gathered()
        self._prefetch(self._backward_order.next_to_prefetch(unit), unit.backward_prefetch)
        # Its gradients straight into its send buffer. Not the root's: they
        # come around the other units' (a final norm first, an embedding
        # last), and its buffer would stay through the whole backward.
        if unit.requires_gradient_sync and not unit.is_root:
            unit.gradients_into_send_buffer()

    def gradients_done(self, unit: ShardedUnit) -> None:
        """Every gradient of ``unit`` arrived (hook on its last parameter's accumulation)."""
        self._watch_this_pass()
        self._gradients_done.add(id(unit))
        if unit.requires_gradient_sync:
            self._launch_reduce_scatter(unit)
        unit.free(free_lenders=False)
        unit.gradients_in = 0

    def lend_send_buffer(self, unit: ShardedUnit) -> torch.Tensor:
        """Zeros for ``unit``'s gradients: the step's one send buffer, once the reduce-scatter that used it is done.

        A launched reduce-scatter holds its full-size send buffer until waited
        for. Waiting for it before the next unit takes the buffer (the
        previous unit's reduce-scatter had this unit's gather and first
        operations to finish in, so the wait is usually short) keeps one send
        buffer at a time: two would be the step's memory peak. Lending the
        same buffer again, rather than a new one, keeps that true even while
        Gloo's thread lets go of a finished collective's tensors a moment
        late. A unit whose backward begins while another still fills the
        buffer (a unit used before and after it) gets zeros of its own.
        """
        self._finish_launched_before(unit)
        numel, dtype, device = unit.full.numel(), unit.reduce_dtype, unit.full.device
        shared = self._buffer
        if self._filling not in (None, unit):
            return torch.zeros(numel, dtype=dtype, device=device)
        if shared is None or shared.dtype != dtype or shared.device != device or shared.numel() < numel:
            largest = max(u.full.numel() for u in self.units if u.reduce_dtype == dtype)
            self._buffer = shared = torch.empty(max(largest, numel), dtype=dtype, device=device)
        self._filling = unit
        return shared[:numel].zero_()

    def _launch_reduce_scatter(self, unit: ShardedUnit) -> None:
        self._finish_launched_before(unit)
        unit.start_reduce_scatter()
        if self._filling is unit:
            self._filling = None
        self._launched = [unit]

    def _finish_launched_before(self, unit: ShardedUnit) -> None:
        for earlier in self._launched:
            if earlier is not unit:
                earlier.finish_reduce_scatter()

    def _prefetch(self, following: ShardedUnit | None, named: list[ShardedUnit] | None) -> None:
        """Start gathering the units named by ``set_modules_to_*_prefetch`` if any (always), else the
        one that came next last time (while prefetching is on)."""
        if named is not None:
            for unit in named:
                unit.start_gather()
        elif following is not None and self.prefetch:
            following.start_gather()

    def _watch_this_pass(self) -> None:
        # A reentrant activation checkpoint runs a nested backward pass; ask
        # to be called at the end of each pass we see, and decide there.
        current = torch._C._current_graph_task_id()
        if current == -1 or current in self._watched_passes:
            return
        if self._first_pass is None:
            self._first_pass = current
        self._watched_passes.add(current)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._pass_ended(current))

    def _pass_ended(self, pass_id: int) -> None:
        waiting = [u for u in self._ran_forward if u.gradients_expected and id(u) not in self._gradients_done]
        if pass_id == self._first_pass or not waiting:
            self.finish_backward()

    def finish_backward(self) -> None:
        """Reduce what is left (in a fixed order), wait for every reduce-scatter, free every unit."""
        for unit in self._ran_forward:
            if id(unit) not in self._gradients_done and unit.has_gradients() and unit.requires_gradient_sync:
                self._launch_reduce_scatter(unit)
            unit.gradients_in = 0
        for unit in self._launched:
            unit.finish_reduce_scatter()
        for unit in self.units:
            unit.free(free_lenders=False)
        self._forward_order.step_over()
        self._backward_order.step_over()
        self._reset_step()
