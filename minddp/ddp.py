"""MiniDDP: data parallelism as a wrapper around any ``nn.Module``.

This file is the wrapper: what happens at construction (the same model
everywhere, rank 0's weights everywhere, a reducer with one hook per
parameter) and at every forward (does its backward synchronize? rank 0's
buffers). The averaging itself, the path of a gradient from autograd's hook
through the buckets to ``.grad``, is :class:`minddp.reducer.Reducer`: read
it next, then :mod:`minddp.buckets`. Every feature beyond that plain path
is a layer on the reducer, one file each in :mod:`minddp.features`, chosen
here at construction (``_stack_features``) or when asked for later
(``register_comm_hook``, ``join``, ``follow``).

References: Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020; torch/nn/parallel/distributed.py and
torch/csrc/distributed/c10d/reducer.cpp, whose behaviour these files mirror.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _get_device_index

from minddp.bucket_order import LearnedBucketOrder
from minddp.bucket_planner import AutoBuckets
from minddp.buckets import BuffersPerBackward
from minddp.arguments import (check_arguments, refuse_unsupported, warn_broadcast_buffers_deprecated,
                              warn_check_reduction_deprecated)
from minddp.comm_hooks import check_comm_hook
from minddp.features.bucket_views import BucketViews
from minddp.features.buffers_in_bucket import BuffersInLastBucket, CarryBuffers
from minddp.features.comm_hook import CommHook
from minddp.features.follow import Follow, FollowedGradient
from minddp.features.gradient_cases import GradientCases, sparse_embedding_weights
from minddp.features.observed import Observed, ObservedGradients
from minddp.features.reduce_dtype import ReduceDtype
from minddp.features.replica_checks import ReplicaChecks
from minddp.features.static_graph import StaticGraph
from minddp.features.uneven_inputs import JoinedSteps, MiniDDPJoinHook
from minddp.features.unused_parameters import UnusedParameters
from minddp.join import Join, JoinHook
from minddp.reducer import FIRST_BUCKET_CAP_MB, Reducer, ReducerOptions
from minddp.replicas import check_same_parameters
from minddp.torch_ddp_calls import TorchDDPCalls
from minddp.sync import broadcast_coalesced, module_device, move_to_device, on_device, process_group_of, sync_buffers
from minddp.trace import StepObserver, StepTimeline, Tracer

__all__ = ["MiniDDP", "FIRST_BUCKET_CAP_MB"]


class MiniDDP(TorchDDPCalls, nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves the average gradient over all ranks.

    Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``
    (the file of each feature in :mod:`minddp.features` says more):

    * ``process_group`` or a one-dimensional ``device_mesh``: the ranks to
      average over (default: the whole world).
    * ``bucket_cap_mb``: buckets close once they hold this many MiB (default 25, the first
      at 1 MiB); 0: one parameter each; one bucket until a backward showed the order (torch's rule);
      ``bucket_cap_mb_list``: one cap per bucket, in launch order (the last
      for every bucket after it). ``"auto"`` (beyond torch): measure the first
      steps and the link, and rebuild the buckets once with the cap the
      alpha-beta model predicts fastest (:mod:`minddp.bucket_planner`).
    * ``forward_sync_buffers`` (torch 2.14's name; ``broadcast_buffers`` the
      older one): before each forward that follows a synchronized one,
      whatever its grad mode, and after a ``join``, copy rank 0's buffers
      (BatchNorm's running statistics) to every rank, read from the module
      each time. At construction too, unless ``broadcast_buffers=False``
      is given (torch's rule). ``buffer_sync`` is what MiniDDP reads.
    * ``find_unused_parameters``: parameters that get no gradient on some
      rank count as zero there; without it such a parameter is an error at
      the end of backward, naming it. ``skip_all_reduce_unused_params``:
      with it, a promise that the unused ones stay the same on every rank.
    * ``gradient_as_bucket_view``: each ``p.grad`` is a view into its bucket.
    * ``device_ids``: the module's one device; the forward's inputs go there (``output_device``
      and ``dim``: kept, and without effect, as in torch's DDP with one device per process).
    * ``init_sync``: at construction, check that every rank has the same parameters and copy rank
      0's values everywhere (default); False: the caller promises both.
    * ``batched_grad_copy`` (torch 2.15): copy a bucket's gradients in and out in one batched call.
      MiniDDP always does (:meth:`minddp.buckets.Bucket.copy_in`); kept for torch's signature.
    * ``lazy_bucket_allocation`` (torch 2.15): a bucket's buffer is allocated when its gradients
      are copied in, and freed once they are back in ``.grad``: no bucket memory between steps.
    * ``check_reduction``: deprecated in torch, a ``FutureWarning`` here too.
    * ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce`` and ``mixed_precision``
      (torch's internal and prototype options): refused with an error that says what to use instead.
    * ``static_graph``: every iteration uses the same parameters the same
      number of times (lets a block run twice under a reentrant checkpoint).
    * ``require_backward_grad_sync`` (attribute), ``no_sync()``: accumulate gradients locally.

    Beyond torch's arguments:

    * ``reduce_dtype``: reduce gradients in this dtype (e.g. float32 for bf16).
    * ``buffer_sync``: ``"broadcast"`` (torch's way), ``"with_gradients"``
      (the same values, sent in the last gradient bucket: one collective fewer
      per step), ``"average"`` (floating-point buffers averaged over ranks) or
      ``"off"``; by default ``"broadcast"``, or ``"off"`` without ``forward_sync_buffers``.
    * ``check_sync_every``: every N synchronized forwards, verify that the replicas are identical.
    * ``timeline``: record when things happened in the last synchronized
      backward (``model.timeline``); ``trace``: record every hook and bucket
      for a Chrome trace (``model.tracer.export_chrome_trace(path)``).
    * ``learn_bucket_order``: after the first synchronized backward, rebuild
      the buckets in the order gradients arrived (torch's DDP always does).

    Collectives are issued in the same order on every rank, by construction:
    all ranks build the same buckets and launch them strictly in bucket order.
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
        # torch 2.14's buffer rule: forward_sync_buffers says whether buffers are synchronized at
        # forward (and after a join); they are at construction too, unless the older
        # broadcast_buffers=False alone asked for neither.
        if broadcast_buffers is not None:
            warn_broadcast_buffers_deprecated(forward_sync_buffers is not None)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is not False
        self.broadcast_buffers = self.forward_sync_buffers  # torch keeps the old name as an alias
        self.buffer_sync = buffer_sync or ("broadcast" if self.forward_sync_buffers else "off")
        check_arguments(self.buffer_sync, check_sync_every, bucket_cap_mb, bucket_cap_mb_list, reduce_dtype)
        self.check_sync_every = check_sync_every
        self.find_unused_parameters = find_unused_parameters
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy  # MiniDDP always copies a bucket's gradients in one batch
        self.lazy_bucket_allocation = lazy_bucket_allocation
        self.static_graph = static_graph
        self.reduce_dtype = reduce_dtype
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb  # "auto" stays "auto"
        if bucket_cap_mb_list is not None:  # as torch: the largest is the cap reported
            self.bucket_cap_mb = max(bucket_cap_mb_list)
        self.bucket_cap_mb_list = list(bucket_cap_mb_list) if bucket_cap_mb_list is not None else None
        given = bucket_cap_mb not in (None, "auto") or bucket_cap_mb_list is not None  # torch: then no 1 MiB first
        self._first_bucket_cap_mb = self.bucket_cap_mb if given else FIRST_BUCKET_CAP_MB
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
        self.device_ids = None if device_ids is None else [_get_device_index(d, True) for d in device_ids]

        # 1. Same model everywhere, then rank 0's values everywhere (on the
        #    module's GPU, whichever is current: see minddp.sync.on_device).
        #    init_sync=False: the caller promises both already (torch's argument).
        if init_sync:
            with on_device(self.device):
                check_same_parameters(module, self.process_group, self.parameters_to_ignore)
                states = self._module_parameters() + (self._module_buffers() if init_sync_buffers else [])
                broadcast_coalesced(states, self.process_group)

        # 2. The reducer and its layers (no collective: a copy or a reloaded
        #    pickle builds them again, see __setstate__).
        self._build_reducer()

    def _build_reducer(self) -> None:
        """The reducer: buckets, and one hook per parameter (minddp/reducer.py), then the features asked
        for, each a layer on it (minddp/features/), and the policies above it."""
        named = [(name, p) for name, p in self.module.named_parameters()
                 if p.requires_grad and name not in self.parameters_to_ignore]
        self._params = [p for _, p in named]
        auto_buckets = self.bucket_cap_mb == "auto"
        options = ReducerOptions(25.0 if auto_buckets else self.bucket_cap_mb, self.gradient_as_bucket_view,
                                 self.find_unused_parameters, self.static_graph, self.reduce_dtype,
                                 self.learn_bucket_order, self.skip_all_reduce_unused_params,
                                 tuple(self.bucket_cap_mb_list) if self.bucket_cap_mb_list else None,
                                 self._first_bucket_cap_mb)
        self.reducer = Reducer(self._params, [name for name, _ in named], self.process_group, options)
        if self.lazy_bucket_allocation:
            self.reducer.use_bucket_storage(BuffersPerBackward())
        self._observer: StepObserver | None = None
        self._stack_features()
        if self.learn_bucket_order and (self.static_graph or not self.find_unused_parameters):  # torch's rule
            LearnedBucketOrder(self.reducer)  # a policy: watches the first backward's arrivals, then rebuilds
        self.bucket_planner = None
        if auto_buckets and self.world_size > 1:  # alone, there is nothing to plan
            self.bucket_planner = AutoBuckets(self.reducer)
        self.require_backward_grad_sync = True  # torch's public switch; no_sync() sets it
        self.require_forward_param_sync = True  # did the last forward synchronize? (buffers, see forward)
        self.join_context: Join | None = None  # set by Join inside ``with model.join():``
        self._join_hook: MiniDDPJoinHook | None = None

    def _stack_features(self) -> None:
        """The layers this model's arguments ask for (each file in minddp/features says what it does)."""
        reducer, rank = self.reducer, dist.get_rank(self.process_group)
        if self.reduce_dtype is not None:
            reducer.add_layer(ReduceDtype, dtype=self.reduce_dtype)
        sparse = frozenset(i for i, p in enumerate(self._params) if id(p) in sparse_embedding_weights(self.module))
        if sparse:
            reducer.add_layer(GradientCases)
        if self.gradient_as_bucket_view:
            reducer.add_layer(BucketViews, sparse=sparse)
        if self.static_graph:
            reducer.add_layer(StaticGraph, find_unused=self.find_unused_parameters)
        elif self.find_unused_parameters:
            reducer.add_layer(UnusedParameters)
        if self.buffer_sync == "with_gradients" and self.world_size > 1 and self._module_buffers():
            reducer.add_layer(CarryBuffers, passenger=BuffersInLastBucket(self._module_buffers, is_source=rank == 0))
        if self.check_sync_every:
            reducer.add_layer(ReplicaChecks, module=self.module, every=self.check_sync_every)
        if self.timeline_asked or self.trace:
            self._observer = StepObserver(rank, self.trace, self.device)
            reducer.add_layer(ObservedGradients if self.trace else Observed, observer=self._observer)

    # ------------------------------------------------- pickling and copying
    def __getstate__(self) -> dict:
        """What ``torch.save`` and ``copy.deepcopy`` keep: the module and the settings, not the process
        group or the reducer (its hooks are on these very parameters); ``__setstate__`` builds them again,
        as torch's DDP does. Only with the default process group, the one a loading process can name."""
        if self.process_group is not dist.group.WORLD and self.process_group != dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "MiniDDP can be pickled or copied only when it uses the default process group (constructed "
                "without process_group=): a process loading it could not name the group it used")
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        for name in ("process_group", "reducer", "_observer", "bucket_planner", "join_context", "_join_hook", "_params"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self._build_reducer()

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
        if self.reducer.backward_started:
            raise self._unfinished_backward_error()
        if self._input_device is not None:  # device_ids given: the inputs go there, as torch's DDP does
            inputs, kwargs = move_to_device((inputs, kwargs), self._input_device)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        buffers_from = self.reducer.prepare_for_forward(sync, buffers_due=self.require_forward_param_sync)
        if buffers_from is not None and self.world_size > 1 and self.buffer_sync != "off":
            buffers = self._module_buffers()
            if buffers:
                sync_buffers(buffers, self.process_group, self.buffer_sync, buffers_from)
        output = self.module(*inputs, **kwargs)
        # torch reads the flag again here, at the end of the forward (Lightning's manual optimization
        # lowers it during the forward and arms the reducer itself before its backward).
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.require_forward_param_sync:
            self.reducer.prepare_for_backward(output)
        return output

    def _module_buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are *now*: read again at every use, as torch's DDP does, since
        a forward may re-assign one (``self.mean = 0.9 * self.mean + ...``) and ``model.double()``
        replaces them all; a list taken at construction would broadcast tensors nobody uses."""
        if not self.parameters_to_ignore:
            return list(self.module.buffers())
        return [b for name, b in self.module.named_buffers() if name not in self.parameters_to_ignore]

    def _module_parameters(self) -> list[nn.Parameter]:
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

    # -------------------------------------------- features asked for later
    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]``
        (:mod:`minddp.features.comm_hook`). torch's contract: once, before the first backward; the
        hook does the averaging (MiniDDP no longer divides by the world size for it)."""
        if self.reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self.reducer.backwards_done or self.reducer.backward_started:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        check_comm_hook(hook)
        self.reducer.add_layer(CommHook, state=state, hook=hook)
        self.reducer.remove_layer(CarryBuffers)  # a hook need not be a sum: buffers go back to their broadcast

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with model.join():`` lets ranks with fewer batches finish early (:mod:`minddp.join`,
        :mod:`minddp.features.uneven_inputs`); ``throw_on_early_termination=True``: every rank
        raises as soon as one has run out instead."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, divide_by_initial_world_size: bool = True) -> JoinHook:
        """What this model does for a ``Join`` (minddp's or torch's) once its rank has run out of data."""
        if self.buffer_sync == "average":
            raise ValueError(
                "join() needs buffer_sync='broadcast' or 'off': a rank that has run out of data "
                "would pull the averaged buffers towards its stale ones"
            )
        self.reducer.remove_layer(CarryBuffers)  # inside join, every synchronized forward broadcasts
        self.reducer.add_layer(JoinedSteps, ddp=self)
        self._join_hook = MiniDDPJoinHook(self, divide_by_initial_world_size)
        return self._join_hook

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    @property
    def join_device(self) -> torch.device:
        return self.device

    def follow(self, name: str) -> FollowedGradient:
        """Follow one parameter's gradient down the path in the next synchronized backwards
        (:mod:`minddp.features.follow`): ``print(model.follow("0.weight").report())`` after one."""
        names = self.reducer.names
        index = names.index(name) if name in names else names.index(name[7:]) if name[7:] in names else None
        if index is None:
            raise ValueError(f"MiniDDP.follow: no parameter named {name!r} with a gradient to follow; "
                             f"the module's are {names}")
        self.reducer.add_layer(Follow)
        return self.reducer.follow(index)

    # ------------------------------------------------------------- inspection
    @property
    def timeline(self) -> StepTimeline:
        """When things happened in the last synchronized backward (with ``timeline=True`` or ``trace=True``)."""
        if self._observer is None:
            raise RuntimeError("MiniDDP records no timeline unless asked: construct MiniDDP(..., timeline=True)")
        return self._observer.timeline

    @property
    def tracer(self) -> Tracer | None:
        """The Chrome-trace recorder, with ``trace=True``; None otherwise."""
        return self._observer.tracer if self._observer is not None else None

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for tests and lessons)."""
        return [list(b.names) for b in self.reducer.buckets]

