"""MiniDDP: data parallelism in one readable class.

The path of a gradient, top to bottom in this file::

    loss.backward()
      autograd accumulates p.grad
        └─ _on_grad_ready(p)              post-accumulate hook, one per parameter
             _copy_into_bucket: p.grad / world_size into p's slot of its bucket
             (divide in place if p.grad *is* that slot: gradient_as_bucket_view)
             bucket complete? ─> _launch_ready_buckets(): async all_reduce,
                                 strictly in bucket order
      end of the backward pass
        └─ _on_backward_pass_end()        callback queued on the autograd engine
             └─ _finish_backward()
                  _account_for_missing_gradients   (zeros, or an error naming them)
                  _wait_for_buckets
                  _write_averages_into_grads

So when ``loss.backward()`` returns, every ``.grad`` holds the average over
ranks, and most of the communication happened while autograd was still
computing earlier layers' gradients. The buckets themselves (a flat buffer
and its life cycle) are in :mod:`minddp.buckets`; what "communicate" means
(all-reduce, or a compressed one) in :mod:`minddp.comm_hooks`.

Why dividing *before* summing: the sum of N half-precision gradients can
overflow where their average would not.

References: Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020; torch/nn/parallel/distributed.py and
torch/csrc/distributed/c10d/reducer.cpp, whose behaviour this file mirrors.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from minddp.buckets import MiB, Bucket, TensorSpec, assign_buckets
from minddp.comm_hooks import GradBucket
from minddp.join import Join, JoinHook
from minddp.replicas import check_replicas_in_sync, check_same_parameters
from minddp.sync import BUFFER_POLICIES, broadcast_coalesced, check_device_ids, global_rank, params_reached_from, sync_buffers
from minddp.trace import StepObserver, StepTimeline, Tracer, profiler_range

__all__ = ["MiniDDP"]

# torch's DDP caps the first bucket at 1 MiB so the first all-reduce starts early.
FIRST_BUCKET_CAP_MB = 1.0


class MiniDDP(nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves the average gradient over all ranks.

    Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``:

    * ``process_group``: the ranks to average over (default: the whole world).
    * ``bucket_cap_mb``: gradients travel in flat buckets of at most this many
      MiB (the first one at most 1 MiB); 0 means one parameter per bucket.
    * ``broadcast_buffers``: before each forward that will synchronize, copy
      rank 0's buffers (BatchNorm running statistics) to every rank. Kept as
      an attribute for compatibility; ``buffer_sync`` is what MiniDDP reads.
    * ``find_unused_parameters``: allow parameters that get no gradient on
      some rank; they count as zero there. Without it such a parameter is an
      error at the end of backward, naming it.
    * ``gradient_as_bucket_view``: make ``p.grad`` a view into its bucket, so
      no gradient is copied and no second copy of all gradients is kept.
    * ``device_ids``/``output_device``: accepted for drop-in compatibility;
      MiniDDP runs on the device the module is on (place it there first).
    * ``static_graph``: promise that every iteration uses the same parameters
      the same number of times. The first backward counts each parameter's
      gradient hooks and reduces everything at its end; later ones mark a
      parameter ready at its last hook. This is what lets a block run twice
      under a reentrant activation checkpoint (two nested passes, two hooks).
    * ``require_backward_grad_sync`` (attribute): set it to False before a
      forward to accumulate gradients locally (nanoGPT's idiom); ``no_sync()``
      does just that for the duration of a ``with`` block.

    Beyond torch's arguments:

    * ``reduce_dtype``: reduce gradients in this dtype (e.g. ``torch.float32``
      for bf16 or fp16 parameters): buckets hold it, gradients are cast into
      them and back. Twice the bytes of bf16 on the wire, one rounding at the
      end instead of one per addition. (torch: ``mixed_precision.reduce_dtype``.)
    * ``buffer_sync``: ``"broadcast"`` (rank 0's buffers, torch's way),
      ``"average"`` (average floating-point buffers over ranks) or ``"off"``;
      defaults to ``"broadcast"`` or ``"off"`` following ``broadcast_buffers``.
    * ``check_sync_every``: every N synchronized forwards, verify that all
      replicas hold identical parameters and buffers (one small collective;
      see :mod:`minddp.replicas`).
    * ``trace``: record every hook and bucket for a Chrome trace
      (``model.tracer.export_chrome_trace(path)``, see :mod:`minddp.trace`).
    * ``learn_bucket_order``: after the first synchronized backward, rebuild
      the buckets in the order gradients actually arrived (torch's DDP always
      does); ``False`` keeps reverse registration order, for comparison.

    Sparse gradients (``nn.Embedding(..., sparse=True)``) are averaged
    densified: the whole table's rows travel, touched or not, and ``.grad``
    comes back sparse. Cheap for small tables; for large ones the dense
    all-reduce costs what a dense embedding would.

    Collectives are issued in the same order on every rank, by construction:
    all ranks build the same buckets and launch them strictly in bucket order.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list | None = None,
        output_device: Any = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = 25.0,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        reduce_dtype: torch.dtype | None = None,
        buffer_sync: str | None = None,
        check_sync_every: int = 0,
        trace: bool = False,
        learn_bucket_order: bool = True,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "MiniDDP needs an initialized process group: call "
                "torch.distributed.init_process_group (or minddp.init_distributed) first"
            )
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.buffer_sync = buffer_sync or ("broadcast" if broadcast_buffers else "off")
        if self.buffer_sync not in BUFFER_POLICIES:
            raise ValueError(f"buffer_sync must be one of {BUFFER_POLICIES}, got {buffer_sync!r}")
        if check_sync_every < 0:
            raise ValueError(f"check_sync_every must be >= 0 (0 = never), got {check_sync_every}")
        if bucket_cap_mb is not None and bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0 (0: one parameter per bucket), got {bucket_cap_mb}")
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")
        self.check_sync_every = check_sync_every
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.reduce_dtype = reduce_dtype
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "MiniDDP is not needed when a module has no parameter that requires a gradient "
                f"({type(module).__name__} has none): there is nothing to average"
            )
        check_device_ids(device_ids, [p for _, p in named])
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self.device = self._params[0].device
        self._index = {p: i for i, p in enumerate(self._params)}
        self._buffers_to_sync = [b for b in module.buffers()]

        # 1. Same model everywhere, then rank 0's values everywhere.
        check_same_parameters(module, self.process_group)
        broadcast_coalesced([p for p in module.parameters()] + self._buffers_to_sync, self.process_group)

        # 2. Buckets, in the order gradients are expected: reverse registration.
        self._sparse_dim: dict[int, int] = {}  # parameters whose gradients came sparse
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._rebuild_after_first_step = learn_bucket_order
        self._arrival: list[int] = []

        # 3. One hook per parameter; it fires after p.grad has been accumulated.
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

        self.require_backward_grad_sync = True  # torch's public switch; no_sync() sets it
        self._sync_this_backward = False  # read at forward, used by the hooks
        self._backward_started = False
        self._watched_passes: set[int] = set()  # autograd passes whose end we are told of
        self._unused: list[nn.Parameter] = []  # found by the graph walk at forward
        self._locally_used: list[bool] = [True] * len(self._params)
        self._hooks_seen = [0] * len(self._params)  # this backward, per parameter (static_graph)
        self._hooks_expected: list[int] | None = None  # learned by static_graph's first backward
        self._comm_hook: tuple[Any, Callable] | None = None
        self._backwards_done = 0
        self._synchronized_forwards = 0
        self._divisor = self.world_size  # what each gradient is divided by before the sum
        self.join_context: Join | None = None  # set by Join inside ``with model.join():``
        self._join_hook: _MiniDDPJoinHook | None = None
        self._observer = StepObserver(dist.get_rank(self.process_group), trace)

    @property
    def timeline(self) -> StepTimeline:
        """When things happened in the last synchronized backward (always recorded)."""
        return self._observer.timeline

    @property
    def tracer(self) -> Tracer | None:
        """The Chrome-trace recorder, with ``trace=True``; None otherwise."""
        return self._observer.tracer

    # ------------------------------------------------------------------ setup
    def _build_buckets(self, order: list[int]) -> None:
        """(Re)build the buckets for parameter indices in expected-arrival ``order``."""
        specs = [self._bucket_spec(self._params[i]) for i in order]
        groups = assign_buckets(specs, int(self.bucket_cap_mb * MiB), int(FIRST_BUCKET_CAP_MB * MiB))
        self._buckets = [
            Bucket(k, [self._params[order[j]] for j in group], [self._names[order[j]] for j in group],
                   dtype=specs[group[0]].dtype)
            for k, group in enumerate(groups)
        ]
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._next_to_launch = 0
        for p in self._params:  # gradients kept across a rebuild move into their new slots
            if p.grad is not None and self._grad_is_slot_view(p, self._bucket_of[p].view(p)):
                view = self._bucket_of[p].view(p)
                view.copy_(p.grad)
                p.grad = view

    def _bucket_spec(self, p: nn.Parameter) -> TensorSpec:
        dtype = self.reduce_dtype or p.dtype
        return TensorSpec(p.numel(), dtype.itemsize, dtype, p.device)

    def _grad_is_slot_view(self, p: nn.Parameter, slot: torch.Tensor) -> bool:
        """Should ``p.grad`` *be* its bucket slot? Only with bucket views, a dense
        gradient, and a bucket in the parameter's own dtype."""
        return self.gradient_as_bucket_view and slot.dtype == p.dtype and self._index[p] not in self._sparse_dim

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]``.

        torch's contract: once, before the first backward; the hook does the
        averaging (MiniDDP no longer divides by the world size for it).
        """
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        if self._backwards_done or self._backward_started:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._comm_hook = (state, hook)

    # ---------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        if self._backward_started:
            raise self._unfinished_backward_error()
        # The sync decision is taken here, at forward, as in torch's DDP: a
        # forward with require_backward_grad_sync False (inside no_sync())
        # makes its backward skip communication.
        self._sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._sync_this_backward:
            self._before_synchronized_forward()
        started = self._observer.forward_started()
        output = self.module(*args, **kwargs)
        if self._sync_this_backward:
            self._observer.forward_done(started)
            if self.find_unused_parameters:
                reached = params_reached_from(output)
                self._unused = [p for p in self._params if id(p) not in reached]
        return output

    def _before_synchronized_forward(self) -> None:
        """The collectives that open a synchronized step, identical on every rank."""
        buffer_source, everyone_active = 0, True
        self._divisor = self.world_size
        active = Join.notify_join_context(self)  # inside join(): who is still training?
        if active is not None:
            self._divisor = self._join_hook.divisor(active)
            buffer_source, everyone_active = self.join_context.last_active, all(active)
        if self.check_sync_every and everyone_active and self._synchronized_forwards % self.check_sync_every == 0:
            check_replicas_in_sync(self.module, self.process_group)
        self._synchronized_forwards += 1
        if self.world_size > 1:
            sync_buffers(self._buffers_to_sync, self.process_group, self.buffer_sync, buffer_source)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication.

        The flag is read at *forward*: run the forward (and its backward)
        inside the context. The first synchronized backward after it averages
        everything accumulated so far, so k-1 steps inside ``no_sync`` plus one
        outside equal one step on a k-times larger batch. Same as setting
        ``require_backward_grad_sync = False`` before those forwards.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # -------------------------------------------------- the path of a gradient
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate hook: ``param.grad`` is final for this backward."""
        if not self._sync_this_backward:
            return
        if not self._backward_started:
            self._begin_backward()
        self._call_at_end_of_this_pass()
        index = self._index[param]
        if self.static_graph and not self._last_expected_hook(index):
            return  # more of this parameter's gradient is still to come
        self._observer.gradient_ready(self._names[index], param.grad)
        if self._rebuild_after_first_step:
            self._arrival.append(index)
        self._mark_ready(param)

    def _begin_backward(self) -> None:
        self._backward_started = True
        self._observer.backward_started()
        self._watched_passes = set()
        self._locally_used = [True] * len(self._params)
        self._hooks_seen = [0] * len(self._params)
        self._arrival = []  # only this backward's order counts (an earlier one may have failed)
        for p in self._unused:  # no gradient will come for these: count them now
            self._mark_ready(p)

    def _call_at_end_of_this_pass(self) -> None:
        # An activation checkpoint with use_reentrant=True runs a second,
        # nested backward pass inside the first, and its hooks fire in there.
        # So we ask to be called at the end of *every* pass a gradient came
        # from (not only the first one's), and decide then (see below).
        current = torch._C._current_graph_task_id()
        if current not in self._watched_passes:
            self._watched_passes.add(current)
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_pass_end)

    def _last_expected_hook(self, index: int) -> bool:
        self._hooks_seen[index] += 1
        if self._hooks_expected is None:
            return False  # first backward: count only, reduce everything at its end
        return self._hooks_seen[index] == self._hooks_expected[index]

    def _mark_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[param]
        self._copy_into_bucket(param, bucket.view(param))
        if bucket.mark_ready(param):
            self._launch_ready_buckets()

    def _copy_into_bucket(self, param: nn.Parameter, slot: torch.Tensor) -> None:
        # Average = sum of (g / N): dividing before the sum keeps low precision
        # from overflowing. Fused with the copy it costs one pass over the
        # gradient, and multiplying by 1/N (as torch's reducer does) is
        # cheaper than dividing. A comm hook does its own averaging.
        scale = 1.0 if self._comm_hook is not None else 1.0 / self._divisor
        grad = param.grad
        if grad is None:  # unused here (but maybe used on another rank): contributes zero
            self._locally_used[self._index[param]] = False
            slot.zero_()
        elif grad is slot:  # .grad already lives in the bucket (gradient_as_bucket_view)
            if scale != 1.0:
                slot.mul_(scale)
        elif grad.is_sparse:  # densified: every row travels, touched or not
            self._sparse_dim[self._index[param]] = grad.sparse_dim()
            slot.zero_().add_(grad, alpha=scale)
        elif grad.dtype != slot.dtype:  # reduce_dtype: cast first, so the scaling rounds only once
            slot.copy_(grad).mul_(scale)
        else:
            torch.mul(grad, scale, out=slot)
            if self._grad_is_slot_view(param, slot):  # e.g. after zero_grad(set_to_none=True)
                param.grad = slot

    def _launch_ready_buckets(self) -> None:
        # Strict bucket order: a ready bucket waits for the ones before it, so
        # every rank issues the same all-reduces in the same order.
        while self._next_to_launch < len(self._buckets) and self._buckets[self._next_to_launch].ready:
            bucket = self._buckets[self._next_to_launch]
            launched = time.perf_counter()
            with profiler_range(f"minddp.launch_bucket_{bucket.index}"):
                bucket.launch(self._communicate)
            self._observer.bucket_launched(bucket.index, bucket.buffer.nbytes, launched, bucket.future)
            self._next_to_launch += 1

    def _communicate(self, bucket: Bucket) -> torch.futures.Future:
        if self._comm_hook is None:
            if self.world_size == 1:  # nothing to add up: the buffer is the average already
                done = torch.futures.Future()
                done.set_result(bucket.buffer)
                return done
            work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            return work.get_future()
        state, hook = self._comm_hook
        return hook(state, GradBucket(bucket, len(self._buckets)))

    def _on_backward_pass_end(self) -> None:
        """Autograd finished a pass that delivered gradients: is the backward over?"""
        if not self._backward_started:
            return  # an earlier pass's callback already finished this backward
        if self._next_to_launch == len(self._buckets):
            self._finish_backward()  # every gradient is in, whichever pass this was
        elif torch._C._current_autograd_node() is None:
            self._finish_backward()  # the outermost pass ended: what is missing stays missing
        # else: a nested (reentrant checkpoint) pass ended inside a node of the
        # outer pass, which goes on and will deliver the remaining gradients.

    def _finish_backward(self) -> None:
        """End of backward: account for missing gradients, wait for every bucket, write ``.grad``."""
        self._backward_started = False
        self._account_for_missing_gradients()
        with profiler_range("minddp.wait_buckets"):
            for bucket in self._buckets:
                bucket.wait()
        self._write_averages_into_grads(self._globally_used())
        self._observer.backward_done()
        self._backwards_done += 1
        self._reset_buckets()
        if self._rebuild_after_first_step:
            self._rebuild_in_arrival_order()

    def _account_for_missing_gradients(self) -> None:
        if self.static_graph and self._hooks_expected is None:
            # static_graph's first backward: now we know how many hooks each
            # parameter gets; parameters that got none count as zero, always.
            self._hooks_expected = list(self._hooks_seen)
            self._unused = [p for p, n in zip(self._params, self._hooks_expected) if n == 0]
            for bucket in self._buckets:
                for p in bucket.unready_params():
                    self._mark_ready(p)
        if self.find_unused_parameters:
            # Reached by the graph walk but no gradient came (an output not in
            # the loss): zero as well, in bucket order like every other launch.
            for bucket in self._buckets:
                for p in bucket.unready_params():
                    self._mark_ready(p)
        missing = [name for b in self._buckets for name in b.unready_names()]
        if missing:
            self._reset_buckets()
            raise RuntimeError(
                f"MiniDDP: parameters {missing} received no gradient in this backward, so their "
                "buckets could not be all-reduced and no .grad was averaged. If a forward may "
                "leave some parameters unused (or some outputs out of the loss), construct "
                "MiniDDP(..., find_unused_parameters=True)."
            )

    def _write_averages_into_grads(self, globally_used: list[bool] | None) -> None:
        for bucket in self._buckets:
            for p, slot in zip(bucket.params, bucket.views):
                index = self._index[p]
                if globally_used is not None and not globally_used[index]:
                    continue  # unused on every rank: .grad stays as it was (None stays None)
                if index in self._sparse_dim:
                    p.grad = slot.to(p.dtype).to_sparse(self._sparse_dim[index])
                elif p.grad is slot:
                    continue  # gradient_as_bucket_view: the average is already in .grad
                elif self._grad_is_slot_view(p, slot):
                    p.grad = slot
                elif p.grad is None:
                    p.grad = slot.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(slot)

    def _unfinished_backward_error(self) -> RuntimeError:
        missing = [name for b in self._buckets for name in b.unready_names()]
        self._reset_buckets()
        return RuntimeError(
            "MiniDDP: the previous backward started averaging gradients but never finished: "
            f"parameters {missing} received no gradient. Did that backward fail, or leave some "
            "parameters out of the loss? For parameters a forward may not use, construct "
            "MiniDDP(..., find_unused_parameters=True)."
        )

    def _globally_used(self) -> list[bool] | None:
        if not self.find_unused_parameters:
            return None  # every parameter produced a gradient, or we raised above
        used = torch.tensor(self._locally_used, dtype=torch.int32, device=self.device)
        dist.all_reduce(used, group=self.process_group)
        return [bool(u) for u in used.tolist()]

    def _reset_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.reset()
        self._next_to_launch = 0
        self._backward_started = False

    def _rebuild_in_arrival_order(self) -> None:
        """After the first backward, bucket parameters in the order their gradients came.

        Registration order is only a guess at execution order. Rank 0's
        observed order is broadcast, so all ranks build identical buckets.
        """
        self._rebuild_after_first_step = False
        seen = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self._params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self.device)
        dist.broadcast(order_t, src=global_rank(self.process_group, 0), group=self.process_group)
        order = order_t.tolist()
        current = [self._index[p] for b in self._buckets for p in b.params]
        if order != current:
            self._build_buckets(order)

    # ------------------------------------------------------------ uneven inputs
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True) -> Join:
        """``with model.join():`` lets ranks with fewer batches finish early (see :mod:`minddp.join`)."""
        return Join([self], enable, divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, divide_by_initial_world_size: bool = True) -> JoinHook:
        """What this model does for :class:`~minddp.join.Join` once its rank has run out of data."""
        if self.buffer_sync == "average":
            raise ValueError(
                "join() needs buffer_sync='broadcast' or 'off': a rank that has run out of data "
                "would pull the averaged buffers towards its stale ones"
            )
        self._join_hook = _MiniDDPJoinHook(self, divide_by_initial_world_size)
        return self._join_hook

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    @property
    def join_device(self) -> torch.device:
        return self.device

    def _shadow_synchronized_step(self, buffer_source: int) -> None:
        """What a joined rank does for each step the others still take: the
        same collectives, in the same order, with nothing to contribute."""
        if self.world_size > 1:
            sync_buffers(self._buffers_to_sync, self.process_group, self.buffer_sync, buffer_source)
        for bucket in self._buckets:
            bucket.buffer.zero_()
            bucket.launch_unconditionally(self._communicate)
            bucket.wait()
            bucket.reset()
        if self.find_unused_parameters:
            self._locally_used = [False] * len(self._params)
            self._globally_used()
        if self._rebuild_after_first_step:
            self._rebuild_in_arrival_order()

    # ------------------------------------------------------------- inspection
    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for tests and lessons)."""
        return [list(b.names) for b in self._buckets]


class _MiniDDPJoinHook(JoinHook):
    """MiniDDP's part in :class:`~minddp.join.Join`: shadow the others' steps, then agree."""

    def __init__(self, ddp: MiniDDP, divide_by_initial_world_size: bool):
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def divisor(self, active: list[bool]) -> int:
        """Gradients are divided by the initial world size (torch's default) or by the active ranks."""
        return len(active) if self.divide_by_initial_world_size else sum(active)

    def main_hook(self, active: list[bool]) -> None:
        self.ddp._shadow_synchronized_step(buffer_source=max(r for r, a in enumerate(active) if a))

    def post_hook(self, last_active: int) -> None:
        # Everyone is done: the last rank to train has the newest parameters.
        ddp = self.ddp
        broadcast_coalesced(list(ddp.module.parameters()) + ddp._buffers_to_sync, ddp.process_group, last_active)
        ddp._divisor = ddp.world_size
