"""Replaying DDP's bucket schedule for one step, at any world size.

Given a :class:`~minddp_lab.simulate.profile.ComputeProfile` (when each gradient
is ready), a network (:mod:`minddp_lab.network`) and a :class:`DDPPolicy`, the
replay walks the buckets in order, as MiniDDP and torch's DDP launch them:

1. buckets come from :func:`minddp.ddp.core.assignment.assign_buckets` over the
   gradients in arrival order (MiniDDP rebuilds its buckets in that order
   after the first step), the first one capped at ``first_bucket_cap_mb``;
2. a bucket is ready when its last gradient is;
3. it starts when it is ready *and* the one before it has finished: strict
   bucket order, one collective on the wire at a time (NCCL and Gloo run a
   process group's collectives one after another);
4. it lasts ``allreduce_time(wire bytes)`` (NCCL's model,
   :mod:`minddp_lab.simulate.nccl`, on a :class:`~minddp_lab.simulate.nccl.Cluster`), plus two casts with compression
   (with ``collective="reduce_scatter"``, ZeRO stage 2's way, a ring
   reduce-scatter of the bucket instead: half the time on the wire).

The step ends when backward has produced its last gradient and the last
all-reduce is over, plus ``after_backward_ms``. ``policy.overheads``
(:mod:`minddp_lab.simulate.overheads`) adds what the bare model misses: each
gradient's hook and each bucket's launch, inserted into backward where they
happen; backward slowed while a collective runs beside it; the wrapper's
cost per step. At world size 1 the buckets are built and launched too (a
collective over one rank takes no time), as DDP on one rank does. With ``overlap=False``
communication and compute share one core (a CPU rank whose Gloo thread
competes with autograd): while a collective runs during backward, backward
is paused, so everything after it becomes ready that much later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minddp.ddp.core.assignment import FIRST_BUCKET_CAP_MB, MiB, TensorSpec, assign_buckets
from minddp_lab.network import COLLECTIVES, Hierarchy, Link, bytes_sent_per_rank
from minddp_lab.simulate.bucket_rule import buckets_within_cap
from minddp_lab.simulate.nccl import collective_time
from minddp_lab.simulate.overheads import NO_OVERHEADS, ComputeClock, Overheads
from minddp_lab.simulate.profile import ComputeProfile, Gradient

__all__ = ["DDPPolicy", "SimulatedBucket", "SimulatedStep", "simulate_step"]

COMPRESSED_ELEMENT_SIZE = 2  # fp16 and bf16 both


@dataclass(frozen=True)
class DDPPolicy:
    """What DDP is configured to do (torch's defaults unless said)."""

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = FIRST_BUCKET_CAP_MB
    compression: str | None = None  # "fp16"/"bf16": torch's fp16_compress_hook and kin
    # Casting a bucket down before the all-reduce and back after: two passes
    # over it. 100 GB/s is a GPU's memory-bound cast; a CPU core does ~5 GB/s.
    cast_Bps: float = 100e9
    accumulation_steps: int = 1  # k: k-1 steps under no_sync(), then one that communicates
    algorithm: str = "ring"  # or "tree"; with a Hierarchy, the one between nodes; "auto": NCCL's pick (a Cluster)
    overlap: bool = True  # False: communication and compute share the cores (see module doc)
    collective: str = "all_reduce"  # what each bucket does: "reduce_scatter" is ZeRO stage 2's
    overheads: Overheads = NO_OVERHEADS  # costs the bare model misses (minddp_lab.simulate.overheads)
    # True: torch's rule, a bucket closes after the gradient that reaches its cap (what MiniDDP builds,
    # and plan_buckets plans with); False: the older rule the checked tables were made with.
    buckets_may_pass_cap: bool = False

    def __post_init__(self) -> None:
        if self.collective not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"collective must be 'all_reduce' or 'reduce_scatter' (a bucket's reduction), "
                             f"got {self.collective!r}; the known collectives are {', '.join(COLLECTIVES)}")
        if self.compression not in (None, "fp16", "bf16"):
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {self.compression!r}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a whole number >= 1, got {self.accumulation_steps}")
        for name in ("bucket_cap_mb", "first_bucket_cap_mb", "cast_Bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class SimulatedBucket:
    index: int
    names: list[str]
    nbytes: int  # in its gradients' dtype
    wire_bytes: int  # the buffer the collective reduces (halved by compression)
    ready_ms: float  # since backward began
    start_ms: float
    end_ms: float


@dataclass
class SimulatedStep:
    world_size: int
    forward_ms: float
    backward_end_ms: float  # last gradient ready, since backward began (later with overlap=False)
    comm_end_ms: float  # last all-reduce over, since backward began
    step_ms: float  # one optimizer step, every accumulation micro-step included
    compute_ms: float  # the same step with no communication at all (world size 1)
    comm_ms: float  # sum of all-reduce durations
    buckets: list[SimulatedBucket] = field(default_factory=list)
    hooks_ms: float = 0.0  # gradient hooks and bucket launches added to backward (Overheads)
    contention_ms: float = 0.0  # backward's time lost to collectives running beside it (overlap=True)
    per_step_ms: float = 0.0  # the wrapper's own work per step (Overheads)

    @property
    def exposed_ms(self) -> float:
        """Communication still running after backward's last gradient."""
        return max(0.0, self.comm_end_ms - self.backward_end_ms)

    @property
    def hidden_fraction(self) -> float:
        """Share of communication time that cost nothing: ``1 - (step - compute - overheads) / comm``, in [0, 1]."""
        if self.comm_ms == 0:
            return 1.0
        overheads = self.hooks_ms + self.contention_ms + self.per_step_ms
        return min(1.0, max(0.0, 1.0 - (self.step_ms - self.compute_ms - overheads) / self.comm_ms))

    @property
    def scaling_efficiency(self) -> float:
        """Samples/s at this world size over world size x one rank's: ``compute / step``."""
        return self.compute_ms / self.step_ms


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the profile")
    return dtype


def _buckets(gradients: list[Gradient], policy: DDPPolicy) -> list[list[Gradient]]:
    """Buckets by the package's own function (never re-implemented here), with the policy's cap rule."""
    specs = []
    for g in gradients:
        dtype = _dtype(g.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        specs.append(TensorSpec(g.nbytes // size, size, dtype, torch.device("cpu")))
    assign = assign_buckets if policy.buckets_may_pass_cap else buckets_within_cap
    groups = assign(specs, int(policy.bucket_cap_mb * MiB), int(policy.first_bucket_cap_mb * MiB))
    return [[gradients[i] for i in group] for group in groups]


def _wire_bytes(members: list[Gradient], policy: DDPPolicy) -> int:
    nbytes = sum(g.nbytes for g in members)
    if policy.compression is None:
        return nbytes
    size = torch.empty((), dtype=_dtype(members[0].dtype)).element_size()
    return nbytes // size * min(size, COMPRESSED_ELEMENT_SIZE)


def _compute_positions(gradients: list[Gradient], buckets: list[list[Gradient]], costs: Overheads,
                       ) -> tuple[list[float], list[float], float]:
    """Where, in backward's own work (ms), each bucket's last gradient is ready and its launch is done,
    and how long backward's work is, with the hooks' and launches' costs inserted as they happen."""
    hook, launch = costs.per_gradient_us / 1e3, costs.per_bucket_us / 1e3
    last_of = {}
    for k, members in enumerate(buckets):
        last = max(members, key=lambda g: g.ready_ms)
        last_of.setdefault(id(last), []).append(k)
    ready, launched, shift = [0.0] * len(buckets), [0.0] * len(buckets), 0.0
    for g in gradients:
        shift += hook
        for k in last_of.get(id(g), []):
            ready[k] = g.ready_ms + shift
            shift += launch
            launched[k] = g.ready_ms + shift
    backward = max((g.ready_ms for g in gradients), default=0.0) + shift
    return ready, launched, backward


def simulate_step(profile: ComputeProfile, network: Link | Hierarchy, world_size: int,
                  policy: DDPPolicy = DDPPolicy()) -> SimulatedStep:
    """Replay one optimizer step of ``profile`` on ``world_size`` ranks; see the module doc."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = policy.overheads
    gradients = sorted(profile.gradients, key=lambda g: g.ready_ms)
    groups = _buckets(gradients, policy)
    ready, launched, backward_work = _compute_positions(gradients, groups, costs)
    clock = ComputeClock()
    buckets: list[SimulatedBucket] = []
    wire_free = 0.0
    for index, members in enumerate(groups):
        start = max(clock.wall(launched[index]), wire_free)
        if world_size > 1 and costs.compute_slowdown > 0:
            clock.slow_from(clock.wall(launched[index]), 1.0 / (1.0 + costs.compute_slowdown))
        wire = _wire_bytes(members, policy)
        seconds = collective_time(policy.collective, wire, world_size, network, policy.algorithm)
        if wire < sum(g.nbytes for g in members):  # compressed: cast down before, back up after
            seconds += 2 * sum(g.nbytes for g in members) / policy.cast_Bps
        end = start + seconds * 1e3
        if not policy.overlap:  # the collective takes the cores: backward stands still
            clock.slow(start, end, 0.0)
        elif costs.contention_us_per_MB > 0 and end > start:
            # Its kernels take lost_ms of the device from backward, spread over the collective (or, if the
            # wire is faster than that, over lost_ms: the device cannot give more than all of itself).
            lost_ms = costs.contention_us_per_MB * bytes_sent_per_rank(policy.collective, wire, world_size) / 1e9
            begin = max(start, clock.busy_until)
            clock.slow(begin, begin + max(end - start, lost_ms), 1.0 - lost_ms / max(end - start, lost_ms))
        buckets.append(SimulatedBucket(index, [g.name for g in members], sum(g.nbytes for g in members), wire,
                                       clock.wall(ready[index]), start, end))
        wire_free = end

    backward_end = clock.wall(backward_work)
    comm_end = buckets[-1].end_ms if buckets else 0.0
    unsynced = (policy.accumulation_steps - 1) * (profile.forward_ms + profile.backward_ms)
    compute = unsynced + profile.forward_ms + profile.backward_ms + profile.after_backward_ms
    step = (unsynced + profile.forward_ms + max(backward_end, comm_end) + profile.after_backward_ms
            + costs.per_step_ms)
    return SimulatedStep(world_size, profile.forward_ms, backward_end, comm_end, step, compute,
                         sum(b.end_ms - b.start_ms for b in buckets), buckets,
                         hooks_ms=backward_work - profile.backward_ms, contention_ms=clock.lost_ms(backward_end) if policy.overlap else 0.0,
                         per_step_ms=costs.per_step_ms)
