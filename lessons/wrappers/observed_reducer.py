"""Lesson 07c, step 8: every event of the path told to one observer, and buckets rebuilt in another order.

``observer`` hears each step (a gradient ready, a bucket filled, launched,
reduced, written; the backward over) and does nothing by default: what only
watches (a timeline, a followed gradient) and what acts between backwards
(the learned bucket order, which calls ``rebuild`` at the end of the first
backward) are observers, outside the reducer. The next and last step is the
library's ``minddp/ddp/core/reducer.py``: buckets given whole, built again
for another part, and the setters the parts outside use.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import minddp.ddp.core.messages as messages
from minddp.ddp.core.assignment import MiB, TensorSpec, bucket_groups, first_guess_limits
from minddp.ddp.core.buckets import Bucket, BucketStorage
from minddp.ddp.core.reducer import ReducerOptions
from minddp.ddp.core.slots import Communication, GradientTransfer, Observer, Observers, Readiness
from minddp.ddp.core.weak_hooks import after_accumulation

_engine = torch.autograd.Variable._execution_engine


class BackwardPhase(enum.Enum):
    """Where the reducer is, from the end of a synchronized forward to the end of its backward.

    ::

        IDLE ──prepare_for_backward──> ARMED ──first hook──> REDUCING ──finish_backward──> IDLE
                                                               │  ^
                                       a nested pass ended,    v  │ the next hook
                                       buckets still to come  BETWEEN_PASSES

    A forward inside ``no_sync()`` (or without grad) leaves it IDLE: the
    hooks see IDLE and let the gradients accumulate.
    """

    IDLE = "idle"  # no averaging backward armed: hooks do nothing
    ARMED = "armed"  # a synchronized forward ended: its backward averages; no hook yet
    REDUCING = "reducing"  # hooks fire; the end-of-pass callback is queued on autograd's engine
    # [Note: nested passes] A reentrant activation checkpoint runs a backward
    # pass of its own inside a node of the outer one; its hooks come first,
    # and its end runs the queued callback. If buckets are still to come, the
    # backward is not over: the outer pass goes on, and its next hook queues
    # the callback again (BETWEEN_PASSES -> REDUCING), there.
    BETWEEN_PASSES = "between passes"

    @property
    def in_backward(self) -> bool:
        """Has this backward's first hook fired (and its end not yet come)?"""
        return self in (BackwardPhase.REDUCING, BackwardPhase.BETWEEN_PASSES)


# ------------------------------------------------------------- the plain parts
class EveryHookReady(Readiness):
    """Readiness, plain: a parameter is ready at its hook (every parameter gets exactly one per backward)."""

    used_on_some_rank: list[bool] | None = None  # None: every parameter had a gradient

    def prepare_for_backward(self, reducer: Reducer, output: Any) -> None: ...  # after a synchronized forward
    def backward_ending(self, reducer: Reducer) -> None: ...  # before the check that every bucket was launched
    def shadow_backward(self, reducer: Reducer) -> None: ...  # a joined rank's stand-in: beyond the buckets

    def is_ready(self, reducer: Reducer, index: int) -> bool:
        return True


class CopyGradients(GradientTransfer):
    """Gradients in and out, plain: one batched copy into the complete bucket, one batched copy back."""

    def buckets_built(self, reducer: Reducer) -> None: ...  # the buckets were (re)built
    def gradient_ready(self, bucket: Bucket, position: int, param: nn.Parameter) -> None: ...  # the copy waits

    def fill_bucket(self, bucket: Bucket, scale: float) -> None:
        """Every gradient of a complete bucket into its slot, times ``scale`` (1/N)."""
        bucket.copy_in([p.grad for p in bucket.params], bucket.views, scale)

    def write_grads(self, bucket: Bucket, used: list[bool] | None) -> None:
        """The averages (the bucket has arrived) into ``.grad``."""
        torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)


class AllReduce(Communication):
    """Communication, plain: sum the bucket over the ranks, asynchronously (it holds gradients times 1/N)."""

    divides_first = True  # the reducer scales gradients by 1/N before the sum
    comm_hook = None  # no comm hook registered (minddp.ddp.parts.comm_hook)

    def __init__(self, process_group: dist.ProcessGroup):
        self.process_group = process_group
        self.alone = dist.get_world_size(process_group) == 1

    def communicate(self, bucket: Bucket) -> torch.futures.Future:
        """Start summing the bucket over the ranks; a future of the summed buffer."""
        if self.alone:  # nothing to add: the buffer is the average already
            done = torch.futures.Future()
            done.set_result(bucket.buffer)
            return done
        return dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True).get_future()


