"""MiniDDP: data parallelism in one readable class.

The path of a gradient, all in this file::

    loss.backward()
      autograd accumulates p.grad
        └─ _on_grad_ready(p)           post-accumulate hook, one per parameter
             copy p.grad / world_size into p's slot of its bucket
             (divide in place if p.grad *is* that slot: gradient_as_bucket_view)
             bucket complete? ─> _launch_ready_buckets(): async all_reduce,
                                 strictly in bucket order
      end of backward
        └─ _finish_backward()          callback queued on the autograd engine
             wait for every bucket, write the averages into p.grad

So when ``loss.backward()`` returns, every ``.grad`` holds the average over
ranks, and most of the communication happened while autograd was still
computing earlier layers' gradients.

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
from minddp.debug import check_replicas_in_sync
from minddp.join import Join
from minddp.sync import (
    BUFFER_POLICIES,
    broadcast_coalesced,
    check_device_ids,
    check_same_parameters,
    global_rank,
    params_reached_from,
    sync_buffers,
)
from minddp.trace import StepTimeline, Tracer, profiler_range

__all__ = ["MiniDDP"]

# torch's DDP caps the first bucket at 1 MiB so the first all-reduce starts early.
FIRST_BUCKET_CAP_MB = 1.0


class MiniDDP(nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves the average gradient over all ranks.

    Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``:

    * ``process_group``: the ranks to average over (default: the whole world).
    * ``bucket_cap_mb``: gradients travel in flat buckets of at most this many
      MiB (the first one at most 1 MiB).
    * ``broadcast_buffers``: before each forward that will synchronize, copy
      rank 0's buffers (BatchNorm running statistics) to every rank.
    * ``find_unused_parameters``: allow parameters that get no gradient on
      some rank; they count as zero there. Without it such a parameter is an
      error at the end of backward, naming it.
    * ``gradient_as_bucket_view``: make ``p.grad`` a view into its bucket, so
      no gradient is copied and no second copy of all gradients is kept.
    * ``device_ids``/``output_device``: accepted for drop-in compatibility;
      MiniDDP runs on the device the module is on (place it there first).

    Beyond torch's arguments:

    * ``buffer_sync``: ``"broadcast"`` (rank 0's buffers, torch's way),
      ``"average"`` (average floating-point buffers over ranks) or ``"off"``;
      defaults to ``"broadcast"`` or ``"off"`` following ``broadcast_buffers``.
    * ``check_sync_every``: every N synchronized forwards, verify that all
      replicas hold identical parameters and buffers (one small collective;
      see :mod:`minddp.debug`).
    * ``trace``: record every hook and bucket for a Chrome trace
      (``model.tracer.export_chrome_trace(path)``, see :mod:`minddp.trace`).
    * ``learn_bucket_order``: after the first synchronized backward, rebuild
      the buckets in the order gradients actually arrived (torch's DDP always
      does); ``False`` keeps reverse registration order, for comparison.

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
        self.check_sync_every = check_sync_every
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
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
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._rebuild_after_first_step = learn_bucket_order
        self._arrival: list[int] = []

        # 3. One hook per parameter; it fires after p.grad has been accumulated.
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

        self._require_sync = True  # False inside no_sync()
        self._sync_this_backward = False  # read at forward, used by the hooks
        self._backward_started = False
        self._unused: list[nn.Parameter] = []  # found by the graph walk at forward
        self._locally_used: list[bool] = [True] * len(self._params)
        self._comm_hook: tuple[Any, Callable] | None = None
        self._backwards_done = 0
        self._synchronized_forwards = 0
        self._divisor = self.world_size  # what each gradient is divided by before the sum
        self._join: Join | None = None  # set while inside ``with model.join():``
        self.timeline = StepTimeline()
        self.tracer = Tracer(dist.get_rank(self.process_group)) if trace else None

    # ------------------------------------------------------------------ setup
    def _build_buckets(self, order: list[int]) -> None:
        """(Re)build the buckets for parameter indices in expected-arrival ``order``."""
        specs = [TensorSpec.of(self._params[i]) for i in order]
        groups = assign_buckets(specs, int(self.bucket_cap_mb * MiB), int(FIRST_BUCKET_CAP_MB * MiB))
        self._buckets = [
            Bucket(k, [self._params[order[j]] for j in group], [self._names[order[j]] for j in group])
            for k, group in enumerate(groups)
        ]
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._next_to_launch = 0
        if self.gradient_as_bucket_view:
            for p in self._params:
                if p.grad is not None:
                    view = self._bucket_of[p].view(p)
                    view.copy_(p.grad)
                    p.grad = view

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
        # The sync decision is taken here, at forward, as in torch's DDP: a
        # forward inside no_sync() makes its backward skip communication.
        self._sync_this_backward = torch.is_grad_enabled() and self._require_sync
        if self._sync_this_backward:
            self._before_synchronized_forward()
        started = time.perf_counter()
        output = self.module(*args, **kwargs)
        if self.tracer is not None and self._sync_this_backward:
            self.tracer.forward_done(started, time.perf_counter())
        if self._sync_this_backward and self.find_unused_parameters:
            reached = params_reached_from(output)
            self._unused = [p for p in self._params if id(p) not in reached]
        return output

    def _before_synchronized_forward(self) -> None:
        """The collectives that open a synchronized step, identical on every rank."""
        buffer_source, everyone_active = 0, True
        if self._join is not None:  # who is still training? (joined ranks answer "not me")
            active = self._join.exchange(active=True)
            buffer_source, everyone_active = self._join.last_active, all(active)
        if self.check_sync_every and everyone_active and self._synchronized_forwards % self.check_sync_every == 0:
            check_replicas_in_sync(self.module, self.process_group)
        self._synchronized_forwards += 1
        if self.world_size > 1:
            sync_buffers(self._buffers_to_sync, self.process_group, self.buffer_sync, buffer_source)

    def _shadow_synchronized_step(self, buffer_source: int) -> None:
        """What a joined rank does for each step the others still take: the
        same collectives, with nothing to contribute (see :mod:`minddp.join`)."""
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

    def join(self, divide_by_initial_world_size: bool = True) -> Join:
        """``with model.join():`` lets ranks with fewer batches finish early (see :mod:`minddp.join`)."""
        return Join(self, divide_by_initial_world_size)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication.

        The flag is read at *forward*: run the forward (and its backward)
        inside the context. The first synchronized backward after it averages
        everything accumulated so far, so k-1 steps inside ``no_sync`` plus one
        outside equal one step on a k-times larger batch.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    # -------------------------------------------------- the path of a gradient
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate hook: ``param.grad`` is final for this backward."""
        if not self._sync_this_backward:
            return
        now = time.perf_counter()
        if not self._backward_started:
            self._begin_backward(now)
        self.timeline.last_hook = now
        if self.tracer is not None:
            self.tracer.gradient_ready(self._names[self._index[param]], now, param.grad)
        if self._rebuild_after_first_step:
            self._arrival.append(self._index[param])
        self._mark_ready(param)

    def _begin_backward(self, now: float) -> None:
        self._backward_started = True
        self.timeline.clear()
        self.timeline.first_hook = now
        # Runs once autograd has finished the whole backward pass.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._locally_used = [True] * len(self._params)
        self._arrival = []  # only this backward's order counts (an earlier one may have failed)
        for p in self._unused:  # no gradient will come for these: count them now
            self._mark_ready(p)

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
        divisor = 1 if self._comm_hook is not None else self._divisor
        grad = param.grad
        if grad is None:  # unused here (but maybe used on another rank): contributes zero
            self._locally_used[self._index[param]] = False
            slot.zero_()
        elif grad.data_ptr() == slot.data_ptr():  # .grad is already this slot (bucket view)
            if divisor != 1:
                slot.mul_(1.0 / divisor)
        else:
            torch.mul(grad, 1.0 / divisor, out=slot) if divisor != 1 else slot.copy_(grad)
            if self.gradient_as_bucket_view:  # e.g. after zero_grad(set_to_none=True)
                param.grad = slot

    def _launch_ready_buckets(self) -> None:
        # Strict bucket order: a ready bucket waits for the ones before it, so
        # every rank issues the same all-reduces in the same order.
        while self._next_to_launch < len(self._buckets) and self._buckets[self._next_to_launch].ready:
            bucket = self._buckets[self._next_to_launch]
            now = time.perf_counter()
            with profiler_range(f"minddp.launch_bucket_{bucket.index}"):
                bucket.launch(self._communicate)
            self.timeline.launches.append(now)
            if self.tracer is not None:
                self.tracer.bucket_launched(bucket.index, bucket.buffer.nbytes, now, bucket.future)
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

    def _finish_backward(self) -> None:
        """End of backward: every bucket launched? wait for them, write ``.grad``."""
        self._backward_started = False
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
        with profiler_range("minddp.wait_buckets"):
            for bucket in self._buckets:
                bucket.wait()
        globally_used = self._globally_used()
        for bucket in self._buckets:
            for p, slot in zip(bucket.params, bucket.views):
                if globally_used is not None and not globally_used[self._index[p]]:
                    continue  # unused on every rank: .grad stays as it was (None stays None)
                if self.gradient_as_bucket_view:
                    if p.grad is not slot:  # usually already set by the hook
                        p.grad = slot
                elif p.grad is None:
                    p.grad = slot.clone()
                else:
                    p.grad.copy_(slot)
        self.timeline.finished = time.perf_counter()
        if self.tracer is not None:
            self.tracer.backward_done(self.timeline)
        self._backwards_done += 1
        self._reset_buckets()
        if self._rebuild_after_first_step:
            self._rebuild_in_arrival_order()

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

    # ------------------------------------------------------------- inspection
    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for tests and lessons)."""
        return [list(b.names) for b in self._buckets]
