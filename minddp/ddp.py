"""MiniDDP: data parallelism as a wrapper around any ``nn.Module``.

This file is the wrapper: what happens at construction (the same model
everywhere, rank 0's weights everywhere) and at every forward (should this
step synchronize? buffers, uneven inputs, the desync check). The averaging
itself, the path of a gradient from autograd's hook through the buckets to
``.grad``, is :class:`minddp.reducer.Reducer`; read it next.

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
from minddp.buffers_in_bucket import BuffersInLastBucket
from minddp.comm_hooks import builtin_comm_hook, check_comm_hook
from minddp.join import Join, JoinHook, under_torchs_join
from minddp.reducer import FIRST_BUCKET_CAP_MB, Reducer, ReducerOptions
from minddp.replicas import check_replicas_in_sync, check_same_parameters
from minddp.sync import (BUFFER_POLICIES, broadcast_coalesced, module_device, move_to_device, on_device,
                         params_reached_from, sync_buffers)
from minddp.trace import StepObserver, StepTimeline, Tracer

__all__ = ["MiniDDP", "FIRST_BUCKET_CAP_MB"]


class MiniDDP(nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves the average gradient over all ranks.

    Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``:

    * ``process_group``: the ranks to average over (default: the whole world).
    * ``bucket_cap_mb``: gradients travel in flat buckets of at most this many
      MiB (the first one at most 1 MiB); 0 means one parameter per bucket.
      ``"auto"`` (beyond torch): start at 25, measure the first synchronized
      steps and the link, and rebuild the buckets once with the cap the
      alpha-beta model predicts fastest (:mod:`minddp.bucket_planner`); rank
      0 prints one line saying what it chose and why.
    * ``forward_sync_buffers`` (torch 2.14's name; ``broadcast_buffers`` is
      the older one): before each forward that follows a synchronized one
      (torch's ``require_forward_param_sync``), whatever its grad mode, and
      after a ``join``, copy rank 0's buffers (BatchNorm running statistics)
      to every rank. Buffers are read from the module each time (a forward
      may re-assign one). At construction buffers are copied too, unless
      ``broadcast_buffers=False`` is given (torch's rule). ``buffer_sync`` is
      what MiniDDP reads.
    * ``find_unused_parameters``: allow parameters that get no gradient on
      some rank; they count as zero there. Without it such a parameter is an
      error at the end of backward, naming it.
    * ``gradient_as_bucket_view``: make ``p.grad`` a view into its bucket, so
      no gradient is copied and no second copy of all gradients is kept.
    * ``device_ids``: the one device the module is on (an int, a string or a
      ``torch.device``); given, the forward's inputs are moved there, as
      torch's DDP does. ``output_device`` is accepted and ignored. A module
      whose parameters are on more than one device is refused.
    * ``static_graph``: promise that every iteration uses the same parameters
      the same number of times. The first backward counts each parameter's
      gradient hooks and reduces everything at its end; later ones mark a
      parameter ready at its last hook. This is what lets a block run twice
      under a reentrant activation checkpoint (two nested passes, two hooks).
    * ``skip_all_reduce_unused_params``: with ``find_unused_parameters``, a
      promise that the unused parameters stay the same on every rank for the
      whole run: which parameters some rank used is exchanged once, at the
      first backward, instead of at every one.
    * ``device_mesh``: a one-dimensional ``DeviceMesh`` naming the ranks,
      instead of ``process_group``.
    * ``bucket_cap_mb_list``: one cap per bucket, in launch order (the last
      one for every bucket after it), instead of one cap for all.
    * ``require_backward_grad_sync`` (attribute): set it to False before a
      forward to accumulate gradients locally (nanoGPT's idiom); ``no_sync()``
      does just that for the duration of a ``with`` block.

    Beyond torch's arguments:

    * ``reduce_dtype``: reduce gradients in this dtype (e.g. ``torch.float32``
      for bf16 or fp16 parameters): buckets hold it, gradients are cast into
      them and back. Twice the bytes of bf16 on the wire, one rounding at the
      end instead of one per addition. (torch: ``mixed_precision.reduce_dtype``.)
    * ``buffer_sync``: ``"broadcast"`` (rank 0's buffers, torch's way),
      ``"with_gradients"`` (the same values, but sent in the last gradient
      bucket of each synchronized backward instead of a broadcast before the
      next forward: one collective fewer per step; see
      :mod:`minddp.buffers_in_bucket` for the one case where it differs:
      rank 0 alone changing its buffers between a backward and the next forward),
      ``"average"`` (average floating-point buffers over ranks) or ``"off"``;
      defaults to ``"broadcast"`` or ``"off"`` following ``forward_sync_buffers``.
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
        bucket_cap_mb: float | str | None = 25.0,
        broadcast_buffers: bool | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        forward_sync_buffers: bool | None = None,
        skip_all_reduce_unused_params: bool = False,
        device_mesh: Any = None,
        bucket_cap_mb_list: list[float] | None = None,
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
        self.process_group = _process_group(process_group, device_mesh)
        self.world_size = dist.get_world_size(self.process_group)
        # torch 2.14's buffer rule: forward_sync_buffers says whether buffers are synchronized at
        # forward (and after a join); they are at construction too, unless the older
        # broadcast_buffers=False alone asked for neither.
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is not False
        self.broadcast_buffers = self.forward_sync_buffers  # torch keeps the old name as an alias
        self.buffer_sync = buffer_sync or ("broadcast" if self.forward_sync_buffers else "off")
        if self.buffer_sync not in BUFFER_POLICIES:
            raise ValueError(f"buffer_sync must be one of {BUFFER_POLICIES}, got {buffer_sync!r}")
        if check_sync_every < 0:
            raise ValueError(f"check_sync_every must be >= 0 (0 = never), got {check_sync_every}")
        auto_buckets = isinstance(bucket_cap_mb, str)
        if auto_buckets and bucket_cap_mb != "auto":
            raise ValueError(f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}")
        if not auto_buckets and bucket_cap_mb is not None and bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0 (0: one parameter per bucket), got {bucket_cap_mb}")
        if bucket_cap_mb_list is not None and (auto_buckets or not bucket_cap_mb_list
                                               or any(cap < 0 for cap in bucket_cap_mb_list)):
            raise ValueError("bucket_cap_mb_list must be a non-empty list of MiB >= 0, one cap per bucket "
                             f"(the last one for every bucket after), without bucket_cap_mb='auto'; got "
                             f"{bucket_cap_mb_list!r}")
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")
        self.check_sync_every = check_sync_every
        self.find_unused_parameters = find_unused_parameters
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.reduce_dtype = reduce_dtype
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb  # "auto" stays "auto"
        if bucket_cap_mb_list is not None:  # as torch: the largest is the cap reported
            self.bucket_cap_mb = max(bucket_cap_mb_list)
        self.bucket_cap_mb_list = list(bucket_cap_mb_list) if bucket_cap_mb_list is not None else None
        self.trace, self.learn_bucket_order = trace, learn_bucket_order
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
        #    module's GPU, whichever is current: see minddp.sync.on_device).
        with on_device(self.device):
            check_same_parameters(module, self.process_group)
            states = self._module_parameters() + (self._module_buffers() if init_sync_buffers else [])
            broadcast_coalesced(states, self.process_group)

        # 2. The reducer and the policies above it (no collective: a copy or a
        #    reloaded pickle builds them again, see __setstate__).
        self._build_reducer()

    def _build_reducer(self) -> None:
        """The reducer: buckets, and one hook per parameter (minddp/reducer.py); then the policies above it."""
        named = [(name, p) for name, p in self.module.named_parameters()
                 if p.requires_grad and name not in self.parameters_to_ignore]
        self._params = [p for _, p in named]
        self._observer = StepObserver(dist.get_rank(self.process_group), self.trace, self.device)
        auto_buckets = self.bucket_cap_mb == "auto"
        options = ReducerOptions(25.0 if auto_buckets else self.bucket_cap_mb, self.gradient_as_bucket_view,
                                 self.find_unused_parameters, self.static_graph, self.reduce_dtype,
                                 self.learn_bucket_order, self.skip_all_reduce_unused_params,
                                 tuple(self.bucket_cap_mb_list) if self.bucket_cap_mb_list else None)
        self.reducer = Reducer(self._params, [name for name, _ in named], self.process_group, options, self._observer)
        # Policies above the reducer, driving it through its hook points
        # (minddp/reducer_hooks.py): the learned bucket order (torch's), the
        # buffers riding in the last bucket, then bucket_cap_mb="auto".
        if self.learn_bucket_order:
            LearnedBucketOrder(self.reducer)
        if self.buffer_sync == "with_gradients" and self.world_size > 1 and self._module_buffers():
            self.reducer.carry_in_last_bucket(
                BuffersInLastBucket(self._module_buffers, is_source=dist.get_rank(self.process_group) == 0))
        self.bucket_planner = None
        if auto_buckets and self.world_size > 1:  # alone, there is nothing to plan
            self.bucket_planner = AutoBuckets(self.reducer)

        self.require_backward_grad_sync = True  # torch's public switch; no_sync() sets it
        self.require_forward_param_sync = True  # did the last forward synchronize? (buffers, see forward)
        self._synchronized_forwards = 0
        self.join_context: Join | None = None  # set by Join inside ``with model.join():``
        self._join_hook: _MiniDDPJoinHook | None = None

    # ------------------------------------------------- pickling and copying
    def __getstate__(self) -> dict:
        """What ``torch.save`` and ``copy.deepcopy`` keep: the module and the settings, not the process
        group or the reducer (its hooks are on these very parameters); ``__setstate__`` builds them again,
        as torch's DDP does. Only with the default process group, the one a loading process can name."""
        if self.process_group is not dist.group.WORLD and self.process_group != dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "MiniDDP can be pickled or copied only when it uses the default process group (constructed "
                "without process_group=): a process loading it could not name the group it used")
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        for name in ("process_group", "reducer", "_observer", "bucket_planner", "join_context", "_join_hook", "_params"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self._build_reducer()

    @property
    def timeline(self) -> StepTimeline:
        """When things happened in the last synchronized backward (always recorded)."""
        return self._observer.timeline

    @property
    def tracer(self) -> Tracer | None:
        """The Chrome-trace recorder, with ``trace=True``; None otherwise."""
        return self._observer.tracer

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]``.

        torch's contract: once, before the first backward; the hook does the
        averaging (MiniDDP no longer divides by the world size for it).
        """
        if self.reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self.reducer.backwards_done or self.reducer.backward_started:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        check_comm_hook(hook)
        self.reducer.comm_hook = (state, hook)
        if self.reducer.passenger is not None:  # a hook need not be a sum: buffers go back to their broadcast
            self.reducer.carry_in_last_bucket(None)

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch's built-in hooks by name, under torch's (private) method name: ``ALLREDUCE`` or ``FP16_COMPRESS``."""
        self.register_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type))

    # ---------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        args, kwargs = self._inputs_on_device(args, kwargs)
        if self.reducer.backward_started:
            raise self._unfinished_backward_error()
        # The sync decision is taken here, at forward, as in torch's DDP: a
        # forward with require_backward_grad_sync False (inside no_sync())
        # makes its backward skip communication.
        sync = self.reducer.sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.reducer.forward_inside_backward = sync and torch._C._current_graph_task_id() != -1
        buffer_source = self._before_synchronized_forward() if sync else 0
        # torch's rule for buffers: broadcast before a forward when the forward
        # before it synchronized, whatever this one's grad mode. So an
        # evaluation forward after a training step sees rank 0's BatchNorm
        # statistics on every rank, and the synchronized forward that closes a
        # no_sync() accumulation does not overwrite what the micro-steps did.
        # Inside join() every synchronized forward broadcasts: a rank that ran
        # out of data shadows each one with a broadcast, not knowing what the
        # others' previous forward was.
        # With buffer_sync="with_gradients" the last backward may have brought
        # rank 0's buffers already, in its last bucket: written now, where
        # torch's broadcast would write them.
        in_join = sync and self.join_context is not None
        if (self.require_forward_param_sync or in_join) and self.world_size > 1:
            if self.reducer.passenger_arrived and not in_join and self.reducer.passenger.deliver():
                pass  # rank 0's buffers came with the gradients
            else:
                sync_buffers(self._module_buffers(), self.process_group, self.buffer_sync, buffer_source)
        self.require_forward_param_sync = sync
        self.reducer.passenger_arrived = False
        self.reducer.carry_passenger = sync and not in_join  # read only if a passenger is set up
        started = self._observer.forward_started()
        output = self.module(*args, **kwargs)
        if sync:
            self._observer.forward_done(started)
            if self.find_unused_parameters and not self.static_graph:
                # (A static graph learns its unused parameters from its first
                # backward, so torch skips this walk then, and so do we: it
                # would count a parameter behind a reentrant checkpoint as
                # unused before its gradient comes.)
                reached = params_reached_from(output)
                self.reducer.unused = [p for p in self._params if id(p) not in reached]
        return output

    def _module_buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are *now*: read again at every use, as torch's DDP does, since
        a forward may re-assign one (``self.mean = 0.9 * self.mean + ...``) and ``model.double()``
        replaces them all; a list taken at construction would broadcast tensors nobody uses."""
        return [b for name, b in self.module.named_buffers() if name not in self.parameters_to_ignore]

    def _module_parameters(self) -> list[nn.Parameter]:
        """Every parameter MiniDDP keeps equal on all ranks (trainable or not; not those left to the user)."""
        return [p for name, p in self.module.named_parameters() if name not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]) -> None:
        """Leave these parameters and buffers (by name) out of MiniDDP, before wrapping ``module``: not
        broadcast, not averaged, no hook. For state a library keeps in sync itself (e.g. a sharded
        embedding table). torch's DDP's method of the same (private) name, which such libraries call."""
        module._ddp_params_and_buffers_to_ignore = list(names)

    def _inputs_on_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """With ``device_ids``, the inputs on that device (torch's DDP's ``_pre_forward`` does the same)."""
        if self._input_device is None:
            return args, kwargs
        return move_to_device((args, kwargs), self._input_device)

    def _unfinished_backward_error(self) -> RuntimeError:
        missing = self.reducer.abandon_unfinished_backward()
        return RuntimeError(
            "MiniDDP: the previous backward started averaging gradients but never finished: "
            f"parameters {missing} received no gradient. Did that backward fail, or leave some "
            "parameters out of the loss? For parameters a forward may not use, construct "
            "MiniDDP(..., find_unused_parameters=True)."
        )

    def _before_synchronized_forward(self) -> int:
        """The collectives that open a synchronized step, identical on every rank;
        returns the rank whose buffers everyone takes."""
        buffer_source = 0
        self.reducer.divisor = self.world_size
        if self.join_context is None and under_torchs_join(self):  # Join([model, ...]) of torch's
            if not self._join_config.is_first_joinable:  # its steps open with MiniDDP's collectives
                raise ValueError("under torch's Join, MiniDDP must be the first joinable: Join([model, optimizer])")
            self.join_context = Join.inside_torchs_join(self)
        active = Join.notify_join_context(self)  # inside join(): who is still training?
        if active is not None:  # read only where used: reading waits for the GPU (minddp.join.Flags)
            self.reducer.divisor = self._join_hook.divisor(active)
            if self.buffer_sync != "off" and self._module_buffers():
                buffer_source = self.join_context.last_active
        if self.check_sync_every and self._synchronized_forwards % self.check_sync_every == 0:
            if active is None or all(active):
                check_replicas_in_sync(self.module, self.process_group)
        self._synchronized_forwards += 1
        return buffer_source

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

    # ------------------------------------------------------------ uneven inputs
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with model.join():`` lets ranks with fewer batches finish early (see :mod:`minddp.join`);
        ``throw_on_early_termination=True``: every rank raises as soon as one has run out instead."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

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
            sync_buffers(self._module_buffers(), self.process_group, self.buffer_sync, buffer_source)
        self.reducer.shadow_backward()

    # ------------------------------------------------------------- inspection
    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for tests and lessons)."""
        return [list(b.names) for b in self.reducer.buckets]


