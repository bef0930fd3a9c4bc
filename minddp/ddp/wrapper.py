"""MiniDDP: data parallelism as a wrapper around any ``nn.Module``.

This file is the wrapper: what happens at construction (the same model
everywhere, rank 0's weights everywhere, a reducer with one hook per
parameter, the parts the options pick: ``_build_reducer``) and at every
forward (does its backward synchronize? rank 0's buffers). The path of a
gradient from autograd's hook through the buckets to ``.grad`` is
:class:`minddp.ddp.reducer.Reducer`: read it next, then :mod:`minddp.ddp.buckets`.
``docs/reading_the_code.md`` lists the parts, with the option that picks each.

References: Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020; torch/nn/parallel/distributed.py and
torch/csrc/distributed/c10d/reducer.cpp, whose behaviour these files mirror.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from minddp.ddp.arguments import (buffer_rule, check_arguments, first_bucket_cap_mb, refuse_unsupported,
                                  warn_check_reduction_deprecated)
from minddp.ddp.broadcast import BufferSync, broadcast_coalesced
from minddp.ddp.bucket_assignment import LearnedBucketOrder, MiB
from minddp.ddp.compiled import register_reducer
from minddp.ddp.default_hooks import builtin_comm_hook, check_comm_hook
from minddp.ddp.observers.follow import FollowedGradient, follow
from minddp.ddp.observers.trace import ProfilerRanges, StepObserver, StepTimeline, Tracer
from minddp.ddp.parts.bucket_views import BucketViews
from minddp.ddp.parts.buffers_in_bucket import BuffersInLastBucket
from minddp.ddp.parts.comm_hook import CommHook
from minddp.ddp.parts.gradient_cases import GradientCases, sparse_embedding_weights
from minddp.ddp.parts.lent_buckets import BuffersPerBackward, lend_buckets
from minddp.ddp.parts.replica_checks import ReplicaChecks
from minddp.ddp.parts.static_graph import StaticGraph
from minddp.ddp.parts.uneven_inputs import MiniDDPJoinHook
from minddp.ddp.parts.unused_parameters import UnusedParameters
from minddp.ddp.placement import module_device, move_to_device, on_device, process_group_of
from minddp.ddp.reducer import FIRST_BUCKET_CAP_MB, ArrivalLog, Reducer, ReducerOptions
from minddp.ddp.replicas import check_same_parameters

__all__ = ["MiniDDP", "FIRST_BUCKET_CAP_MB"]

# Built again by __setstate__, never pickled: the process group, the reducer (its hooks are on these very
# parameters) and the parts and policies around it.
NOT_PICKLED = ("process_group", "reducer", "_observer", "bucket_planner", "_join_hook",
               "buffer_policy", "_replica_checks", "_profiler_ranges")


class MiniDDP(nn.Module, Joinable):
    """Wrap ``module`` so that ``backward()`` leaves the average gradient over all ranks.

    Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``, plus a few of
    MiniDDP's own (``reduce_dtype``, ``buffer_sync``, ``check_sync_every``, ``timeline``, ``trace``,
    ``learn_bucket_order``): each is described, one by one, in
    :mod:`minddp.ddp.arguments`, where it is checked; ``_build_reducer`` shows the part each one picks.

    Collectives are issued in the same order on every rank, by construction:
    all ranks build the same buckets and launch them strictly in bucket order.
    A torch ``Joinable``, as torch's DDP: ``with model.join():`` or torch's
    ``Join([model, ...])`` for uneven inputs.
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
                states = self._module_parameters() + (self._module_buffers() if init_sync_buffers else [])
                broadcast_coalesced(states, self.process_group)

        # 2. The reducer and its parts (no collective: a copy or a reloaded
        #    pickle builds them again, see __setstate__).
        self._build_reducer()

    def _build_reducer(self) -> None:
        """The reducer (minddp/ddp/reducer.py) with the parts this model's arguments choose, each an object of
        its own (minddp/ddp/parts/), the policies above it, and the forward's parts."""
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
        # Who watches? Nobody (the plain path), or the timeline and trace:
        self._observer = None
        if self.timeline_asked or self.trace:
            self._observer = StepObserver(dist.get_rank(self.process_group), self.trace, self.device,
                                          [name for name, _ in named])
        # How do buffers agree before a forward? By broadcast (torch's way), average, or in the last bucket:
        self.buffer_policy = passenger = None
        if self.buffer_sync != "off" and self.world_size > 1 and self._module_buffers():
            self.buffer_policy = BufferSync(self._module_buffers, self.process_group, self.buffer_sync)
            if self.buffer_sync == "with_gradients":
                self.buffer_policy = passenger = BuffersInLastBucket(
                    self._module_buffers, self.process_group, is_source=dist.get_rank(self.process_group) == 0)
        self.reducer = Reducer(params, [name for name, _ in named], self.process_group, options,
                               readiness=readiness, gradients=gradients, passenger=passenger,
                               observers=[self._observer] if self._observer else [])
        register_reducer(self.reducer)  # so that minddp.compile's graphs find it by its parameters
        if self.lazy_bucket_allocation:
            lend_buckets(self.reducer, BuffersPerBackward())
        # The policies above the reducer, through its interface:
        if self.learn_bucket_order and (self.static_graph or not self.find_unused_parameters):  # torch's rule
            LearnedBucketOrder(self.reducer, ArrivalLog())  # watches the first backward's arrivals, then rebuilds
        self.bucket_planner = None  # minddp_lab.auto.plan_buckets(self) sets one
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
        for observer in self.reducer.observers:
            observer.forward_started()
        output = self.module(*inputs, **kwargs)
        # torch reads the flag again here, at the end of the forward (Lightning's manual optimization
        # lowers it during the forward and arms the reducer itself before its backward).
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.require_forward_param_sync:
            if torch.autograd._profiler_enabled():  # a torch.profiler records: name the launches and the wait
                self.reducer.add_observer(self._profiler_ranges)
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

    # ---------------- options asked for after construction: each swaps or adds a part
    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]`` (the communication
        part :class:`~minddp.ddp.parts.comm_hook.CommHook`). torch's contract: once, before the first backward;
        the hook does the averaging (MiniDDP no longer divides by the world size for it)."""
        if self.reducer.communication.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self.reducer.backwards_done or self.reducer.phase.in_backward:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        check_comm_hook(hook)
        self.reducer.set_communication(CommHook(self.reducer, state, hook))
        self._buffers_by_broadcast()  # a hook need not be a sum: buffers go back to their broadcast

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch's built-in hooks by name, under torch's (private) method name: ``ALLREDUCE`` or ``FP16_COMPRESS``."""
        self.register_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type))
        self.reducer.communication.name = str(comm_hook_type)  # torch's logging data names a built-in by its type

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with model.join():`` lets ranks with fewer batches finish early: torch's ``Join([self])``
        (:mod:`minddp.ddp.parts.uneven_inputs`); ``throw_on_early_termination=True``: every rank
        raises as soon as one has run out instead."""
        return Join([self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, divide_by_initial_world_size: bool = True) -> MiniDDPJoinHook:
        """What the model does for a ``Join`` once its rank has run out of data
        (torch's ``Joinable`` contract); from then on a part of its forward too."""
        self._join_hook = MiniDDPJoinHook(self, divide_by_initial_world_size)
        self._buffers_by_broadcast()  # inside join, every synchronized forward broadcasts
        return self._join_hook

    @property
    def join_device(self) -> torch.device:
        """Where a ``Join``'s count lives (torch's ``Joinable`` contract)."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The ranks a ``Join`` counts over (torch's ``Joinable`` contract)."""
        return self.process_group

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether a synchronized forward brings the buffers into line (torch's name; ``broadcast_buffers`` too)."""
        return self._forward_sync_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        """Set on a built model, as frameworks do: it rules from the next forward on, as torch's DDP reads its
        flag at every forward. Switched on again, the kind asked at construction comes back (``average`` stays
        ``average``); buffers that rode in the last bucket (``with_gradients``) come by broadcast."""
        self._forward_sync_buffers = bool(value)
        if not value:
            self._buffers_by_broadcast()
            self.buffer_sync, self.buffer_policy = "off", None
        elif self.buffer_sync == "off":
            asked = self._buffer_sync_asked
            self.buffer_sync = asked if asked in ("broadcast", "average") else "broadcast"
            if self.world_size > 1 and self._module_buffers():
                self.buffer_policy = BufferSync(self._module_buffers, self.process_group, self.buffer_sync)

    broadcast_buffers = forward_sync_buffers  # torch's older name for the same flag

    def _buffers_by_broadcast(self) -> None:
        """Buffers no longer ride in the last bucket (``buffer_sync="with_gradients"``): a broadcast again."""
        if self.reducer.passenger is not None:
            self.reducer.set_passenger(None)
            self.buffer_policy = BufferSync(self._module_buffers, self.process_group, "broadcast")

    def follow(self, name: str) -> FollowedGradient:
        """Follow one parameter's gradient down the path in the next synchronized backwards
        (:mod:`minddp.ddp.observers.follow`): ``print(model.follow("0.weight").report())`` after one."""
        return follow(self.reducer, name)

    # ------------------------------------------------------------- inspection
    @property
    def timeline(self) -> StepTimeline:
        """When things happened in the last synchronized backward (with ``timeline=True`` or ``trace=True``:
        :mod:`minddp.ddp.observers.trace`)."""
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

    # ------------------------------------ torch's DDP names beyond its documented API
    # Frameworks, libraries and torch's own tests call these on a DDP model (docs/frameworks.md lists who
    # calls each). None is on the path of a gradient.
    def __getstate__(self) -> dict:
        """What ``torch.save`` and ``copy.deepcopy`` keep: the module and the settings, not the process group
        or the reducer; :meth:`__setstate__` builds them again, as torch's DDP does. Only with the default
        process group, the one a loading process can name."""
        if self.process_group is not dist.group.WORLD and \
                self.process_group != dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "MiniDDP can be pickled or copied only when it uses the default process group (constructed "
                "without process_group=): a process loading it could not name the group it used")
        state = dict(nn.Module.__getstate__(self) if hasattr(nn.Module, "__getstate__") else self.__dict__)
        for name in NOT_PICKLED:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        """The settings back, then the reducer and its parts built again."""
        nn.Module.__setstate__(self, state)
        self.process_group = dist.group.WORLD
        self._build_reducer()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]) -> None:
        """Leave these parameters and buffers (by name) out of MiniDDP, before wrapping ``module``: not
        broadcast, not averaged, no hook. For state a library keeps in sync itself (e.g. a sharded
        embedding table). torch's DDP's method of the same (private) name, which such libraries call."""
        module._ddp_params_and_buffers_to_ignore = list(names)

    @property
    def bucket_bytes_cap(self) -> int:
        """The cap in bytes, as torch names it."""
        return int(self.bucket_cap_mb * MiB)

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        return [int(cap * MiB) for cap in self.bucket_cap_mb_list or ()]

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """Is the first bucket smaller than the others (no cap given)?"""
        return self._first_bucket_cap_mb * MiB < self.bucket_bytes_cap

    @property
    def device_ids(self) -> list[int] | None:
        """torch's attribute: ``[the GPU's index]`` when ``device_ids`` was given for a GPU module, else None."""
        return None if self._input_device is None or self.device.type == "cpu" else [self.device.index]

    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch's dictionary of what the model is and did, for what MiniDDP knows, recorded when torch records
        it (``num_buckets_reduced``: the count of the backward before the last synchronized forward; torch
        samples it after its tenth iteration, MiniDDP records it at every one). The keys it has no value for
        (torch's timings, ``bucket_sizes`` of its construction-time buckets, ``can_set_static_graph``, its
        NCCL settings) are absent, as in torch before they are known, so ``.get(key)`` answers None.
        Lightning reads it after every ``fit``."""
        params = self.reducer.params
        data: dict[str, int | str] = {
            "world_size": self.world_size,
            "rank": dist.get_rank(self.process_group),
            "module_name": type(self.module).__name__,
            "device_ids": ",".join(str(i) for i in self.device_ids or ()),
            "output_device": self.device_ids[0] if self.device_ids else -1,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "backend_name": dist.get_backend(self.process_group),
            "has_sync_bn": int(any(type(m).__name__ == "SyncBatchNorm" for m in self.module.modules())),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
            "master_port": os.environ.get("MASTER_PORT", "N/A"),
        }
        if self.reducer.buckets_reduced_logged is not None:  # recorded at a synchronized forward, as torch's
            data["num_buckets_reduced"] = self.reducer.buckets_reduced_logged
        if self.reducer.communication.comm_hook is not None:
            data["comm_hook"] = self.reducer.communication.name
        return data
