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
                  after the first: buckets rebuilt in arrival order;
                  with bucket_cap_mb="auto", after a few more: rebuilt
                  with the cap the measured network asks for

The buckets themselves (a flat buffer and its life cycle) are in
:mod:`minddp.buckets`; what "communicate" means (all-reduce, or a compressed
one) in :mod:`minddp.comm_hooks`.

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

from minddp.bucket_planner import AutoBuckets
from minddp.buckets import FIRST_BUCKET_CAP_MB, MiB, Bucket, TensorSpec, assign_buckets
from minddp.comm_hooks import GradBucket
from minddp.sync import global_rank
from minddp.trace import StepObserver, profiler_range

__all__ = ["FIRST_BUCKET_CAP_MB", "ReducerOptions", "Reducer"]

# Above this mean size (elements), a bucket's gradients are copied and scaled
# one by one in a single fused pass each; below, in two batched calls.
LARGE_GRADIENT_NUMEL = 64 * 1024


@dataclass(frozen=True)
class ReducerOptions:
    """How gradients are bucketed and reduced (MiniDDP's arguments of the same names)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    reduce_dtype: torch.dtype | None = None
    learn_bucket_order: bool = True
    auto_buckets: bool = False  # bucket_cap_mb="auto": start at bucket_cap_mb, then choose (bucket_planner)


class Reducer:
    """Averages the gradients of ``params`` over ``process_group`` during backward."""

    def __init__(self, params: list[nn.Parameter], names: list[str], process_group: dist.ProcessGroup,
                 options: ReducerOptions, observer: StepObserver):
        self.params, self.names, self.options = params, names, options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.device = params[0].device
        self.observer = observer
        self._index = {p: i for i, p in enumerate(params)}
        self._sparse_dim: dict[int, int] = {}  # parameters whose gradients came sparse
        self._caps = (int(options.bucket_cap_mb * MiB), int(FIRST_BUCKET_CAP_MB * MiB))  # bytes: cap, first cap
        # Buckets, in the order gradients are expected: reverse registration.
        self._build_buckets(list(reversed(range(len(params)))))
        self._rebuild_after_first_step = options.learn_bucket_order
        self._auto: AutoBuckets | None = None
        if options.auto_buckets and self.world_size > 1:  # alone, there is nothing to plan
            specs = [self._bucket_spec(p) for p in params]
            self._auto = AutoBuckets(names, [s.nbytes for s in specs], [s.dtype for s in specs])
        self._arrival: list[tuple[int, float]] = []  # this backward's (index, perf_counter), while recording
        self._recording = self._rebuild_after_first_step or self._auto is not None
        self._static_graph = options.static_graph  # read by every hook: one attribute, not two
        for i, p in enumerate(params):  # fires after p.grad has been accumulated
            p.register_post_accumulate_grad_hook(functools.partial(self.on_grad_ready, i))

        self.sync_this_backward = False  # set at each forward
        self.unused: list[nn.Parameter] = []  # no gradient will come for these (graph walk, static graph)
        self.divisor = self.world_size  # what each gradient is divided by before the sum (join changes it)
        self.backward_started = False
        self.backwards_done = 0
        self.comm_hook: tuple[Any, Callable] | None = None
        # The one hook point for code beyond DDP (ZeRO stage 2, minddp/zero/stage2.py):
        # called with each bucket once its communication is done, at the end of
        # backward; returning True means "the result is taken care of" and the
        # reducer writes no .grad for that bucket's parameters.
        self._bucket_reduced_hook: Callable[[GradBucket], bool] | None = None
        self._watched_passes: set[int] = set()  # autograd passes whose end we are told of
        self._locally_used = [True] * len(params)
        # Per parameter, did the last synchronized backward see a gradient on some rank?
        # None: all did (without find_unused_parameters a missing one is an error).
        self.globally_used: list[bool] | None = None
        self._hooks_seen = [0] * len(params)  # this backward, per parameter (static_graph)
        self._hooks_expected: list[int] | None = None  # learned by static_graph's first backward

    @property
    def bucket_reduced_hook(self) -> Callable[[GradBucket], bool] | None:
        return self._bucket_reduced_hook

    @bucket_reduced_hook.setter
    def bucket_reduced_hook(self, hook: Callable[[GradBucket], bool] | None) -> None:
        if hook is not None and self._auto is not None:
            raise ValueError(
                "MiniDDP(bucket_cap_mb='auto') rebuilds its buckets after its first measured steps, and "
                "ZeRO stage 2 (shard_gradients=True) partitions gradients by those buckets: give MiniDDP "
                "a fixed bucket_cap_mb to use them together")
        self._bucket_reduced_hook = hook

    # ------------------------------------------------------------------ buckets
    def _build_buckets(self, order: list[int]) -> None:
        """(Re)build the buckets for parameter indices in expected-arrival ``order``."""
        specs = [self._bucket_spec(self.params[i]) for i in order]
        groups = assign_buckets(specs, *self._caps)
        self.buckets = [
            Bucket(k, [self.params[order[j]] for j in group], [self.names[order[j]] for j in group],
                   dtype=specs[group[0]].dtype)
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
        self._as_view = [self._grad_is_slot_view(i, self._slot(i)) for i in range(len(self.params))]
        for i, p in enumerate(self.params):  # gradients kept across a rebuild move into their new slots
            slot = self._slot(i)
            if p.grad is not None and self._grad_is_slot_view(i, slot):
                p.grad = slot.copy_(p.grad)

    def _slot(self, index: int) -> torch.Tensor:
        bucket, position = self._plan[index]
        return bucket.views[position]

    def _bucket_spec(self, p: nn.Parameter) -> TensorSpec:
        dtype = self.options.reduce_dtype or p.dtype
        return TensorSpec(p.numel(), dtype.itemsize, dtype, p.device)

    def _grad_is_slot_view(self, index: int, slot: torch.Tensor) -> bool:
        """Should ``params[index].grad`` *be* its bucket slot? Only with bucket
        views, a dense gradient, and a bucket in the parameter's own dtype."""
        return (self.options.gradient_as_bucket_view and slot.dtype == self.params[index].dtype
                and index not in self._sparse_dim)

    # -------------------------------------------------- the path of a gradient
    def on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate hook of ``params[index]``: its ``.grad`` is final for this backward.

        Runs once per parameter per step, so where to go is looked up, not
        worked out (``_plan``, built with the buckets). Copies and scaling
        wait for the bucket to be complete (:meth:`_fill_bucket`), with one
        exception below.
        """
        if not self.sync_this_backward:
            return
        if not self.backward_started:
            self._begin_backward()
        self._call_at_end_of_this_pass()
        if self._static_graph and not self._last_expected_hook(index):
            return  # more of this parameter's gradient is still to come
        self.observer.gradient_ready(self.names[index], param.grad)
        if self._recording:  # the first backwards: learned order, "auto" measurements
            self._arrival.append((index, time.perf_counter()))
        if self._as_view[index]:
            grad, slot = param.grad, self._slot(index)
            if grad is not None and not grad.is_sparse and grad is not slot:
                # gradient_as_bucket_view after zero_grad(set_to_none=True):
                # autograd made a fresh .grad. Into its slot now, so its memory
                # goes back at once, not when the whole bucket is complete (as
                # torch's reducer; batching these copies per bucket measured no
                # faster, and held up to a bucket of gradients twice).
                param.grad = slot.copy_(grad)
        self._mark_ready(index)

    def _begin_backward(self) -> None:
        self.backward_started = True
        self.observer.backward_started()
        self._watched_passes = set()
        self._locally_used = [True] * len(self.params)
        self._hooks_seen = [0] * len(self.params)
        self._arrival = []  # only this backward's order counts (an earlier one may have failed)
        for p in self.unused:  # no gradient will come for these: count them now
            self._mark_ready(self._index[p])

    def _call_at_end_of_this_pass(self) -> None:
        # An activation checkpoint with use_reentrant=True runs a second,
        # nested backward pass inside the first, and its hooks fire in there.
        # So we ask to be called at the end of *every* pass a gradient came
        # from (not only the first one's), and decide then.
        current = torch._C._current_graph_task_id()
        if current not in self._watched_passes:
            self._watched_passes.add(current)
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_pass_end)

    def _last_expected_hook(self, index: int) -> bool:
        self._hooks_seen[index] += 1
        if self._hooks_expected is None:
            return False  # static_graph's first backward: count only, reduce everything at its end
        return self._hooks_seen[index] == self._hooks_expected[index]

    def _mark_ready(self, index: int) -> None:
        bucket, position = self._plan[index]
        if bucket.mark_ready_at(position):
            self._fill_bucket(bucket)
            self._launch_ready_buckets()

    def _fill_bucket(self, bucket: Bucket) -> None:
        """Every gradient of a complete bucket into its slot, scaled by 1/N.

        Average = sum of (g / N): dividing before the sum keeps low precision
        from overflowing, and multiplying by 1/N is what torch's reducer does
        (so results are bit-equal to its). A comm hook does its own averaging.
        Done once per bucket, when its last gradient is in (it could not leave
        earlier anyway), so the work can be batched; see :meth:`_scale_copies`.
        """
        scale = 1.0 if self.comm_hook is not None else 1.0 / self.divisor
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
        self._scale_copies(bucket, copies, slots, scale)
        if self.options.gradient_as_bucket_view:
            for index, param, slot in zip(copied, copies, slots):  # only now: .grad held the gradient until the copy
                if self._grad_is_slot_view(index, slot):  # e.g. after zero_grad(set_to_none=True)
                    param.grad = slot

    def _scale_copies(self, bucket: Bucket, params: list[nn.Parameter], slots: list[torch.Tensor],
                      scale: float) -> None:
        # Every Python-dispatched tensor operation costs microseconds, every
        # pass over memory costs bytes / bandwidth. Measured on this project's
        # CPU (a 25 MB bucket of 5 MLP gradients; 48 transformer gradients):
        # a fused ``slot = grad * scale`` per gradient is fastest for large
        # gradients (1.0 ms against 1.4), one ``_foreach_copy_`` plus one
        # ``buffer.mul_`` for many small ones (0.08 ms against 0.17).
        grads = [p.grad for p in params]
        large = bool(grads) and sum(g.numel() for g in grads) >= LARGE_GRADIENT_NUMEL * len(grads)
        if not large:
            if grads:
                torch._foreach_copy_(slots, grads)  # casts too, with reduce_dtype
            if scale != 1.0:
                bucket.buffer.mul_(scale)  # the whole bucket: copies, views, zeros, densified
            return
        for grad, slot in zip(grads, slots):
            if scale == 1.0:  # a comm hook averages: a plain copy (casts too)
                slot.copy_(grad)
            elif grad.dtype == slot.dtype:
                torch.mul(grad, scale, out=slot)
            else:  # reduce_dtype: cast first, so the scaling rounds only once
                slot.copy_(grad).mul_(scale)
        if scale != 1.0:  # the rest of the bucket (views, densified sparse) is scaled in place
            copied = {id(slot) for slot in slots}
            for slot in bucket.views:
                if id(slot) not in copied:
                    slot.mul_(scale)

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

    def _communicate(self, bucket: Bucket) -> torch.futures.Future:
        if self.comm_hook is None:
            if self.world_size == 1:  # nothing to add up: the buffer is the average already
                done = torch.futures.Future()
                done.set_result(bucket.buffer)
                return done
            return dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True).get_future()
        state, hook = self.comm_hook
        return hook(state, GradBucket(bucket, len(self.buckets)))

    def _on_backward_pass_end(self) -> None:
        """Autograd finished a pass that delivered gradients: is the backward over?"""
        if not self.backward_started:
            return  # an earlier pass's callback already finished this backward
        if self._next_to_launch == len(self.buckets):
            self._finish_backward()  # every gradient is in, whichever pass this was
        elif torch._C._current_autograd_node() is None:
            self._finish_backward()  # the outermost pass ended: what is missing stays missing
        # else: a nested (reentrant checkpoint) pass ended inside a node of the
        # outer pass, which goes on and will deliver the remaining gradients.

    def _finish_backward(self) -> None:
        """End of backward: account for missing gradients, wait for every bucket, write ``.grad``."""
        self.backward_started = False
        self._account_for_missing_gradients()
        with profiler_range("minddp.wait_buckets"):
            for bucket in self.buckets:
                bucket.wait()
        self.globally_used = self._globally_used()
        self._write_averages_into_grads(self.globally_used)
        self.observer.backward_done()
        self.backwards_done += 1
        self._reset_buckets()
        if self._rebuild_after_first_step:
            self._rebuild_in_arrival_order()
        if self._auto is not None and self._auto.measuring:
            self._measure_for_auto()

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
            if self.bucket_reduced_hook is not None and self.bucket_reduced_hook(GradBucket(bucket, len(self.buckets))):
                continue
            grads, slots = [], []  # dense same-dtype copies: one call per bucket (see _fill_bucket)
            for index, p, slot in zip(self._indices[bucket.index], bucket.params, bucket.views):
                if globally_used is not None and not globally_used[index]:
                    continue  # unused on every rank: .grad stays as it was (None stays None)
                if p.grad is slot:
                    continue  # gradient_as_bucket_view: the average is already in .grad
                if index in self._sparse_dim:
                    p.grad = slot.to(p.dtype).to_sparse(self._sparse_dim[index])
                elif self._grad_is_slot_view(index, slot):
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
        if not self.options.find_unused_parameters:
            return None  # every parameter produced a gradient, or we raised above
        used = torch.tensor(self._locally_used, dtype=torch.int32, device=self.device)
        dist.all_reduce(used, group=self.process_group)
        return [bool(u) for u in used.tolist()]

    def unready_names(self) -> list[str]:
        return [name for b in self.buckets for name in b.unready_names()]

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next_to_launch = 0
        self.backward_started = False

    def abandon_unfinished_backward(self) -> list[str]:
        """Forget a backward that began and never ended; the names that got no gradient."""
        missing = self.unready_names()
        self._reset_buckets()
        return missing

    def _rebuild_in_arrival_order(self) -> None:
        """After the first backward, bucket parameters in the order their gradients came.

        Registration order is only a guess at execution order. Rank 0's
        observed order is broadcast, so all ranks build identical buckets.
        """
        self._rebuild_after_first_step = False
        self._recording = self._auto is not None and self._auto.measuring
        arrival = list(dict.fromkeys(i for i, _ in self._arrival))
        seen = set(arrival)
        order = arrival + [i for i in reversed(range(len(self.params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self.device)
        dist.broadcast(order_t, src=global_rank(self.process_group, 0), group=self.process_group)
        order = order_t.tolist()
        if order != [i for indices in self._indices for i in indices]:
            self._build_buckets(order)

    # -------------------------------------------------- bucket_cap_mb="auto"
    def _measure_for_auto(self) -> None:
        """Hand this backward's arrival times to the planner; once it has seen
        enough, probe, let rank 0 choose, and rebuild on every rank."""
        if not self._auto.backward_done(self._arrival, time.perf_counter()):
            return
        self._recording = False
        rank0 = global_rank(self.process_group, 0)
        is_rank0 = dist.get_rank() == rank0
        dtype = self.options.reduce_dtype or self.params[0].dtype
        choice, why = None, ""
        try:  # only rank 0 can fail here, after every probe collective: the broadcast below still matches
            choice = self._auto.decide(self._probe, self.world_size, self.device, dtype, is_rank0,
                                       comm_hook=self.comm_hook is not None)
        except ValueError as error:
            why = str(error)
        caps = [choice.cap_mb, choice.first_cap_mb] if choice else [self.options.bucket_cap_mb, FIRST_BUCKET_CAP_MB]
        caps_t = torch.tensor(caps, dtype=torch.float64, device=self.device)
        dist.broadcast(caps_t, src=rank0, group=self.process_group)
        if is_rank0:
            print(choice.describe() if choice else f"MiniDDP bucket_cap_mb='auto': kept the default ({why})",
                  flush=True)
        cap_mb, first_mb = caps_t.tolist()
        self._caps = (int(cap_mb * MiB), int(first_mb * MiB))
        self._build_buckets([i for indices in self._indices for i in indices])  # same order, new caps

    def _probe(self, buffer: torch.Tensor) -> torch.futures.Future:
        """One all-reduce of a scratch ``buffer`` the way buckets travel (comm hook included)."""
        return self._communicate(_ProbeBucket(buffer, len(self.buckets)))

    # ---------------------------------------------------------- uneven inputs
    def shadow_backward(self) -> None:
        """A joined rank's stand-in for a backward: the same collectives, contributing zeros."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.launch_unconditionally(self._communicate)
            bucket.wait()
            bucket.reset()
        if self.options.find_unused_parameters:
            self._locally_used = [False] * len(self.params)
            self.globally_used = self._globally_used()
        if self._rebuild_after_first_step:
            self._rebuild_in_arrival_order()
        if self._auto is not None and self._auto.measuring:
            self._arrival = []  # nothing arrived here; the step still counts, as on the other ranks
            self._measure_for_auto()


@dataclass
class _ProbeBucket:
    """A stand-in :class:`~minddp.buckets.Bucket` for the "auto" link probe: a scratch buffer, no parameters.

    Its index is past the real buckets', so no hook mistakes it for one of them.
    """

    buffer: torch.Tensor
    index: int
    params: tuple = ()
    views: tuple = ()
