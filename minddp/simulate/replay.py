"""Replaying DDP's bucket schedule for one step, at any world size.

Given a :class:`~minddp.simulate.profile.ComputeProfile` (when each gradient
is ready), a network (:mod:`minddp.network`) and a :class:`DDPPolicy`, the
replay walks the buckets in order, as MiniDDP and torch's DDP launch them:

1. buckets come from :func:`minddp.bucket_assignment.assign_buckets` over the
   gradients in arrival order (MiniDDP rebuilds its buckets in that order
   after the first step), the first one capped at ``first_bucket_cap_mb``;
2. a bucket is ready when its last gradient is;
3. it starts when it is ready *and* the one before it has finished: strict
   bucket order, one collective on the wire at a time (NCCL and Gloo run a
   process group's collectives one after another);
4. it lasts ``allreduce_time(wire bytes)``, plus two casts with compression
   (with ``collective="reduce_scatter"``, ZeRO stage 2's way, a ring
   reduce-scatter of the bucket instead: half the time on the wire).

The step ends when backward has produced its last gradient and the last
all-reduce is over, plus ``after_backward_ms``. With ``overlap=False``
communication and compute share one core (a CPU rank whose Gloo thread
competes with autograd): while a collective runs during backward, backward
is paused, so everything after it becomes ready that much later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minddp.bucket_assignment import FIRST_BUCKET_CAP_MB, MiB, TensorSpec, assign_buckets
from minddp.network import COLLECTIVES, Hierarchy, Link, collective_time
from minddp.simulate.profile import ComputeProfile, Gradient

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
    algorithm: str = "ring"  # or "tree"; with a Hierarchy network, the one between nodes
    overlap: bool = True  # False: communication and compute share the cores (see module doc)
    collective: str = "all_reduce"  # what each bucket does: "reduce_scatter" is ZeRO stage 2's

    def __post_init__(self) -> None:
        if self.collective not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"collective must be 'all_reduce' or 'reduce_scatter' (a bucket's reduction), "
                             f"got {self.collective!r}; the known collectives are {', '.join(COLLECTIVES)}")
        if self.compression not in (None, "fp16", "bf16"):
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {self.compression!r}")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")


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

    @property
    def exposed_ms(self) -> float:
        """Communication still running after backward's last gradient."""
        return max(0.0, self.comm_end_ms - self.backward_end_ms)

    @property
    def hidden_fraction(self) -> float:
        """Share of communication time that cost nothing: ``1 - (step - compute) / comm``, in [0, 1]."""
        if self.comm_ms == 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - (self.step_ms - self.compute_ms) / self.comm_ms))

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
    """The same buckets MiniDDP builds, by the package's own rule (never re-implemented here)."""
    specs = []
    for g in gradients:
        dtype = _dtype(g.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        specs.append(TensorSpec(g.nbytes // size, size, dtype, torch.device("cpu")))
    groups = assign_buckets(specs, int(policy.bucket_cap_mb * MiB), int(policy.first_bucket_cap_mb * MiB))
    return [[gradients[i] for i in group] for group in groups]


def _wire_bytes(members: list[Gradient], policy: DDPPolicy) -> int:
    nbytes = sum(g.nbytes for g in members)
    if policy.compression is None:
        return nbytes
    size = torch.empty((), dtype=_dtype(members[0].dtype)).element_size()
    return nbytes // size * min(size, COMPRESSED_ELEMENT_SIZE)


def simulate_step(profile: ComputeProfile, network: Link | Hierarchy, world_size: int,
                  policy: DDPPolicy = DDPPolicy()) -> SimulatedStep:
    """Replay one optimizer step of ``profile`` on ``world_size`` ranks; see the module doc."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    gradients = sorted(profile.gradients, key=lambda g: g.ready_ms)
    pauses: list[tuple[float, float]] = []  # (start, length) of collectives that paused backward

    def wall(compute_ms: float) -> float:
        """When backward reaches ``compute_ms`` of its own work, after the pauses before it."""
        t = compute_ms
        for start, length in pauses:
            if start < t:
                t += length
        return t

    buckets: list[SimulatedBucket] = []
    wire_free = 0.0
    for index, members in enumerate(_buckets(gradients, policy) if world_size > 1 else []):
        ready = wall(max(g.ready_ms for g in members))
        start = max(ready, wire_free)
        wire = _wire_bytes(members, policy)
        seconds = collective_time(policy.collective, wire, world_size, network, policy.algorithm)
        if wire < sum(g.nbytes for g in members):  # compressed: cast down before, back up after
            seconds += 2 * sum(g.nbytes for g in members) / policy.cast_Bps
        end = start + seconds * 1e3
        if not policy.overlap and start < wall(profile.backward_ms):
            pauses.append((start, end - start))
        buckets.append(SimulatedBucket(index, [g.name for g in members], sum(g.nbytes for g in members), wire,
                                       ready, start, end))
        wire_free = end

    backward_end = wall(profile.backward_ms)
    comm_end = buckets[-1].end_ms if buckets else 0.0
    unsynced = (policy.accumulation_steps - 1) * (profile.forward_ms + profile.backward_ms)
    compute = unsynced + profile.forward_ms + profile.backward_ms + profile.after_backward_ms
    step = unsynced + profile.forward_ms + max(backward_end, comm_end) + profile.after_backward_ms
    return SimulatedStep(world_size, profile.forward_ms, backward_end, comm_end, step, compute,
                         sum(b.end_ms - b.start_ms for b in buckets), buckets)
