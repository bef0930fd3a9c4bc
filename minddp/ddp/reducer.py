"""The path of a gradient, from autograd's hook to the averaged ``.grad``: lesson 07b's ``FlatDDP``, grown up.

``MiniDDP`` (:mod:`minddp.ddp.wrapper`) wraps the module; this :class:`Reducer`
averages the gradients, as torch splits ``DistributedDataParallel`` (Python)
from its ``Reducer`` (C++). The plain path, top to bottom in this file::

    loss.backward()
      autograd accumulates p.grad
        └─ _autograd_hook(i, p)           post-accumulate hook, one per parameter
             first hook of this backward: queue _on_pass_end on autograd's engine
             readiness.is_ready(i)        plain: yes, at its hook
               mark_ready(i)              count p ready in its bucket (which one: _plan[i])
                 its bucket complete? ─> bucket_ready(bucket)
                    gradients.fill_bucket: every p.grad * 1/N into its slot, one batched copy
                    launch every complete bucket, strictly in bucket order:
                    communication.communicate(bucket) = an async all_reduce
      the backward pass ends
        └─ _on_pass_end() ─> finish_backward()
              every bucket launched? (else an error naming the parameters without a gradient)
              per bucket: wait for its sum, gradients.write_grads copies it into .grad, reset
           then each policy's after_backward (above: learned order, the lab's planner, ZeRO stage 2)

Where DDP's options differ, the reducer holds a *part* per slot, an object
chosen once by ``MiniDDP``'s constructor, typed by its contract
(:mod:`minddp.ddp.contracts`): ``readiness`` (when is a parameter ready),
``gradients`` (how a gradient gets into its bucket and back),
``communication`` (how a bucket travels), ``passenger`` (what rides in the
last bucket); the plain ones are here, the others in :mod:`minddp.ddp.parts`.
What only watches is an ``Observer`` in ``observers`` (none: no call). Where
a backward is, is one ``BackwardPhase``. The policies above (the learned
bucket order, the lab's ``plan_buckets``, ZeRO stage 2) are ``Policy`` objects
and use "the interface for policies" below, and nothing else.

Why divide *before* summing: the sum of N half-precision gradients can
overflow where N parts of their average cannot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import minddp.ddp.messages as messages
from minddp.ddp.bucket_assignment import FIRST_BUCKET_CAP_MB, MiB, TensorSpec, bucket_groups, first_guess_limits
from minddp.ddp.buckets import Bucket, BucketStorage
from minddp.ddp.contracts import (BackwardPhase, Communication, GradientTransfer, Observer, Passenger, Policy,
                                  Readiness, Rebuild)
from minddp.ddp.weak_hooks import after_accumulation

__all__ = ["FIRST_BUCKET_CAP_MB", "ReducerOptions", "Reducer", "EveryHookReady", "CopyGradients", "AllReduce",
           "ArrivalLog"]

_engine = torch.autograd.Variable._execution_engine


@dataclass(frozen=True)
class ReducerOptions:
    """How gradients are bucketed and reduced (MiniDDP's arguments of the same names)."""

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    static_graph: bool = False
    reduce_dtype: torch.dtype | None = None
    learn_bucket_order: bool = True
    bucket_caps_mb: tuple[float, ...] | None = None  # one cap per bucket (torch's bucket_cap_mb_list)
    first_bucket_cap_mb: float = FIRST_BUCKET_CAP_MB  # torch's: 1 MiB by default, the cap when one is given


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


class ArrivalLog(Observer):
    """An observer for policies: which gradient came when in the last backward (``log``: ``(index, perf_counter)``)."""

    def __init__(self):
        self.log: list[tuple[int, float]] = []

    def backward_started(self) -> None:
        self.log = []  # only this backward's order counts (an earlier one may have failed)

    def gradient_ready(self, index: int, param: nn.Parameter) -> None:
        self.log.append((index, time.perf_counter()))


class Reducer:
    """Averages the gradients of ``params`` over ``process_group`` during backward, through its parts."""

    def __init__(self, params: list[nn.Parameter], names: list[str], process_group: dist.ProcessGroup,
                 options: ReducerOptions, *, readiness: Readiness | None = None,
                 gradients: GradientTransfer | None = None, communication: Communication | None = None,
                 observers: tuple[Observer, ...] = (), passenger: Passenger | None = None):
        self.params, self.names, self.options = params, names, options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.device = params[0].device
        self.readiness: Readiness = readiness or EveryHookReady()
        self.gradients: GradientTransfer = gradients or CopyGradients()
        self.communication: Communication = communication or AllReduce(process_group)
        self.observers = tuple(observers)
        self.passenger = passenger  # what rides in the last bucket (minddp.ddp.parts.buffers_in_bucket)
        self.policies: tuple[Policy, ...] = ()  # told at the end of every synchronized backward
        self.average_over(self.world_size)  # join() may lower it
        self.phase = BackwardPhase.IDLE
        # Set with ARMED: did that forward run inside a backward pass? [Note: forward inside backward]
        # A reentrant checkpoint around the whole model runs its forward without grad, then again
        # inside the backward, where it arms this reducer: the pass it starts is the whole backward.
        self.armed_inside_backward = False
        self.backwards_done = 0
        self.buckets_reduced, self.buckets_reduced_logged = 0, None  # last backward's; as of the last forward
        self.due_rebuild: tuple[list[int], int, int | None] | None = None  # (order, caps) at the next forward
        self.fixed_groups: list[list[int]] | None = None  # buckets given whole (rebuild_groups), not by caps
        self.storage = BucketStorage()
        self.caps = (int(options.bucket_cap_mb * MiB), int(options.first_bucket_cap_mb * MiB))
        self.per_bucket_caps = [int(cap * MiB) for cap in options.bucket_caps_mb or ()]  # [] unless given
        self.first_guess_limits = first_guess_limits(self.caps, self.per_bucket_caps, options)
        self._build_buckets(None if options.learn_bucket_order else list(reversed(range(len(params)))))  # 1st guess
        after_accumulation(self._autograd_hook, params, with_index=True)  # fires after p.grad is accumulated

    def _build_buckets(self, order: list[int] | None) -> None:
        """(Re)build the buckets for parameter indices in expected-arrival ``order``, by ``caps``; ``None``:
        torch's first guess, before a backward has shown the order (:mod:`minddp.ddp.bucket_assignment`)."""
        self.layout_order = order  # what the same buckets are rebuilt from (with room, or other storage)
        self.buckets, self._plan = [], []  # a rebuild lets the old buffers go first: one set alive, as torch's
        dtypes = [self.options.reduce_dtype or p.dtype for p in self.params]  # what each gradient is reduced in
        specs = [TensorSpec(p.numel(), dtype.itemsize, dtype, self.device) for p, dtype in zip(self.params, dtypes)]
        groups = self.fixed_groups or bucket_groups(specs, order, self.caps, self.per_bucket_caps,
                                                    self.first_guess_limits)
        self.buckets = [Bucket(k, [self.params[i] for i in group], [self.names[i] for i in group], dtypes[group[0]],
                               self.storage, self._room_in(k, len(groups), dtypes[group[0]]), indices=group)
                        for k, group in enumerate(groups)]
        # The plan every hook follows, worked out once here instead of at every
        # gradient: parameter index -> (its bucket, its position there).
        self._plan: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for position, i in enumerate(bucket.indices):
                self._plan[i] = (bucket, position)
        self._next_to_launch = 0
        self.gradients.buckets_built(self)

    def _room_in(self, k: int, count: int, dtype: torch.dtype) -> int:
        """Room after bucket ``k``'s gradients: the passenger's, in the last bucket if it fits there."""
        return self.passenger.numel if self.passenger and k == count - 1 and self.passenger.fits(dtype) else 0

    # ------------------------------------------------------- at every forward
    def prepare_for_backward(self, output: Any) -> None:
        """Arm the reducer: the next backward averages. Called at the end of a synchronized forward, with
        its output (where unused parameters are searched for)."""
        if self.phase is BackwardPhase.IDLE:
            self.phase = BackwardPhase.ARMED
        self.armed_inside_backward = torch._C._current_graph_task_id() != -1
        if self.backwards_done:  # torch's logger records the last backward's count at a synchronized forward
            self.buckets_reduced_logged = self.buckets_reduced
        for observer in self.observers:
            observer.forward_done()
        self.readiness.prepare_for_backward(self, output)

    # ------------------------------------------------ the path of a gradient
    def _autograd_hook(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate hook of ``params[index]``: its ``.grad`` is final for this backward."""
        phase = self.phase
        if phase is BackwardPhase.IDLE:
            return  # inside no_sync(): the gradient just accumulates
        if phase is not BackwardPhase.REDUCING:  # the first hook of this backward (or of a pass: _on_pass_end)
            if phase is BackwardPhase.ARMED:
                for observer in self.observers:
                    observer.backward_started()
            _engine.queue_callback(self._on_pass_end)
            self.phase = BackwardPhase.REDUCING
        for observer in self.observers:
            observer.gradient_ready(index, param)
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
        if bucket.extra_numel:  # (fill_bucket may scale the whole buffer: the passenger goes in after)
            self.passenger.pack(bucket.tail)
        for observer in self.observers:
            observer.bucket_filled(bucket, self.scale)
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            complete = self.buckets[self._next_to_launch]
            for observer in self.observers:
                observer.bucket_launching(complete)
            complete.launch(self.communication.communicate)
            for observer in self.observers:
                observer.bucket_launched(complete)
            self._next_to_launch += 1

    # ------------------------------------------------------ end of backward
    def watch_this_pass(self) -> None:
        """At the end of the autograd pass running now, end the backward if nested passes left it
        BETWEEN_PASSES: for a part whose backward's hooks may all fire in nested passes, called from
        the outer one ([Note: hooks only in nested passes], :mod:`minddp.ddp.parts.static_graph`).
        A pass whose own hooks queued the check (REDUCING), or that reduced nothing (ARMED, IDLE:
        ``torch.autograd.grad`` of an input, say), is left alone."""
        _engine.queue_callback(self._on_watched_pass_end)

    def _on_watched_pass_end(self) -> None:
        if self.phase is BackwardPhase.BETWEEN_PASSES:
            self._on_pass_end()

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
            self.finish_backward()  # returned first: no frame of it holds a bucket while the policies run
            self._tell_policies()
        else:
            self.phase = BackwardPhase.BETWEEN_PASSES

    def finish_backward(self) -> None:
        """Every bucket launched? Then wait for each, write ``.grad``, and be ready for the next backward."""
        self.phase = BackwardPhase.IDLE
        self.readiness.backward_ending(self)
        if self._next_to_launch < len(self.buckets):
            raise self._missing_gradients_error()
        for observer in self.observers:
            observer.backward_ending()
        for bucket in self.buckets:
            try:
                bucket.wait()
            except RuntimeError as error:  # a timeout: name the bucket that never came, and why
                if not messages.is_timeout(error):
                    raise
                said = messages.bucket_never_arrived(self, bucket, error)
                self.abandon_unfinished_backward()
                raise RuntimeError(said) from error
            for observer in self.observers:
                observer.bucket_reduced(bucket)
            if bucket.extra_numel:
                self.passenger.receive(bucket.tail)
            self.gradients.write_grads(bucket, self.readiness.used_on_some_rank)
            for observer in self.observers:
                observer.grads_written(bucket)
            bucket.reset()
        self._next_to_launch = 0
        self.backwards_done += 1
        self.buckets_reduced = len(self.buckets)
        for observer in self.observers:
            observer.backward_done()

    def _missing_gradients_error(self) -> RuntimeError:
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

    def _tell_policies(self) -> None:
        for policy in self.policies:  # (a tuple: a policy may remove itself meanwhile)
            policy.after_backward()

    # ------------------------------------------------ a joined rank's backward
    def shadow_backward(self) -> None:
        """A joined rank's stand-in for a backward (``join()``): the same collectives as the other ranks',
        in the same order, contributing zeros (:mod:`minddp.ddp.parts.uneven_inputs`)."""
        self.rebuild_if_due()  # the others rebuild at their forward: the same buckets everywhere
        for observer in self.observers:
            observer.backward_started()  # nothing will arrive here; the step still counts, as on the other ranks
        for bucket in self.buckets:
            bucket.acquire()
            bucket.buffer.zero_()
            bucket.launch_unconditionally(self.communication.communicate)
            bucket.wait()
            bucket.reset()
            if not self.storage.keep_buffers:
                bucket.release()
        self.readiness.shadow_backward(self)
        self._tell_policies()

    # ------------------------------------- what frameworks call on torch's reducer
    # accelerate and Lightning reach into ``ddp.reducer`` for two private methods of torch's C++ reducer
    # (docs/frameworks.md). These answer them with the same effect, or refuse naming the call: a framework
    # that calls one expecting work done must never get a silent nothing.
    def _rebuild_buckets(self) -> bool:
        """torch's ``reducer._rebuild_buckets()``: rebuild the buckets now if a rebuild is due, and say whether
        it did (True once, after the backward that showed the order, as torch's); first, refuse if the previous
        backward started reducing and never finished (Lightning calls it before each manual backward)."""
        if self.phase.in_backward:
            raise self._missing_gradients_error()
        return self.rebuild_if_due()

    def _delay_all_reduce(self) -> None:
        """torch's ``reducer._delay_all_reduce()``, its static-graph first step: reduce every bucket at the end
        of the first backward (Lightning calls it after a manual backward with ``static_graph=True``). MiniDDP's
        ``static_graph`` does exactly that at the end of its first backward (:mod:`minddp.ddp.parts.static_graph`):
        afterwards there is nothing left to reduce. Anything else is refused."""
        if not self.options.static_graph or not self.backwards_done or self.phase.in_backward:
            raise RuntimeError(
                "MiniDDP's reducer._delay_all_reduce(): only after the first backward of a model constructed "
                "with static_graph=True (whose gradients MiniDDP has then reduced already); here "
                f"static_graph={self.options.static_graph}, {self.backwards_done} backward(s) done")

    # ------------------------------------------ the interface for policies
    def add_policy(self, policy: Policy) -> None:
        """Tell ``policy`` the end of every synchronized backward from now on (after those added before)."""
        if policy not in self.policies:
            self.policies += (policy,)

    def remove_policy(self, policy: Policy) -> None:
        self.policies = tuple(p for p in self.policies if p is not policy)

    def pending_rebuilds(self) -> set[Rebuild]:
        """What the policies still plan for the buckets (empty: they are final)."""
        return {policy.pending_rebuild() for policy in self.policies} - {Rebuild.NONE}

    def average_over(self, ranks: int) -> None:
        """Average over ``ranks`` ranks (the world; fewer under ``join()``): gradients are multiplied by
        ``1/ranks`` before the sum, unless the communication averages itself (a comm hook)."""
        self.divisor = ranks
        self.scale = 1.0 / ranks if self.communication.divides_first else 1.0

    def set_communication(self, communication: Communication) -> None:
        """How buckets travel from now on (``register_comm_hook``; ZeRO stage 2 through it)."""
        self.communication = communication
        self.average_over(self.divisor)

    def set_gradients(self, gradients: GradientTransfer) -> None:
        """How gradients get into their buckets and back from now on (ZeRO stage 2: lent bucket views)."""
        self.gradients = gradients
        self.gradients.buckets_built(self)

    def set_passenger(self, passenger: Passenger | None) -> None:
        """What rides in the last bucket (None: nothing): the buckets are rebuilt with its room."""
        self.passenger = passenger
        self._build_buckets(self.layout_order)

    def add_observer(self, observer: Observer) -> None:
        if observer not in self.observers:
            self.observers += (observer,)

    def remove_observer(self, observer: Observer) -> None:
        self.observers = tuple(o for o in self.observers if o is not observer)

    def ranks_averaged_over(self) -> int:
        """How many ranks the average is over: the world, or fewer under ``join()``."""
        return self.divisor

    def used_on_some_rank(self) -> list[bool] | None:
        """Per parameter: had it a gradient on some rank in the last synchronized backward? None: all had."""
        return self.readiness.used_on_some_rank

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
        self.due_rebuild, self.fixed_groups = (order, cap_bytes, first_cap_bytes), None

    def rebuild_groups(self, groups: list[list[int]]) -> None:
        """As :meth:`rebuild`, with the buckets given whole: ``groups``, the parameter indices of each bucket in
        launch order, one dtype each (:mod:`minddp.ddp.compiled`: one bucket per compiled piece). A later
        ``rebuild`` by caps replaces them."""
        self.rebuild([i for group in groups for i in group], *self.caps)
        self.fixed_groups = [list(group) for group in groups]

    def rebuild_if_due(self) -> bool:
        """Rebuild now if a rebuild is due (torch's ``reducer._rebuild_buckets()``); whether it did."""
        if self.due_rebuild is None:
            return False
        order, *caps = self.due_rebuild
        self.due_rebuild, self.caps = None, tuple(caps)
        self._build_buckets(order)
        return True

    def use_bucket_storage(self, storage: BucketStorage) -> None:
        """Take bucket buffers from ``storage`` from now on (one that lends them, ``keep_buffers`` False,
        goes with a gradients part that acquires and releases them: :mod:`minddp.ddp.parts.lent_buckets`)."""
        for bucket in self.buckets:
            bucket.release()
        self.storage = storage
        self._build_buckets(self.layout_order)
