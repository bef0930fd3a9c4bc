"""The path of a gradient, from autograd's hook to the averaged ``.grad``: lesson 07b's ``FlatDDP``, grown up.

``MiniDDP`` (:mod:`minddp.ddp`) wraps the module; this :class:`Reducer`
averages the gradients, as torch splits ``DistributedDataParallel`` (Python)
from its ``Reducer`` (C++). The plain path, top to bottom in this file::

    loss.backward()
      autograd accumulates p.grad
        └─ _autograd_hook(i, p)           post-accumulate hook, one per parameter
             first hook of this backward: queue _on_pass_end on autograd's engine
             on_grad_ready(i, p)          count p ready in its bucket (which one: _plan[i])
               its bucket complete? ─> bucket_ready(bucket)
                  fill_bucket: every p.grad * 1/N into its slot, one batched copy
                  launch every complete bucket, strictly in bucket order:
                  communicate(bucket) = an async all_reduce
      the backward pass ends
        └─ _on_pass_end() ─> finish_backward()
              every bucket launched? (else an error naming the parameters without a gradient)
              per bucket: write_grads (wait for its sum, copy it into .grad), reset
              backward_done_callbacks

Every feature beyond this path is a *layer* (:mod:`minddp.features`): a
class that overrides some of the steps above and calls ``super()`` for the
rest. :meth:`Reducer.add_layer` stacks one on this reducer; a feature that is
off is not in the stack, so the plain path neither calls nor tests for it.
What policies above may call (the arrival log, ``rebuild``, bucket storage,
``bucket_reduced_hook``) is in :mod:`minddp.reducer_hooks`.

Why divide *before* summing: the sum of N half-precision gradients can
overflow where N parts of their average cannot.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from minddp.bucket_assignment import FIRST_BUCKET_CAP_MB, MiB, TensorSpec, assign_buckets
from minddp.buckets import Bucket, BucketStorage
from minddp.features import Layer
from minddp.features.observed import ProfilerRanges
from minddp.reducer_hooks import ReducerHookPoints

__all__ = ["FIRST_BUCKET_CAP_MB", "ReducerOptions", "Reducer"]

_engine = torch.autograd.Variable._execution_engine
_profiling = torch.autograd._profiler_enabled


@dataclass(frozen=True)
class ReducerOptions:
    """How gradients are bucketed and reduced (MiniDDP's arguments of the same names)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    reduce_dtype: torch.dtype | None = None
    learn_bucket_order: bool = True
    skip_all_reduce_unused_params: bool = False
    bucket_caps_mb: tuple[float, ...] | None = None  # one cap per bucket (torch's bucket_cap_mb_list)


class Reducer(ReducerHookPoints):
    """Averages the gradients of ``params`` over ``process_group`` during backward.

    (What policies above may call, ``rebuild``, ``watch_arrivals``, bucket
    storage, ``bucket_reduced_hook``, is in :class:`~minddp.reducer_hooks.ReducerHookPoints`:
    methods only; every attribute the path reads is set in ``__init__`` here.)
    """

    _layers: tuple[type[Layer], ...] = ()  # the features stacked on this class (add_layer)

    def __init__(self, params: list[nn.Parameter], names: list[str], process_group: dist.ProcessGroup,
                 options: ReducerOptions):
        self.params, self.names, self.options = params, names, options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.device = params[0].device
        self.divisor = self.world_size  # the average is over this many ranks (join() may lower it)
        self.scale = 1.0 / self.divisor  # what every gradient is multiplied by before the sum
        self.sync_this_backward = False  # set at each forward: does its backward communicate?
        # Also set at each synchronized forward: did it run inside a backward pass? (A reentrant
        # checkpoint around the whole model recomputes its forward there: see _on_pass_end.)
        self.forward_inside_backward = False
        self.backward_started = False
        self._end_of_pass_queued = False
        self.backwards_done = 0
        self.backward_done_callbacks: list[Callable[[], None]] = []
        self.comm_hook: tuple[Any, Callable] | None = None  # (state, hook): minddp.features.comm_hook
        self.globally_used: list[bool] | None = None  # None: every parameter had a gradient somewhere
        self.planned_rebuild: str | None = None  # why the buckets will still change (a policy's plan)
        self.storage = BucketStorage()
        self.caps = (int(options.bucket_cap_mb * MiB), int(FIRST_BUCKET_CAP_MB * MiB))
        self.per_bucket_caps = [int(cap * MiB) for cap in options.bucket_caps_mb or ()]  # [] unless given
        self._index = {p: i for i, p in enumerate(params)}
        self._build_buckets(list(reversed(range(len(params)))))  # the first guess: reverse registration
        for i, p in enumerate(params):  # fires after p.grad has been accumulated
            p.register_post_accumulate_grad_hook(functools.partial(self._autograd_hook, i))

    def _build_buckets(self, order: list[int]) -> None:
        """(Re)build the buckets for parameter indices in expected-arrival ``order``."""
        specs = [TensorSpec(self.params[i].numel(), self.bucket_dtype(i).itemsize, self.bucket_dtype(i),
                            self.device) for i in order]
        groups = assign_buckets(specs, *self.caps, per_bucket_caps=self.per_bucket_caps)
        # Let go of the old buckets first, so that their buffers (a whole copy of the gradients) are
        # freed before the new ones are taken; a .grad that is a slot of one keeps that one alive.
        self.buckets, self._plan = [], []
        self.buckets = [self._make_bucket(k, [order[j] for j in group], specs[group[0]].dtype, len(groups))
                        for k, group in enumerate(groups)]
        # The plan every hook follows, worked out once here instead of at every
        # gradient: parameter index -> (its bucket, its position there).
        self._indices = [[self._index[p] for p in bucket.params] for bucket in self.buckets]
        self._plan: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket, indices in zip(self.buckets, self._indices):
            for position, i in enumerate(indices):
                self._plan[i] = (bucket, position)
        self._next_to_launch = 0

    def _make_bucket(self, k: int, indices: list[int], dtype: torch.dtype, count: int, extra_numel: int = 0) -> Bucket:
        """Bucket ``k`` of ``count``, for these parameter indices."""
        return Bucket(k, [self.params[i] for i in indices], [self.names[i] for i in indices], dtype, self.storage,
                      extra_numel)

    def bucket_dtype(self, index: int) -> torch.dtype:
        """What ``params[index]``'s gradient is reduced in: its own dtype (``reduce_dtype`` is a layer)."""
        return self.params[index].dtype

    # ------------------------------------------------------- at every forward
    def prepare_for_forward(self, sync: bool, buffers_due: bool) -> int | None:
        """Before the module's forward: will its backward communicate? Returns the rank whose buffers
        everyone takes now, or None for no broadcast (``buffers_due``: the last forward synchronized)."""
        self.sync_this_backward = sync
        self.forward_inside_backward = sync and torch._C._current_graph_task_id() != -1
        return 0 if buffers_due else None

    def prepare_for_backward(self, output: Any) -> None:
        """After a synchronized forward, with its output (where unused parameters are searched for)."""

    # ------------------------------------------------ the path of a gradient
    def _autograd_hook(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate hook of ``params[index]``: its ``.grad`` is final for this backward."""
        if not self.sync_this_backward:
            return  # inside no_sync(): the gradient just accumulates
        if not self._end_of_pass_queued:  # the first hook of this backward (or of a pass: _on_pass_end)
            if not self.backward_started:
                self.start_backward()
            _engine.queue_callback(self._on_pass_end)
            self._end_of_pass_queued = True
        self.on_grad_ready(index, param)

    def start_backward(self) -> None:
        self.backward_started = True
        if _profiling():  # a torch.profiler is recording: name the launches and the wait for it
            self.add_layer(ProfilerRanges)

    def on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Count the gradient in its bucket; the copy waits until the bucket is complete."""
        bucket, position = self._plan[index]
        if bucket.mark_ready_at(position):
            self.bucket_ready(bucket)

    def bucket_ready(self, bucket: Bucket) -> None:
        """Its gradients into the bucket, then launch every complete bucket, strictly in bucket order:
        a bucket complete early waits for the ones before it, so every rank issues the same
        all-reduces in the same order."""
        self.fill_bucket(bucket)
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            self.buckets[self._next_to_launch].launch(self.communicate)
            self._next_to_launch += 1

    def fill_bucket(self, bucket: Bucket) -> None:
        """Every gradient of a complete bucket into its slot, times 1/N: one batched copy per bucket."""
        grads = []
        for param in bucket.params:
            grads.append(param.grad)
        bucket.copy_in(grads, bucket.views, self.scale)

    def communicate(self, bucket: Bucket) -> torch.futures.Future:
        """Start summing the bucket over the ranks; a future of the summed buffer."""
        if self.world_size == 1:  # nothing to add: the buffer is the average already
            done = torch.futures.Future()
            done.set_result(bucket.buffer)
            return done
        return dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True).get_future()

    # ------------------------------------------------------ end of backward
    def _on_pass_end(self) -> None:
        """Autograd finished a pass that delivered gradients: is the backward over?

        Usually yes. But a reentrant activation checkpoint runs a nested
        backward pass inside a node of the outer one, and its hooks may fire
        first: when that pass ends with buckets still to come, the outer pass
        goes on, and the next hook queues this callback again, there. A pass
        that is outermost (no autograd node running), or the only pass of a
        forward that itself ran inside a backward, ends the backward.
        """
        if (self._next_to_launch == len(self.buckets) or self.forward_inside_backward
                or torch._C._current_autograd_node() is None):
            self.finish_backward()
        else:
            self._end_of_pass_queued = False

    def finish_backward(self) -> None:
        """Every bucket launched? Then wait for each, write ``.grad``, and be ready for the next backward."""
        self.backward_started = self._end_of_pass_queued = False
        if self._next_to_launch < len(self.buckets):
            raise self._missing_gradients_error()
        for bucket in self.buckets:
            self.write_grads(bucket)
            bucket.reset()
        self._next_to_launch = 0
        self.backwards_done += 1
        for callback in list(self.backward_done_callbacks):  # a callback may remove itself
            callback()

    def write_grads(self, bucket: Bucket) -> None:
        """Wait for the bucket's sum and copy each average into its parameter's ``.grad``."""
        bucket.wait()
        grads = []
        for param in bucket.params:
            grads.append(param.grad)
        torch._foreach_copy_(grads, bucket.views)

    def _missing_gradients_error(self) -> RuntimeError:
        missing = self.abandon_unfinished_backward()
        return RuntimeError(
            f"MiniDDP: parameters {missing} received no gradient in this backward, so their "
            "buckets could not be all-reduced and no .grad was averaged. If a forward may "
            "leave some parameters unused (or some outputs out of the loss), construct "
            "MiniDDP(..., find_unused_parameters=True)."
        )

    def unready_names(self) -> list[str]:
        return [name for b in self.buckets for name in b.unready_names()]

    def abandon_unfinished_backward(self) -> list[str]:
        """Forget a backward that began and never ended; the names that got no gradient."""
        missing = self.unready_names()
        for bucket in self.buckets:
            bucket.reset()
        self._next_to_launch = 0
        self.backward_started = self._end_of_pass_queued = False
        return missing

    # --------------------------------------------------------------- layers
    @property
    def layers(self) -> list[type[Layer]]:
        """The features stacked on the plain path, bottom first."""
        return list(self._layers)

    def add_layer(self, layer: type[Layer], **settings: Any) -> None:
        """Stack ``layer`` (a class of :mod:`minddp.features`) on this reducer, with its ``settings``.

        From now on its steps run first and reach the plain ones through
        ``super()``; where it sits among the others is its ``height``.
        """
        if layer in self._layers:
            return
        self.__class__ = _stacked(tuple(sorted(self._layers + (layer,), key=lambda k: k.height)))
        layer.attach(self, **settings)

    def remove_layer(self, layer: type[Layer]) -> None:
        if layer not in self._layers:
            return
        self.__class__ = _stacked(tuple(k for k in self._layers if k is not layer))
        layer.detach(self)

@functools.lru_cache(maxsize=None)
def _stacked(layers: tuple[type[Layer], ...]) -> type[Reducer]:
    """The class of a reducer with these layers (lowest first): the highest first in the method
    order, the plain path last. One class per set of layers."""
    if not layers:
        return Reducer
    name = "+".join(["Reducer"] + [layer.__name__ for layer in layers])
    return type(name, tuple(reversed(layers)) + (Reducer,), {"_layers": layers, "__module__": __name__})
