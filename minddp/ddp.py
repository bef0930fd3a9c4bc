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

from minddp.bucket_order import LearnedBucketOrder
from minddp.bucket_planner import AutoBuckets
from minddp.comm_hooks import builtin_comm_hook, check_comm_hook
from minddp.features.bucket_views import BucketViews
from minddp.features.buffers_in_bucket import BuffersInLastBucket, CarryBuffers
from minddp.features.comm_hook import CommHook
from minddp.features.follow import Follow, FollowedGradient
from minddp.features.gradient_cases import GradientCases
from minddp.features.observed import Observed, ObservedGradients
from minddp.features.reduce_dtype import ReduceDtype
from minddp.features.replica_checks import ReplicaChecks
from minddp.features.static_graph import StaticGraph
from minddp.features.uneven_inputs import JoinedSteps, MiniDDPJoinHook
from minddp.features.unused_parameters import UnusedParameters
from minddp.join import Join, JoinHook
from minddp.reducer import FIRST_BUCKET_CAP_MB, Reducer, ReducerOptions
from minddp.replicas import check_same_parameters
from minddp.sync import BUFFER_POLICIES, broadcast_coalesced, module_device, move_to_device, on_device, sync_buffers
from minddp.trace import StepObserver, StepTimeline, Tracer

__all__ = ["MiniDDP", "FIRST_BUCKET_CAP_MB"]


class MiniDDP(nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves the average gradient over all ranks.

    Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``
    (each feature's file in :mod:`minddp.features` says more):

    * ``process_group``: the ranks to average over (default: the whole world).
    * ``bucket_cap_mb``: gradients travel in flat buckets of at most this many
      MiB (the first one at most 1 MiB); 0 means one parameter per bucket.
      ``"auto"`` (beyond torch): measure the first synchronized steps and the
      link, and rebuild the buckets once with the cap the alpha-beta model
      predicts fastest (:mod:`minddp.bucket_planner`).
    * ``broadcast_buffers``: before each forward that follows a synchronized
      one, whatever its grad mode, copy rank 0's buffers (BatchNorm's running
      statistics) to every rank. ``buffer_sync`` is what MiniDDP reads.
    * ``find_unused_parameters``: parameters that get no gradient on some
      rank count as zero there; without it such a parameter is an error at
      the end of backward, naming it.
    * ``gradient_as_bucket_view``: each ``p.grad`` is a view into its bucket.
    * ``device_ids``: the one device the module is on; given, the forward's
      inputs are moved there. ``output_device`` is accepted and ignored.
    * ``static_graph``: every iteration uses the same parameters the same
      number of times (lets a block run twice under a reentrant checkpoint).
    * ``require_backward_grad_sync`` (attribute), ``no_sync()``: accumulate
      gradients locally.

    Beyond torch's arguments:

    * ``reduce_dtype``: reduce gradients in this dtype (e.g. float32 for bf16).
    * ``buffer_sync``: ``"broadcast"`` (torch's way), ``"with_gradients"``
      (the same values, sent in the last gradient bucket: one collective fewer
      per step), ``"average"`` (floating-point buffers averaged over ranks) or
      ``"off"``; defaults to ``"broadcast"`` or ``"off"`` following ``broadcast_buffers``.
    * ``check_sync_every``: every N synchronized forwards, verify that all
      replicas hold identical parameters and buffers (:mod:`minddp.replicas`).
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
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = 25.0,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
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
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.buffer_sync = buffer_sync or ("broadcast" if broadcast_buffers else "off")
        if self.buffer_sync not in BUFFER_POLICIES:
            raise ValueError(f"buffer_sync must be one of {BUFFER_POLICIES}, got {buffer_sync!r}")
        if check_sync_every < 0:
            raise ValueError(f"check_sync_every must be >= 0 (0 = never), got {check_sync_every}")
        auto_buckets = isinstance(bucket_cap_mb, str)
        if auto_buckets and bucket_cap_mb != "auto":
            raise ValueError(f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}")
        if not auto_buckets and bucket_cap_mb is not None and bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0 (0: one parameter per bucket), got {bucket_cap_mb}")
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")
        self.check_sync_every = check_sync_every
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.reduce_dtype = reduce_dtype
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb  # "auto" stays "auto"

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "MiniDDP is not needed when a module has no parameter that requires a gradient "
                f"({type(module).__name__} has none): there is nothing to average"
            )
        self.device = module_device(list(module.parameters()), device_ids)
        self._input_device = self.device if device_ids is not None else None
        self._params = [p for _, p in named]

        # 1. Same model everywhere, then rank 0's values everywhere (on the
        #    module's GPU, whichever is current: see minddp.sync.on_device).
        with on_device(self.device):
            check_same_parameters(module, self.process_group)
            broadcast_coalesced(list(module.parameters()) + self._module_buffers(), self.process_group)

        # 2. The reducer: buckets, and one hook per parameter (minddp/reducer.py),
        #    then the features asked for, each a layer on it (minddp/features/).
        options = ReducerOptions(25.0 if auto_buckets else self.bucket_cap_mb, gradient_as_bucket_view,
                                 find_unused_parameters, static_graph, reduce_dtype, learn_bucket_order)
        self.reducer = Reducer(self._params, [name for name, _ in named], self.process_group, options)
        self._observer: StepObserver | None = None
        self._stack_features(named, timeline, trace)
        self.bucket_planner = None
        if auto_buckets and self.world_size > 1:  # alone, there is nothing to plan
            self.bucket_planner = AutoBuckets(self.reducer)

        self.require_backward_grad_sync = True  # torch's public switch; no_sync() sets it
        self.require_forward_param_sync = True  # did the last forward synchronize? (buffers, see forward)
        self.join_context: Join | None = None  # set by Join inside ``with model.join():``
        self._join_hook: MiniDDPJoinHook | None = None

    def _stack_features(self, named: list[tuple[str, nn.Parameter]], timeline: bool, trace: bool) -> None:
        """The layers this model's arguments ask for (each file in minddp/features says what it does)."""
        reducer, rank = self.reducer, dist.get_rank(self.process_group)
        if self.reduce_dtype is not None:
            reducer.add_layer(ReduceDtype, dtype=self.reduce_dtype)
        sparse = frozenset(i for i, p in enumerate(self._params) if id(p) in _sparse_embedding_weights(self.module))
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
        if timeline or trace:
            self._observer = StepObserver(rank, trace, self.device)
            reducer.add_layer(ObservedGradients if trace else Observed, observer=self._observer)
        if reducer.options.learn_bucket_order:
            LearnedBucketOrder(reducer)  # a policy: watches the first backward's arrivals, then rebuilds

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
        self.require_forward_param_sync = sync
        output = self.module(*inputs, **kwargs)
        if sync:
            self.reducer.prepare_for_backward(output)
        return output

    def _module_buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are *now*: read again at every use, as torch's DDP does, since
        a forward may re-assign one (``self.mean = 0.9 * self.mean + ...``) and ``model.double()``
        replaces them all; a list taken at construction would broadcast tensors nobody uses."""
        return list(self.module.buffers())

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

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch's built-in hooks by name, under torch's (private) method name: ``ALLREDUCE`` or ``FP16_COMPRESS``."""
        self.register_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type))

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True) -> Join:
        """``with model.join():`` lets ranks with fewer batches finish early
        (:mod:`minddp.join`, :mod:`minddp.features.uneven_inputs`)."""
        return Join([self], enable, divide_by_initial_world_size=divide_by_initial_world_size)

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


def _sparse_embedding_weights(module: nn.Module) -> set[int]:
    """``id`` of the weights whose gradients come sparse (torch's DDP asks the same question)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
