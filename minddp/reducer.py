"""The path of a gradient, from autograd's hook to the averaged ``.grad``.

``MiniDDP`` (:mod:`minddp.ddp`) wraps the module; this :class:`Reducer` does
the averaging, as torch splits ``DistributedDataParallel`` (Python) from its
``Reducer`` (C++). Top to bottom in this file::

    loss.backward()
      autograd accumulates p.grad
        └─ on_grad_ready(i, p)            post-accumulate hook, one per parameter
             mark p ready in its bucket (where: looked up once, in _plan[i]);
             bucket complete?
               ─> _fill_bucket(): every p.grad / world_size into its slot,
                  one call for the bucket (in place where p.grad *is* its
                  slot: gradient_as_bucket_view)
               ─> _launch_ready_buckets(): async all_reduce, strictly in
                  bucket order
      end of the backward pass
        └─ _on_backward_pass_end()        callback queued on the autograd engine
             └─ _finish_backward()
                  _account_for_missing_gradients   (zeros, or an error naming them)
                  wait for every bucket
                  _write_averages_into_grads
                  backward_done_callbacks: policies above may rebuild
                  the buckets (after the first backward, in the order
                  gradients arrived: minddp.bucket_order; and
                  bucket_cap_mb="auto": minddp.bucket_planner)

The buckets themselves are in :mod:`minddp.bucket_assignment` (which
parameters share one) and :mod:`minddp.buckets` (a flat buffer and its life
cycle); what "communicate" means (all-reduce, or a compressed one) in
:mod:`minddp.comm_hooks`.

What code above the reducer may call (mechanism here, policy there) is in
:mod:`minddp.reducer_hooks`: the arrival log, ``rebuild``, the
backward-done callbacks, bucket storage, a passenger in the last bucket.
The learned bucket order (:mod:`minddp.bucket_order`),
``bucket_cap_mb="auto"`` (:mod:`minddp.bucket_planner`), ZeRO stage 2 and
``buffer_sync="with_gradients"`` are built on them.

Why dividing *before* summing: the sum of N half-precision gradients can
overflow where their average would not.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from minddp.bucket_assignment import FIRST_BUCKET_CAP_MB, MiB, TensorSpec, assign_buckets
from minddp.buckets import Bucket
from minddp.comm_hooks import GradBucket
from minddp.reducer_hooks import ReducerHookPoints
from minddp.trace import StepObserver, profiler_range

__all__ = ["FIRST_BUCKET_CAP_MB", "ReducerOptions", "Reducer"]

_graph_task_id = torch._C._current_graph_task_id  # which autograd pass is running (a private torch API)


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

    (What policies above may call, the hook points, is in
    :class:`~minddp.reducer_hooks.ReducerHookPoints`; this class is the path.)
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], process_group: dist.ProcessGroup,
                 options: ReducerOptions, observer: StepObserver):
        self.params, self.names, self.options = params, names, options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.device = params[0].device
        self.observer = observer
        self._index = {p: i for i, p in enumerate(params)}
        self._sparse_dim: dict[int, int] = {}  # parameters whose gradients came sparse
        self._init_hook_points(int(options.bucket_cap_mb * MiB), int(FIRST_BUCKET_CAP_MB * MiB),
                               [int(cap * MiB) for cap in options.bucket_caps_mb or ()])
        self._offered: set[int] = set()  # buckets waited for and offered to bucket_reduced_hook, this backward
        self._reclaimed: set[int] = set()  # ... of which the hook took the result (no .grad to write)
        # Buckets, in the order gradients are expected: reverse registration.
        self._build_buckets(list(reversed(range(len(params)))))
        self._static_graph = options.static_graph  # read by every hook: one attribute, not two
        for i, p in enumerate(params):  # fires after p.grad has been accumulated
            p.register_post_accumulate_grad_hook(functools.partial(self.on_grad_ready, i))

        self.sync_this_backward = False  # set at each forward
        # Also set at each synchronized forward: did it run inside a backward
        # pass? A reentrant checkpoint around the whole wrapped model
        # recomputes its forward there, and then every gradient of that
        # forward comes from the one nested pass that follows.
        self.forward_inside_backward = False
        self.unused: list[nn.Parameter] = []  # no gradient will come for these (graph walk, static graph)
        self.divisor = self.world_size  # what each gradient is divided by before the sum (join changes it)
        self.backward_started = False
        self.backwards_done = 0
        self.comm_hook: tuple[Any, Callable] | None = None
        self._watched_passes: set[int] = set()  # autograd passes whose end we are told of
        self._pass_now: int | None = None  # the pass the last hook fired in
        self._tracing = observer.tracer is not None  # per-gradient trace events
        self._locally_used = [True] * len(params)
        # Per parameter, did the last synchronized backward see a gradient on some rank?
        # None: all did (without find_unused_parameters a missing one is an error).
        self.globally_used: list[bool] | None = None
        self._hooks_seen = [0] * len(params)  # this backward, per parameter (static_graph)
        self._hooks_expected: list[int] | None = None  # learned by static_graph's first backward
        self._static_used: list[bool] | None = None  # ... and which parameters some rank uses

    def _build_buckets(self, order: list[int]) -> None:
        """(Re)build the buckets for parameter indices in expected-arrival ``order``."""
        specs = [self._bucket_spec(self.params[i]) for i in order]
        groups = assign_buckets(specs, *self._caps, per_bucket_caps=self._per_bucket_caps)
        last_dtype = specs[groups[-1][0]].dtype
        self._passenger_fits = self.passenger is not None and self.passenger.fits(last_dtype)
        self.buckets = [
            Bucket(k, [self.params[order[j]] for j in group], [self.names[order[j]] for j in group],
                   dtype=specs[group[0]].dtype, storage=self._storage,
                   extra_numel=self.passenger.numel if self._passenger_fits and k == len(groups) - 1 else 0)
            for k, group in enumerate(groups)
        ]
        # The plan every hook follows, worked out once here instead of at
        # every gradient: parameter index -> (its bucket, its position there).
        self._plan: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        self._indices: list[list[int]] = []  # per bucket, its parameters' indices
        for bucket in self.buckets:
            self._indices.append([self._index[p] for p in bucket.params])
            for position, i in enumerate(self._indices[-1]):
                self._plan[i] = (bucket, position)
        self._next_to_launch = 0
        # Parameters whose .grad becomes their slot (bucket views, same dtype).
        self._as_view = [self._grad_is_slot_view(i, self._plan[i][0].dtype) for i in range(len(self.params))]
        for i, p in enumerate(self.params):  # gradients kept across a rebuild move into their new slots
            if p.grad is not None and self._as_view[i]:
                p.grad = self._slot(i).copy_(p.grad)

    def _slot(self, index: int) -> torch.Tensor:
        bucket, position = self._plan[index]
        if bucket.buffer is None:  # a storage that lends buffers: the bucket's first use this backward
            bucket.acquire()
        return bucket.views[position]

    def _bucket_spec(self, p: nn.Parameter) -> TensorSpec:
        dtype = self.options.reduce_dtype or p.dtype
        return TensorSpec(p.numel(), dtype.itemsize, dtype, p.device)

    def _grad_is_slot_view(self, index: int, bucket_dtype: torch.dtype) -> bool:
        """Should ``params[index].grad`` *be* its bucket slot? Only with bucket
        views, a dense gradient, and a bucket in the parameter's own dtype."""
        return (self.options.gradient_as_bucket_view and bucket_dtype == self.params[index].dtype
                and index not in self._sparse_dim)

    # -------------------------------------------------- the path of a gradient
    def on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate hook of ``params[index]``: its ``.grad`` is final for this backward.

        Runs once per parameter per step, so where to go is looked up, not
        worked out (``_plan``, built with the buckets), and a gradient that
        is not its bucket's last costs a few attribute reads and a counter:
        copies and scaling wait for the bucket to be complete
        (:meth:`_fill_bucket`), with one exception below; records are kept
        only when asked for (a tracer, an arrival log).
        """
        if not self.sync_this_backward:
            return
        if not self.backward_started:
            self._begin_backward()
        if (current := _graph_task_id()) != self._pass_now:  # usually the same pass as the last hook
            self._call_at_end_of(current)
        if self._static_graph and not self._last_expected_hook(index):
            return  # more of this parameter's gradient is still to come
        if self._recording:  # the first backward (learned order), or asked for from above
            self.arrival_log.append((index, time.perf_counter()))
        if self._tracing:
            self.observer.gradient_ready(self.names[index], param.grad)
        bucket, position = self._plan[index]
        if self._as_view[index] and (grad := param.grad) is not None and not grad.is_sparse:
            if bucket.buffer is None:  # a storage that lends buffers: the bucket's first use this backward
                bucket.acquire()
            if grad is not (slot := bucket.views[position]):
                # gradient_as_bucket_view after zero_grad(set_to_none=True):
                # autograd made a fresh .grad. Into its slot now, so its memory
                # goes back at once, not when the whole bucket is complete (as
                # torch's reducer; batching these copies per bucket measured no
                # faster, and held up to a bucket of gradients twice).
                param.grad = slot.copy_(grad)
        if bucket.mark_ready_at(position):
            self._bucket_complete(bucket)

    def _begin_backward(self) -> None:
        self.backward_started = True
        self.observer.backward_started()
        self._watched_passes = set()
        self._pass_now = None
        self._locally_used = [True] * len(self.params)
        self._hooks_seen = [0] * len(self.params)
        self.arrival_log = []  # only this backward's order counts (an earlier one may have failed)
        for p in self.unused:  # no gradient will come for these: count them now
            self._mark_ready(self._index[p])

    def _call_at_end_of(self, current: int) -> None:
        # An activation checkpoint with use_reentrant=True runs a second,
        # nested backward pass inside the first, and its hooks fire in there.
        # So we ask to be called at the end of *every* pass a gradient came
        # from (not only the first one's), and decide then.
        self._pass_now = current
        if current not in self._watched_passes:
            self._watched_passes.add(current)
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_pass_end)

    def _last_expected_hook(self, index: int) -> bool:
        self._hooks_seen[index] += 1
        if self._hooks_expected is None:
            return False  # static_graph's first backward: count only, reduce everything at its end
        if self._hooks_seen[index] > self._hooks_expected[index]:
            raise RuntimeError(
                f"MiniDDP(static_graph=True): Your training graph has changed in this iteration: parameter "
                f"{self.names[index]!r} got gradient {self._hooks_seen[index]} time(s), where the first "
                f"iteration gave it {self._hooks_expected[index]} (e.g. a parameter unused in the first "
                "iteration is used now). This is not compatible with static_graph set to True: construct "
                "MiniDDP(..., find_unused_parameters=True) without static_graph for a graph that changes.")
        return self._hooks_seen[index] == self._hooks_expected[index]

    def _mark_ready(self, index: int) -> None:
        bucket, position = self._plan[index]
        if bucket.mark_ready_at(position):
            self._bucket_complete(bucket)

    def _bucket_complete(self, bucket: Bucket) -> None:
        self.observer.bucket_complete()
        self._fill_bucket(bucket)
        self._launch_ready_buckets()

    def _fill_bucket(self, bucket: Bucket) -> None:
        """Every gradient of a complete bucket into its slot, scaled by 1/N.

        Average = sum of (g / N): dividing before the sum keeps low precision
        from overflowing, and multiplying by 1/N is what torch's reducer does
        (so results are bit-equal to its). A comm hook does its own averaging.
        Done once per bucket, when its last gradient is in (it could not leave
        earlier anyway), so the work can be batched: :meth:`Bucket.copy_in`.
        """
        scale = 1.0 if self.comm_hook is not None else 1.0 / self.divisor
        bucket.acquire()
        copies, slots, copied = [], [], []
        for index, param, slot in zip(self._indices[bucket.index], bucket.params, bucket.views):
            grad = param.grad
            if grad is slot:  # .grad already lives in the bucket (gradient_as_bucket_view)
                pass
            elif grad is None:  # unused here (but maybe used on another rank): contributes zero
                self._locally_used[index] = False
                slot.zero_()
            elif grad.is_sparse:  # densified: every row travels, touched or not
                self._sparse_dim[index] = grad.sparse_dim()
                slot.zero_().add_(grad)
            else:  # a copy (a cast, with reduce_dtype)
                copies.append(param)
                slots.append(slot)
                copied.append(index)
        bucket.copy_in([p.grad for p in copies], slots, scale)
        if bucket.extra_numel:  # the last bucket, with room for the passenger
            if self.carry_passenger:
                self.passenger.pack(bucket.tail)
            else:
                bucket.tail.zero_()
        if self.options.gradient_as_bucket_view:
            for index, param, slot in zip(copied, copies, slots):  # only now: .grad held the gradient until the copy
                if self._as_view[index]:  # e.g. after zero_grad(set_to_none=True)
                    param.grad = slot

    def _launch_ready_buckets(self) -> None:
        # Strict bucket order: a ready bucket waits for the ones before it, so
        # every rank issues the same all-reduces in the same order.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].ready:
            bucket = self.buckets[self._next_to_launch]
            launched = time.perf_counter()
            with profiler_range(f"minddp.launch_bucket_{bucket.index}"):
                bucket.launch(self._communicate)
            self.observer.bucket_launched(bucket.index, bucket.buffer.nbytes, launched, bucket.future)
            self._next_to_launch += 1
        if not self._storage.keep_buffers:
            self._reclaim_finished_buckets()

    def _reclaim_finished_buckets(self) -> None:
        """Buffers lent by the storage go back as soon as their result is taken (not at the end of backward)."""
        for bucket in self.buckets[: self._next_to_launch]:
            if bucket.index not in self._offered and bucket.future is not None and bucket.future.done():
                bucket.wait()
                self._hand_over(bucket)

    def _hand_over(self, bucket: Bucket) -> bool:
        """Offer a reduced bucket to the ``bucket_reduced_hook`` (once per backward); True if taken
        (then its buffer may go back; declined, ``.grad`` is written from it at the end of backward)."""
        if bucket.index in self._offered:
            return bucket.index in self._reclaimed
        self._offered.add(bucket.index)
        if self.bucket_reduced_hook is None or not self.bucket_reduced_hook(GradBucket(bucket, len(self.buckets))):
            return False
        self._reclaimed.add(bucket.index)
        if not self._storage.keep_buffers:
            bucket.release()
        return True

    def _communicate(self, bucket: Bucket) -> torch.futures.Future:
        if self.comm_hook is None:
            if self.world_size == 1:  # nothing to add up: the buffer is the average already
                done = torch.futures.Future()
                done.set_result(bucket.buffer)
                return done
            return dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True).get_future()
        state, hook = self.comm_hook
        future = hook(state, GradBucket(bucket, len(self.buckets)))
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and what collectives return
            raise RuntimeError(f"MiniDDP's comm hook {getattr(hook, '__name__', hook)!r}: callback must return a "
                            f"torch.futures.Future object, but got {type(future).__name__}")
        return future

    def _on_backward_pass_end(self) -> None:
        """Autograd finished a pass that delivered gradients: is the backward over?"""
        if not self.backward_started:
            return  # an earlier pass's callback already finished this backward
        if self._next_to_launch == len(self.buckets):
            self._finish_backward()  # every gradient is in, whichever pass this was
        elif torch._C._current_autograd_node() is None or self.forward_inside_backward:
            self._finish_backward()  # the outermost pass ended (or this forward's only pass): what is missing stays missing
        # else: a nested (reentrant checkpoint) pass ended inside a node of the
        # outer pass, which goes on and will deliver the remaining gradients.

    def _finish_backward(self) -> None:
        """End of backward: account for missing gradients, wait for every bucket, write ``.grad``."""
        self.backward_started = False
        self._account_for_missing_gradients()
        with profiler_range("minddp.wait_buckets"):
            for bucket in self.buckets:
                if bucket.index not in self._offered:
                    bucket.wait()
        if self._passenger_fits and self.carry_passenger:
            self.passenger.receive(self.buckets[-1].tail)
            self.passenger_arrived = True
        self.globally_used = self._globally_used()
        self._write_averages_into_grads(self.globally_used)
        self.observer.backward_done()
        self.backwards_done += 1
        self._reset_buckets()
        for callback in list(self.backward_done_callbacks):  # a callback may remove itself
            callback()

    def _account_for_missing_gradients(self) -> None:
        if self.options.static_graph and self._hooks_expected is None:
            # static_graph's first backward: now we know how many hooks each
            # parameter gets; parameters that got none count as zero, always.
            self._hooks_expected = list(self._hooks_seen)
            self.unused = [p for p, n in zip(self.params, self._hooks_expected) if n == 0]
            self._mark_all_unready()
        if self.options.find_unused_parameters:
            # Reached by the graph walk but no gradient came (an output not in
            # the loss): zero as well, in bucket order like every other launch.
            self._mark_all_unready()
        if self._next_to_launch == len(self.buckets):
            return  # every bucket complete and launched: nothing is missing
        missing = self.unready_names()
        if missing and self._static_graph:
            self._reset_buckets()
            raise RuntimeError(
                "MiniDDP(static_graph=True): Expected to have finished reduction in the prior iteration "
                "before starting a new one. This error indicates that your training graph has changed in "
                "this iteration, e.g., one parameter is used in first iteration, but then got unused in the "
                "second iteration. this is not compatible with static_graph set to True.\n"
                f"Parameters which did not receive grad: {missing}")
        if missing:
            self._reset_buckets()
            raise RuntimeError(
                f"MiniDDP: parameters {missing} received no gradient in this backward, so their "
                "buckets could not be all-reduced and no .grad was averaged. If a forward may "
                "leave some parameters unused (or some outputs out of the loss), construct "
                "MiniDDP(..., find_unused_parameters=True)."
            )

    def _mark_all_unready(self) -> None:
        for bucket in self.buckets:
            for p in bucket.unready_params():
                self._mark_ready(self._index[p])

    def _write_averages_into_grads(self, globally_used: list[bool] | None) -> None:
        for bucket in self.buckets:
            if self._hand_over(bucket):
                continue
            grads, slots = [], []  # dense same-dtype copies: one call per bucket (see _fill_bucket)
            for index, p, slot in zip(self._indices[bucket.index], bucket.params, bucket.views):
                if globally_used is not None and not globally_used[index]:
                    continue  # unused on every rank: .grad stays as it was (None stays None)
                if p.grad is slot:
                    continue  # gradient_as_bucket_view: the average is already in .grad
                if index in self._sparse_dim:
                    p.grad = slot.to(p.dtype).to_sparse(self._sparse_dim[index])
                elif self._as_view[index]:
                    p.grad = slot
                elif p.grad is None:
                    p.grad = slot.to(p.dtype, copy=True)
                elif p.grad.dtype == slot.dtype:
                    grads.append(p.grad)
                    slots.append(slot)
                else:
                    p.grad.copy_(slot)
            if grads:
                torch._foreach_copy_(grads, slots)

    def _globally_used(self) -> list[bool] | None:
        """Which parameters got a gradient on some rank (the others keep their ``.grad``, None stays None)."""
        if self._static_graph:
            if self._static_used is None:  # learned once, by the first backward; the graph does not change
                self._static_used = self._used_on_any_rank([n > 0 for n in self._hooks_expected or self._hooks_seen])
            return self._static_used
        if not self.options.find_unused_parameters:
            return None  # every parameter produced a gradient, or we raised above
        if self.options.skip_all_reduce_unused_params and self.globally_used is not None:
            return self.globally_used  # promised: the same parameters unused on every rank, every step
        return self._used_on_any_rank(self._locally_used)

    def _used_on_any_rank(self, used_here: list[bool]) -> list[bool]:
        used = torch.tensor(used_here, dtype=torch.int32, device=self.device)
        dist.all_reduce(used, group=self.process_group)
        return [bool(u) for u in used.tolist()]

    def unready_names(self) -> list[str]:
        return [name for b in self.buckets for name in b.unready_names()]

    def _reset_buckets(self) -> None:
        self._offered, self._reclaimed = set(), set()
        for bucket in self.buckets:
            bucket.reset()
        self._next_to_launch = 0
        self.backward_started = False

    def abandon_unfinished_backward(self) -> list[str]:
        """Forget a backward that began and never ended; the names that got no gradient."""
        missing = self.unready_names()
        self._reset_buckets()
        return missing

    # ---------------------------------------------------------- uneven inputs
    def shadow_backward(self) -> None:
        """A joined rank's stand-in for a backward: the same collectives, contributing zeros."""
        for bucket in self.buckets:
            bucket.acquire()
            bucket.buffer.zero_()
            bucket.launch_unconditionally(self._communicate)
            bucket.wait()
            bucket.reset()
            if not self._storage.keep_buffers:
                bucket.release()
        if self.options.find_unused_parameters or (self._static_graph and self._static_used is None):
            self._locally_used = [False] * len(self.params)
            self._hooks_seen = [0] * len(self.params)
            self.globally_used = self._globally_used()
        self.arrival_log = []  # nothing arrived here; the step still counts, as on the other ranks
        for callback in list(self.backward_done_callbacks):
            callback()
