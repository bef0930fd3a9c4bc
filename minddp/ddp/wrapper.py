"""MiniDDP: data parallelism as a wrapper around any ``nn.Module``.

This file is the wrapper: what happens at construction (the same model
everywhere, rank 0's weights everywhere, a reducer with one hook per
parameter, the parts the options pick: ``_build_reducer``) and at every
forward (does its backward synchronize? rank 0's buffers). The path of a
gradient from autograd's hook through the buckets to ``.grad`` is
:class:`minddp.ddp.core.reducer.Reducer`: read it next, then the rest of
:mod:`minddp.ddp.core`.
``docs/reading_the_code.md`` lists the parts, with the option that picks each.

References: Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020; torch/nn/parallel/distributed.py and
torch/csrc/distributed/c10d/reducer.cpp, whose behaviour these files mirror.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from minddp.ddp.arguments import (buffer_rule, check_arguments, first_bucket_cap_mb, refuse_unsupported,
                                  warn_check_reduction_deprecated)
from minddp.ddp.broadcast import BufferSync, broadcast_coalesced
from minddp.ddp.core.reducer import FIRST_BUCKET_CAP_MB, CopyGradients, ReducerOptions
from minddp.ddp.later_options import LaterOptions
from minddp.ddp.observers.trace import ProfilerRanges, StepObserver
from minddp.ddp.compiled import register_reducer
from minddp.ddp.parts.bucket_views import BucketViews
from minddp.ddp.parts.buffers_in_bucket import BuffersInLastBucket, RidesInLastBucket
from minddp.ddp.parts.gradient_cases import GradientCases, sparse_embedding_weights
from minddp.ddp.parts.lent_buckets import BuffersPerBackward, lend_buckets
from minddp.ddp.parts.replica_checks import ReplicaChecks
from minddp.ddp.parts.static_graph import StaticGraph
from minddp.ddp.parts.uneven_inputs import MiniDDPJoinHook
from minddp.ddp.parts.unused_parameters import UnusedParameters
from minddp.ddp.placement import module_device, move_to_device, on_device, process_group_of
from minddp.ddp.policies import LearnedBucketOrder
from minddp.ddp.replicas import check_same_parameters
from minddp.ddp.torch_surface import TorchReducer, TorchSurface

__all__ = ["MiniDDP", "FIRST_BUCKET_CAP_MB"]

class MiniDDP(LaterOptions, TorchSurface, nn.Module, Joinable):
    """Wrap ``module`` so that ``backward()`` leaves the average gradient over all ranks.

    Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``, plus a few of
    MiniDDP's own (``reduce_dtype``, ``buffer_sync``, ``check_sync_every``, ``timeline``, ``trace``,
    ``learn_bucket_order``): each is described, one by one, in
    :mod:`minddp.ddp.arguments`, where it is checked; ``_build_reducer`` shows the part each one picks.

    Collectives are issued in the same order on every rank, by construction:
    all ranks build the same buckets and launch them strictly in bucket order.
    A torch ``Joinable``, as torch's DDP: ``with model.join():`` or torch's
    ``Join([model, ...])`` for uneven inputs.

    This class is construction and the forward; what is asked of a built model
    (a comm hook, ``join()``, the buffers' switch, ``follow``) is
    :class:`~minddp.ddp.later_options.LaterOptions`, and what torch's DDP offers
    beyond its documented API (pickling, logging data, private methods that
    frameworks call) is :class:`~minddp.ddp.torch_surface.TorchSurface`.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: list | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        lazy_bucket_allocation: bool = False,
        *,
        reduce_dtype: torch.dtype | None = None,
        buffer_sync: str | None = None,
        check_sync_every: int = 0,
        timeline: bool = False,
        trace: bool = False,
        learn_bucket_order: bool = True,
    ):
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError(
                "MiniDDP needs an initialized process group: call "
                "torch.distributed.init_process_group (or minddp.init_distributed) first"
            )
        refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                           lazy_bucket_allocation and gradient_as_bucket_view)
        if check_reduction:
            warn_check_reduction_deprecated()
        self.module = module
        self.dim = dim  # torch's too: it splits inputs over several devices of one process, which neither does
        self.process_group = process_group_of(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh  # torch's DDP has this attribute only when given one
        self.world_size = dist.get_world_size(self.process_group)
        self._forward_sync_buffers, init_sync_buffers = buffer_rule(broadcast_buffers, forward_sync_buffers)
        self.buffer_sync = buffer_sync or ("broadcast" if self._forward_sync_buffers else "off")
        check_arguments(self.buffer_sync, check_sync_every, bucket_cap_mb, bucket_cap_mb_list, reduce_dtype)
        self.check_sync_every, self._buffer_sync_asked = check_sync_every, buffer_sync  # (the latter: broadcast.py)
        self.find_unused_parameters = find_unused_parameters
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy  # MiniDDP always copies a bucket's gradients in one batch
        self.lazy_bucket_allocation = lazy_bucket_allocation
        self.static_graph = static_graph
        self.reduce_dtype = reduce_dtype
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb
        if bucket_cap_mb_list is not None:  # as torch: the largest is the cap reported
            self.bucket_cap_mb = max(bucket_cap_mb_list)
        self.bucket_cap_mb_list = list(bucket_cap_mb_list) if bucket_cap_mb_list is not None else None
        self._first_bucket_cap_mb = first_bucket_cap_mb(bucket_cap_mb, bucket_cap_mb_list, self.bucket_cap_mb)
        self.timeline_asked, self.trace, self.learn_bucket_order = timeline, trace, learn_bucket_order
        # Names a library synchronizes itself (torch's ``_set_params_and_buffers_to_ignore_for_model``).
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        if not any(p.requires_grad for p in module.parameters()):
            raise RuntimeError(
                "MiniDDP is not needed when a module has no parameter that requires a gradient "
                f"({type(module).__name__} has none): there is nothing to average"
            )
        self.device = module_device(list(module.parameters()), device_ids)
        self._input_device = self.device if device_ids is not None else None

        # 1. Same model everywhere, then rank 0's values everywhere (on the
        #    module's GPU, whichever is current: see minddp.ddp.placement.on_device).
        #    init_sync=False: the caller promises both already (torch's argument).
        if init_sync:
            with on_device(self.device):
                check_same_parameters(module, self.process_group, self.parameters_to_ignore)
                states = self.module_parameters() + (self.module_buffers() if init_sync_buffers else [])
                broadcast_coalesced(states, self.process_group)

        # 2. The reducer and its parts (no collective: a copy or a reloaded
        #    pickle builds them again, see __setstate__).
        self._build_reducer()

    def _build_reducer(self) -> None:
        """The reducer (minddp/ddp/core/reducer.py) with the parts this model's arguments choose, each an object
        of its own (minddp/ddp/parts/), the policies above it, and the forward's parts."""
        named = [(name, p) for name, p in self.module.named_parameters()
                 if p.requires_grad and name not in self.parameters_to_ignore]
        params, count = [p for _, p in named], len(named)
        options = ReducerOptions(self.bucket_cap_mb, self.find_unused_parameters,
                                 self.static_graph, self.reduce_dtype, self.learn_bucket_order,
                                 tuple(self.bucket_cap_mb_list or ()) or None, self._first_bucket_cap_mb)
        # When is a parameter ready? At its hook (the plain part), or:
        readiness = None
        if self.static_graph:
            readiness = StaticGraph(count, self.find_unused_parameters)
        elif self.find_unused_parameters:
            readiness = UnusedParameters(params, self.skip_all_reduce_unused_params)
        # How does a gradient get into its bucket and back? A batched copy each way (the plain part), or:
        sparse = frozenset(i for i, p in enumerate(params) if id(p) in sparse_embedding_weights(self.module))
        gradients = None
        if self.gradient_as_bucket_view:
            gradients = BucketViews(count, never=sparse)
        elif sparse:
            gradients = GradientCases(count)
        elif readiness is not None:  # a gradient may be missing
            gradients = GradientCases(count)
        # How do buffers agree before a forward? By broadcast (torch's way), average, or in the last bucket:
        self.buffer_policy = None
        if self.buffer_sync != "off" and self.world_size > 1 and self.module_buffers():
            self.buffer_policy = BufferSync(self.module_buffers, self.process_group, self.buffer_sync)
            if self.buffer_sync == "with_gradients":  # they ride with the gradients: a part around theirs
                self.buffer_policy = BuffersInLastBucket(
                    self.module_buffers, self.process_group, is_source=dist.get_rank(self.process_group) == 0)
                gradients = RidesInLastBucket(gradients or CopyGradients(), self.buffer_policy)
        self.reducer = TorchReducer(params, [name for name, _ in named], self.process_group, options,
                                    readiness=readiness, gradients=gradients)
        register_reducer(self.reducer)  # so that minddp.compile's graphs find it by its parameters
        # Who watches? Nobody (the plain path), or the timeline and trace:
        self._observer = None
        if self.timeline_asked or self.trace:
            self._observer = StepObserver(dist.get_rank(self.process_group), self.trace, self.device,
                                          [name for name, _ in named])
            self.reducer.add_observer(self._observer)
        if self.lazy_bucket_allocation:
            lend_buckets(self.reducer, BuffersPerBackward())
        # The policies above the reducer:
        if self.learn_bucket_order and (self.static_graph or not self.find_unused_parameters):  # torch's rule
            LearnedBucketOrder(self.reducer)  # watches the first backward's arrivals, then rebuilds
        # The forward's parts (join_hook adds the last):
        self._replica_checks = ReplicaChecks(self.module, self.process_group, self.check_sync_every) \
            if self.check_sync_every else None
        self._profiler_ranges = ProfilerRanges(self.reducer)
        self._join_hook: MiniDDPJoinHook | None = None
        self.require_backward_grad_sync = True  # torch's public switch; no_sync() sets it
        self.require_forward_param_sync = True  # did the last forward synchronize? (buffers, see forward)

    # ---------------------------------------------------------------- forward
    def forward(self, *inputs, **kwargs):
        """The module's forward, after deciding whether its backward synchronizes, and the buffers.

        The decision is taken here, at forward, as in torch's DDP: a forward
        with ``require_backward_grad_sync`` False (inside ``no_sync()``) makes
        its backward skip communication. torch's rule for buffers: broadcast
        rank 0's before a forward when the forward before it synchronized,
        whatever this one's grad mode: an evaluation forward after a training
        step sees rank 0's BatchNorm statistics on every rank, and the forward
        that closes a ``no_sync()`` accumulation keeps what the micro-steps did.
        """
        if self.reducer.phase.in_backward:
            raise self._unfinished_backward_error()
        if self._input_device is not None:  # device_ids given: the inputs go there, as torch's DDP does
            inputs, kwargs = move_to_device((inputs, kwargs), self._input_device)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if sync:
            self.reducer.rebuild_if_due()  # as torch: after zero_grad() let the old buckets' .grad go
        buffers_from = 0 if self.require_forward_param_sync else None  # rank 0's, after a synchronized forward
        if sync and self._join_hook is not None:  # under join(): who still trains, and whose buffers count
            buffers_from = self._join_hook.before_forward(buffers_from)
        if sync and self._replica_checks is not None:
            self._replica_checks.before_forward(self._join_hook is None or
                                                self._join_hook.ranks_training() == self.world_size)
        if buffers_from is not None and self.buffer_policy is not None:
            self.buffer_policy.before_forward(buffers_from)
        self.reducer.observer.forward_started()
        output = self.module(*inputs, **kwargs)
        # torch reads the flag again here, at the end of the forward (Lightning's manual optimization
        # lowers it during the forward and arms the reducer itself before its backward).
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.require_forward_param_sync:
            if torch.autograd._profiler_enabled():  # a torch.profiler records: name the launches and the wait
                self.reducer.add_observer(self._profiler_ranges)
            self.reducer.prepare_for_backward(output)
        return output

    def module_buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are *now*: read again at every use, as torch's DDP does, since
        a forward may re-assign one (``self.mean = 0.9 * self.mean + ...``) and ``model.double()``
        replaces them all; a list taken at construction would broadcast tensors nobody uses."""
        if not self.parameters_to_ignore:
            return list(self.module.buffers())
        return [b for name, b in self.module.named_buffers() if name not in self.parameters_to_ignore]

    def module_parameters(self) -> list[nn.Parameter]:
        """Every parameter MiniDDP keeps equal on all ranks (trainable or not; not those left to the user)."""
        return [p for name, p in self.module.named_parameters() if name not in self.parameters_to_ignore]

    def _unfinished_backward_error(self) -> RuntimeError:
        missing = self.reducer.abandon_unfinished_backward()
        return RuntimeError(
            "MiniDDP: the previous backward started averaging gradients but never finished: "
            f"parameters {missing} received no gradient. Did that backward fail, or leave some "
            "parameters out of the loss? For parameters a forward may not use, construct "
            "MiniDDP(..., find_unused_parameters=True)."
        )

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
