"""``ZeroRedundancyOptimizer``: each rank keeps and steps only its shard of the optimizer state.

DDP keeps a full copy of the optimizer state on every rank: for Adam, two
more tensors the size of the model. ZeRO stage 1 (Rajbhandari et al., 2020)
shards it. One step::

    gradients averaged (by DDP; or here, by a reduce-scatter)
      └─ each rank copies its elements of every gradient into its shard's .grad
           └─ the local optimizer (any torch.optim class) steps the shard
                └─ all-gather: every rank's updated shard back into every parameter

The shards follow :mod:`minddp.zero.partition` (equal pieces of flat buffers,
or torch's whole-tensor greedy assignment); :mod:`minddp.zero.shards` maps
between shards and parameters. Stage 2 (``shard_gradients=True``) changes
only where the gradient comes from: :mod:`minddp.zero.stage2`.

Call it as torch's ``torch.distributed.optim.ZeroRedundancyOptimizer``::

    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                  ddp=model)                       # stage 1
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                  ddp=model, shard_gradients=True)  # stage 2 (MiniDDP)

Options after torch's signature (popped from ``defaults``):

* ``ddp``: the DDP wrapper that averages the gradients. On torch's DDP the
  optimizer reads the averaged ``.grad`` at ``step``; on MiniDDP it registers
  a comm hook that all-reduces each bucket as MiniDDP would and copies this
  rank's elements into the shards (:mod:`minddp.zero.stage1_hook`, what lets
  ``join()`` work). Without a wrapper the optimizer averages the gradients
  itself, with a reduce-scatter at ``step`` (the paper's stage-1 traffic);
  ``average_gradients=False`` says a wrapper you did not pass already did
  (torch's assumption; it would otherwise average them twice).
* ``shard_gradients``: stage 2, on a MiniDDP passed as ``ddp``.
* ``partition``: ``"flat"`` (default) or ``"greedy"`` (torch's).
* ``overlap_comm`` (stage 2, default True): reduce-scatter a bucket while
  the next one fills, two buffers of the pool in use
  (:mod:`minddp.zero.bucket_pool`). False waits for each as it is sent:
  one buffer in all, no overlap (DeepSpeed's option of the same name).

Gradient clipping must see every shard: call ``opt.clip_grad_norm_(max_norm)``
between ``backward()`` and ``step()`` (the norm's squares are summed over the
shards and all-reduced; ``torch.nn.utils.clip_grad_norm_`` on the parameters
would see no gradient under stage 2, and only a stale one for others' shards
without a wrapper).

A step consumes the shards' gradients: the next backward starts a fresh sum,
whether or not ``zero_grad`` was called (as DeepSpeed).

Which parameters a step moves, as ``torch.optim`` and torch's ZeRO decide:
every parameter given is sharded, frozen or not (``requires_grad`` is read
at each step, so a layer unfrozen later trains); a parameter whose gradient
is ``None`` this step (frozen, or unused by the forward) is not stepped and
its ``step`` count does not advance, while a zero gradient is a step. The
local optimizer steps one view per parameter segment
(:class:`~minddp.zero.shards.Shard`), so each keeps its own state. Where the
gradient travelled through MiniDDP's buckets, MiniDDP's reducer says which
parameters had one (on some rank); without a wrapper, any rank's gradient
counts (a small all-reduce). Parameters MiniDDP does not reduce (frozen
when it was built) are stepped from their own ``.grad``, not averaged, as
torch's ZeRO does beside torch's DDP.

Uneven inputs: torch's ``Join([model, opt])`` (the optimizer is a torch
``Joinable``, as torch's ZeRO; MiniDDP first). A rank out of data steps
its shard with the others' average where it can get it (MiniDDP, or no
wrapper). With ``average_gradients=False`` the averaging is a wrapper's we
were not given, so, as torch's ZeRO, the joined rank steps its shard with
whatever its ``.grad`` holds (its last gradient; ``None`` after
``zero_grad()``: not stepped).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from minddp.zero.checkpoint import consolidate, load_pieces, pieces_of_full
from minddp.zero.clipping import clip_shards_by_global_norm_
from minddp.zero.collectives import all_gather_params, gather_to, reduce_scatter_grads
from minddp.zero.local_optimizer import copy_hyperparameters, rebuild_local_optimizer
from minddp.zero.partition import PARTITIONS
from minddp.zero.presence import outside_wrapper, stepped_parameters
from minddp.zero.sharded_gradients import ShardedGradients
from minddp.zero.shards import Shard, ShardLayout
from minddp.zero.stage1_hook import attach_allreduce
from minddp.zero.stage2 import GradientSharding, check_attachable, check_buckets_unchanged

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shard ``optimizer_class``'s state over ``process_group`` (ZeRO stage 1, or 2 with ``shard_gradients``)."""

    def __init__(self, params, optimizer_class: type[Optimizer], process_group: dist.ProcessGroup | None = None,
                 **defaults: Any):
        self.ddp = defaults.pop("ddp", None)
        self.shard_gradients = bool(defaults.pop("shard_gradients", False))
        self.overlap_comm = bool(defaults.pop("overlap_comm", True))
        self.partition = defaults.pop("partition", "flat")
        average = defaults.pop("average_gradients", None)
        # torch's: with True its local optimizer steps flat buffers; ours always does, so either value is fine.
        defaults.pop("parameters_as_bucket_view", None)
        if defaults.pop("overlap_with_ddp", False):
            raise NotImplementedError(
                "overlap_with_ddp=True (torch's ZeRO stepping inside torch's DDP comm hook) is not supported; "
                "ZeRO stage 2 (ddp=<a MiniDDP>, shard_gradients=True) reduces the gradients during backward")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.shard_gradients and self.partition != "flat":
            raise ValueError("shard_gradients=True partitions MiniDDP's buckets into equal pieces: "
                             f"partition={self.partition!r} does not apply")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroRedundancyOptimizer needs an initialized process group "
                               "(torch.distributed.init_process_group or minddp.init_distributed)")
        self._ready = False
        super().__init__(params, defaults)
        Joinable.__init__(self)
        sparse = [i for i, p in enumerate(p for g in self.param_groups for p in g["params"]) if p.is_sparse]
        if sparse:
            raise ValueError(f"ZeroRedundancyOptimizer shards dense parameters only; parameters {sparse} "
                             "(in parameter-group order) are sparse")
        self.optimizer_class, self.optim_defaults = optimizer_class, defaults  # the local optimizer's
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.average_gradients = (self.ddp is None) if average is None else bool(average)
        self._pending_load: dict | None = None  # a loaded state, kept until stage 2's layout is final
        self._all_state: dict | None = None  # the consolidated state, on the rank it was sent to
        if self.shard_gradients:
            check_attachable(self, self.ddp)
        self._gradients_from_hook = False  # stage 1 on MiniDDP: its buckets' all-reduce fills the shards
        self.grads = ShardedGradients()  # this round's averaged gradients in the shards, however they came
        self._clipped = self._last_clip = None  # clip_grad_norm_'s arguments this step, and last step
        self.optim: Optimizer | None = None
        self.layout: ShardLayout | None = None
        self._repartition()
        self.gradient_sharding: GradientSharding | None = None  # stage 2: its state, and MiniDDP's part in it
        if self.shard_gradients:  # stage 2 is a bucket communication of MiniDDP's
            self.gradient_sharding = GradientSharding(self, self.ddp)
        elif self.ddp is not None:
            self._gradients_from_hook = attach_allreduce(self, self.ddp)
        self._ready = True

    @property
    def bucket_pool(self):
        """Stage 2's pool of bucket buffers (:mod:`minddp.zero.bucket_pool`); None without ``shard_gradients``."""
        return self.gradient_sharding.bucket_pool if self.gradient_sharding is not None else None

    # ------------------------------------------------------------ partition
    def _repartition(self) -> None:
        """(Re)build the layout and the local optimizer (:mod:`minddp.zero.local_optimizer`), keeping
        the state of every segment that stays."""
        self.layout, self.optim = rebuild_local_optimizer(self)
        self.grads.layout = self.layout

    @property
    def partition_is_fixed(self) -> bool:
        """Would a new partition lose something: optimizer state (other than a loaded one not yet
        stepped, which is re-applied) or this round's gradients in the shards?"""
        return bool(self.optim.state and self._pending_load is None) or self.grads.in_shards

    def repartition(self) -> None:
        """Partition again, on what the units are now (stage 2: MiniDDP rebuilt its buckets before the
        first step), and re-apply a loaded state not yet stepped. Only while not :attr:`partition_is_fixed`."""
        self._repartition()
        if self._pending_load is not None:
            self.load_state_pieces(*self._pending_load)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (on every rank, as torch): its parameters are partitioned and join the shards.

        Under stage 2 the units are MiniDDP's buckets, which do not change: the
        new group only says which shard (and hyperparameters) its elements get.
        """
        super().add_param_group(param_group)
        if self._ready:  # not Optimizer.__init__ adding the constructor's groups
            self._repartition()

    # ------------------------------------------------------------ gradients
    def _collect_gradients(self, shadow: bool = False) -> None:
        """This round's averaged gradients into the shards, unless already there (stage 2, clipping)."""
        if self.shard_gradients:  # the first backward was all-reduced: partition the final buckets now
            self.ddp.reducer.rebuild_if_due()  # (MiniDDP would rebuild them at its next forward)
            check_buckets_unchanged(self)
        if self.grads.in_shards:
            if self.grads.from_hook:  # what the wrapper does not reduce (frozen when it was built): .grad
                for p in outside_wrapper(self):
                    if p.grad is not None:
                        self.grads.fill_param(p, p.grad)
            return
        # A joined rank has no gradient of its own; with average_gradients=False a wrapper we were not
        # given averaged them into .grad, and we step with what is there, as torch's ZeRO does.
        source: Callable = (lambda p: None) if shadow and self.average_gradients else (lambda p: p.grad)
        if self.average_gradients:
            reduce_scatter_grads(self.layout, source, Shard.gradient, self.process_group, self.world_size)
        else:
            self.layout.fill(Shard.gradient, source)
        self.grads.in_shards = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` on the whole model.

        Call after ``backward()`` and before ``step()``, on every rank (a collective).
        The norm is summed over the shards and all-reduced
        (:mod:`minddp.zero.clipping`); returns it.
        """
        self._collect_gradients()
        self._clipped = (max_norm, norm_type)
        grads = [s.gradient() for s in self.layout.shards]
        return clip_shards_by_global_norm_(grads, max_norm, norm_type, self.process_group)

    # ----------------------------------------------------------------- step
    def step(self, closure: Callable[[], float] | None = None, **kwargs) -> float | None:
        """Step this rank's shards, then all-gather the parameters (a collective on every rank).

        ``closure`` and ``kwargs`` go to the local optimizer's ``step``, as in
        torch's ZeRO (LBFGS evaluates the loss several times inside its step).
        Each call of the closure first writes this rank's updated elements into
        the parameters (the others' stay as they were until the all-gather, as
        under torch's ZeRO), then, after its backward, brings the new gradients
        into the shards.
        """
        Join.notify_join_context(self)
        return self._sharded_step(shadow=False, closure=closure, **kwargs)

    def _sharded_step(self, shadow: bool, closure: Callable[[], float] | None = None, **kwargs):
        if shadow and self._last_clip is not None:  # out of data: the same collectives as the others' step
            self.clip_grad_norm_(*self._last_clip)
        if not shadow:
            self._last_clip, self._clipped = self._clipped, None
        copy_hyperparameters(self.param_groups, self.optim.param_groups)  # an LR scheduler's changes
        with torch.no_grad():  # weights changed since the last all-gather (a model.load_state_dict) count:
            self.layout.fill(lambda s: s.master, lambda p: p.detach())  # a copy of 1/N of them
        self._gradients_into_views(shadow)  # what .grad holds now counts, closure or not (as torch's ZeRO)
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=self._closure_for_shards(closure), **kwargs)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self.grads.end_round()
        self._pending_load = None
        if self.gradient_sharding is not None:
            self.gradient_sharding.use_pool()
        with torch.no_grad():
            all_gather_params(self.layout, lambda s: s.master, lambda p: p.data, self.process_group)
        return loss

    def _gradients_into_views(self, shadow: bool) -> None:
        self._collect_gradients(shadow)
        stepped = stepped_parameters(self, shadow)
        for shard in self.layout.shards:
            shard.attach_gradients(stepped)

    def _closure_for_shards(self, closure: Callable[[], float]) -> Callable[[], float]:
        def evaluate():
            with torch.no_grad():  # this rank's updated elements into the parameters the closure reads
                for shard in self.layout.shards:
                    for seg, view in zip(shard.segments, shard.views):
                        seg.param.data.view(-1)[seg.param_start: seg.param_start + seg.length].copy_(view)
            self.grads.end_round()  # the closure's backward is a fresh round
            with torch.enable_grad():
                loss = closure()
            self._gradients_into_views(shadow=False)
            return loss
        return evaluate

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.grads.in_shards = False

    # ------------------------------------------------------------ checkpoints
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to``, in the CPU's memory (a collective on every rank)."""
        gather = lambda shard_tensor, dest: gather_to(self.layout, shard_tensor, dest, to, self.process_group)
        state = consolidate(self, gather, to == self.rank)
        self._all_state = state if to == self.rank else None

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer format (per parameter, indexed), after :meth:`consolidate_state_dict` to this rank."""
        if self._all_state is None:
            raise RuntimeError(f"optimizer state not consolidated on rank {self.rank}: call "
                               f"consolidate_state_dict(to={self.rank}) on every rank first")
        return self._all_state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated (torch-format) state: each rank keeps its part, for any world size."""
        self.load_state_pieces(pieces_of_full(state_dict), state_dict["param_groups"])

    def load_state_pieces(self, pieces, param_groups: list[dict]) -> None:
        """Load a state given as pieces (:mod:`minddp.zero.checkpoint`: of a consolidated state, or of
        sharded files): each rank keeps the elements it owns."""
        load_pieces(self, pieces, param_groups)
        if self.shard_gradients:  # re-applied if MiniDDP rebuilds its buckets before the first step
            self._pending_load = (pieces, param_groups)

    # ------------------------------------------------------------ uneven inputs
    def join_hook(self, **kwargs) -> JoinHook:
        if self.ddp is not None and not (self.shard_gradients or self._gradients_from_hook):
            raise NotImplementedError(
                "join() with stage 1 on torch's DDP (or a MiniDDP with its own comm hook): a rank out of data "
                "would step its shard with stale gradients (the shadow all-reduce does not write .grad). Use "
                "MiniDDP without a comm hook, or no wrapper (the optimizer then averages gradients itself)")
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.layout.units[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group


class _ZeroJoinHook(JoinHook):
    """A rank out of data still owns a shard: it steps it (with the others' gradients) and sends it."""

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero._sharded_step(shadow=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Nothing to agree on: every step ended with the all-gather of every shard."""