class ObservedReducer:
    """Averages the gradients of ``params`` over ``process_group`` during backward, through its parts."""

    def __init__(self, params: list[nn.Parameter], names: list[str], process_group: dist.ProcessGroup,
                 options: ReducerOptions, *, readiness: Readiness | None = None,
                 gradients: GradientTransfer | None = None, communication: Communication | None = None):
        self.params, self.names, self.options = params, names, options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.device = params[0].device
        self.readiness: Readiness = readiness or EveryHookReady()
        self.gradients: GradientTransfer = gradients or CopyGradients()
        self.communication: Communication = communication or AllReduce(process_group)
        self.observer: Observer = Observers.of(())  # told every event of the path (add_observer)
        self.average_over(self.world_size)  # join() may lower it
        self.phase = BackwardPhase.IDLE
        # Set with ARMED: did that forward run inside a backward pass? [Note: forward inside backward]
        # A reentrant checkpoint around the whole model runs its forward without grad, then again
        # inside the backward, where it arms this reducer: the pass it starts is the whole backward.
        self.armed_inside_backward = False
        self.backwards_done = 0
        self.buckets_reduced, self.buckets_reduced_logged = 0, None  # last backward's; as of the last forward
        self.due_rebuild: tuple[list[int], int, int | None] | None = None  # (order, caps) at the next forward
        self.storage = BucketStorage()
        self.caps = (int(options.bucket_cap_mb * MiB), int(options.first_bucket_cap_mb * MiB))
        self.per_bucket_caps = [int(cap * MiB) for cap in options.bucket_caps_mb or ()]  # [] unless given
        self.first_guess_limits = first_guess_limits(self.caps, self.per_bucket_caps, options)
        self._build_buckets(None if options.learn_bucket_order else list(reversed(range(len(params)))))  # 1st guess
        after_accumulation(self._autograd_hook, params, with_index=True)  # fires after p.grad is accumulated

    def _build_buckets(self, order: list[int] | None) -> None:
        """(Re)build the buckets for parameter indices in expected-arrival ``order``, by ``caps``; ``None``:
        torch's first guess, before a backward has shown the order (:mod:`minddp.ddp.core.assignment`)."""
        dtypes = [self.options.reduce_dtype or p.dtype for p in self.params]  # what each gradient is reduced in
        specs = [TensorSpec(p.numel(), dtype.itemsize, dtype, self.device) for p, dtype in zip(self.params, dtypes)]
        groups = bucket_groups(specs, order, self.caps, self.per_bucket_caps, self.first_guess_limits)
        room = self.gradients.room_after_gradients
        self.buckets = [Bucket(k, [self.params[i] for i in group], [self.names[i] for i in group], group,
                               dtypes[group[0]], self.storage, room(k, len(groups), dtypes[group[0]]))
                        for k, group in enumerate(groups)]
        # The plan every hook follows, worked out once here instead of at every
        # gradient: parameter index -> (its bucket, its position there).
        self._plan: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for position, i in enumerate(bucket.indices):
                self._plan[i] = (bucket, position)
        self._next_to_launch = 0
        self.gradients.buckets_built(self)

    # ------------------------------------------------------- at every forward
    def prepare_for_backward(self, output: Any) -> None:
        """Arm the reducer: the next backward averages. Called at the end of a synchronized forward, with
        its output (where unused parameters are searched for)."""
        if self.phase is BackwardPhase.IDLE:
            self.phase = BackwardPhase.ARMED
        self.armed_inside_backward = torch._C._current_graph_task_id() != -1
        if self.backwards_done:  # torch's logger records the last backward's count at a synchronized forward
            self.buckets_reduced_logged = self.buckets_reduced
        self.observer.forward_done()
        self.readiness.prepare_for_backward(self, output)

    # ------------------------------------------------ the path of a gradient
    def _autograd_hook(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate hook of ``params[index]``: its ``.grad`` is final for this backward."""
        phase = self.phase
        if phase is BackwardPhase.IDLE:
            return  # inside no_sync(): the gradient just accumulates
        if phase is not BackwardPhase.REDUCING:  # the first hook of this backward (or of a pass: _on_pass_end)
            if phase is BackwardPhase.ARMED:
                self.observer.backward_started()
            _engine.queue_callback(self._on_pass_end)
            self.phase = BackwardPhase.REDUCING
        self.observer.gradient_ready(index, param)
        self.gradients.gradient_ready(*self._plan[index], param)
        if self.readiness.is_ready(self, index):
            self.mark_ready(index)

    def mark_ready(self, index: int) -> None:
        """Count ``params[index]`` ready in its bucket; the copy waits until the bucket is complete."""
        bucket, position = self._plan[index]
        if bucket.mark_ready_at(position):
            self.bucket_ready(bucket)

    def bucket_ready(self, bucket: Bucket) -> None:
        """Its gradients into the bucket, then launch every complete bucket, strictly in bucket order:
        a bucket complete early waits for the ones before it, so every rank issues the same
        all-reduces in the same order."""
        self.gradients.fill_bucket(bucket, self.scale)
        self.observer.bucket_filled(bucket, self.scale)
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            self.launch(self.buckets[self._next_to_launch])
            self._next_to_launch += 1

    def launch(self, bucket: Bucket) -> None:
        """Start ``bucket``'s communication (it is complete, and every bucket before it has left)."""
        self.observer.bucket_launching(bucket)
        bucket.launch(self.communication.communicate)
        self.observer.bucket_launched(bucket)

    # ------------------------------------------------------ end of backward
    def _on_pass_end(self) -> None:
        """Autograd finished a pass that delivered gradients: is the backward over?

        Usually yes. But see [Note: nested passes] (``BackwardPhase``): a pass
        nested in the outer one that ends with buckets still to come leaves the
        backward BETWEEN_PASSES. A pass that is outermost (no autograd node
        running), or the only pass of a forward that itself ran inside a
        backward ([Note: forward inside backward], ``__init__``), ends it.
        """
        if (self._next_to_launch == len(self.buckets) or self.armed_inside_backward
                or torch._C._current_autograd_node() is None):
            self.finish_backward()  # returned first: no frame of it holds a bucket while the observers act
            self.observer.after_backward()
        else:
            self.phase = BackwardPhase.BETWEEN_PASSES

    def finish_backward(self) -> None:
        """Every bucket launched? Then wait for each, write ``.grad``, and be ready for the next backward."""
        self.phase = BackwardPhase.IDLE
        self.readiness.backward_ending(self)
        if self._next_to_launch < len(self.buckets):
            raise self.missing_gradients_error()
        self.observer.backward_ending()
        for bucket in self.buckets:
            self._wait_for(bucket)
            self.observer.bucket_reduced(bucket)
            self.gradients.write_grads(bucket, self.readiness.used_on_some_rank)
            self.observer.grads_written(bucket)
            bucket.reset()
        self._next_to_launch = 0
        self.backwards_done += 1
        self.buckets_reduced = len(self.buckets)
        self.observer.backward_done()

    def _wait_for(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s sum; a timeout names the bucket that never came, and why."""
        try:
            bucket.wait()
        except RuntimeError as error:
            if not messages.is_timeout(error):
                raise
            said = messages.bucket_never_arrived(self, bucket, error)
            self.abandon_unfinished_backward()
            raise RuntimeError(said) from error

    def missing_gradients_error(self) -> RuntimeError:
        """Forget the unfinished backward; the error that names the parameters that got no gradient."""
        missing = self.abandon_unfinished_backward()
        return RuntimeError(messages.missing_gradients(self, missing))

    def abandon_unfinished_backward(self) -> list[str]:
        """Forget a backward that began and never ended; the names that got no gradient."""
        missing = [name for b in self.buckets for name in b.unready_names()]
        for bucket in self.buckets:
            bucket.reset()
        self._next_to_launch = 0
        self.phase = BackwardPhase.IDLE
        return missing

    # ------------------------------------------ what the parts outside change
    def average_over(self, ranks: int) -> None:
        """Average over ``ranks`` ranks (the world; fewer under ``join()``): gradients are multiplied by
        ``1/ranks`` before the sum, unless the communication averages itself (a comm hook)."""
        self.divisor = ranks
        self.scale = 1.0 / ranks if self.communication.divides_first else 1.0

    def add_observer(self, observer: Observer) -> None:
        """Tell ``observer`` every event of the path from now on (after those added before)."""
        if observer not in tuple(self.observers):
            self.observer = Observers.of((*self.observers, observer))

    def remove_observer(self, observer: Observer) -> None:
        self.observer = Observers.of(tuple(o for o in self.observers if o is not observer))

    @property
    def observers(self) -> tuple[Observer, ...]:
        """Who is told the events, in order."""
        return tuple(self.observer) if isinstance(self.observer, Observers) else ()

    @property
    def bucket_order(self) -> list[int]:
        """Parameter indices in the order the buckets hold them."""
        return [i for bucket in self.buckets for i in bucket.indices]

    def rebuild(self, order: list[int], cap_bytes: int, first_cap_bytes: int | None) -> None:
        """Bucket the parameters anew, indices in expected-arrival ``order``, with these caps, at the next
        synchronized forward (:meth:`rebuild_if_due`), as torch does: by then ``zero_grad()`` has let go
        of the last backward's ``.grad``, which with bucket views are slots of the old buckets, so the old
        and the new are not alive together. The same arguments on every rank (the caller broadcasts its
        decision): buckets keep the ranks' collectives matched."""
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"Reducer.rebuild needs every parameter index once, got {order}")
        self.due_rebuild = (order, cap_bytes, first_cap_bytes)

    def rebuild_if_due(self) -> bool:
        """Rebuild now if a rebuild is due (torch's ``reducer._rebuild_buckets()``); whether it did."""
        if self.due_rebuild is None:
            return False
        order, *caps = self.due_rebuild
        self.due_rebuild, self.caps = None, tuple(caps)
        self._build_buckets(order)
        return True