def _process_group(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup:
    """The ranks to average over: ``process_group``, or a one-dimensional ``device_mesh``'s, or the world."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    return process_group if process_group is not None else dist.group.WORLD


class _MiniDDPJoinHook(JoinHook):
    """MiniDDP's part in :class:`~minddp.join.Join`: shadow the others' steps, then agree."""

    def __init__(self, ddp: MiniDDP, divide_by_initial_world_size: bool):
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def divisor(self, active: list[bool]) -> int:
        """Gradients are divided by the initial world size (torch's default) or by the active ranks."""
        return len(active) if self.divide_by_initial_world_size else sum(active)

    def main_hook(self) -> None:
        join = self._join()
        if join.inside_torch:  # torch's loop answers only its own all-reduce; the exchange is answered here
            join._exchange(active=False)
        self.ddp._shadow_synchronized_step(buffer_source=join.last_active)

    def post_hook(self, is_last_joiner: bool) -> None:
        # Everyone is done: the last rank to train has the newest parameters.
        ddp = self.ddp
        buffers = ddp._module_buffers() if ddp.buffer_sync != "off" else []  # torch: forward_sync_buffers
        broadcast_coalesced(ddp._module_parameters() + buffers, ddp.process_group,
                            self._join().last_active)
        ddp.reducer.divisor = ddp.world_size

    def _join(self) -> Join:
        """Who trains, and who trained last: minddp's Join knows (see ``Join.inside_torchs_join``)."""
        if self.ddp.join_context is None:  # under torch's Join, a rank that never trained in it
            self.ddp.join_context = Join.inside_torchs_join(self.ddp)
        return self.ddp.join_context
