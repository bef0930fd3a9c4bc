"""ZeRO stage 3 (fully sharded data parallel) replayed unit by unit: step time, wire bytes, working set.

Under stage 3 a rank keeps only its 1/N shard of every unit (usually a
transformer block), so each unit's full parameters must be fetched before
they are used, twice per step:

* **forward**, first unit to last: all-gather the unit, compute, free it;
* **backward**, last unit to first: all-gather it again (it was freed after
  forward), compute its gradients, then reduce-scatter the unit's full
  gradient so each rank keeps the sum of its own shard.

That is three collectives over the model's bytes per step, 3Ψ on the wire
(each rank sends ``(N-1)/N`` of a buffer per all-gather or reduce-scatter)
against DDP's all-reduce, 2Ψ: stage 3 costs 1.5x DDP's bytes, and it pays
only if those bytes hide under compute.

**Prefetch** is what hides them. Without it a unit's all-gather is issued
when the unit is about to run, so compute waits for every gather; and in
backward the gather of the next unit queues behind the reduce-scatter just
issued for the unit that finished (one process group runs its collectives
one after another). With prefetch (FSDP2's default, and ``minddp.fsdp``'s),
the next unit's all-gather is issued as soon as the current unit starts
computing, so the wire fetches unit ``i + 1`` while unit ``i`` computes, and
in backward that gather goes ahead of the reduce-scatter.

The replay below follows exactly that program order: one wire (a collective
starts when it is issued and the one before it is done), compute that waits
for its unit's gather. With ``overlap=False`` compute and communication share
one core (a CPU rank whose Gloo thread competes with autograd): compute only
advances while the wire is idle.

**Memory** per rank: the sharded part, ``(p + g + k) Ψ / N`` (the paper's
16Ψ/N in mixed precision), plus the **working set**, the units held in full
at once: the unit computing and, with prefetch, the next one, each with its
full parameters and its full gradient (the gradient lives until its
reduce-scatter is done), so ``2 x (p + g) x`` the largest unit with prefetch,
``1 x`` without. At large N the working set, not the shards, sets the floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minddp_lab.network import Hierarchy, Link, all_gather_time, bytes_sent_per_rank, reduce_scatter_time

__all__ = ["Unit", "Stage3Policy", "SimulatedCollective", "Stage3Step", "simulate_stage3", "working_set_bytes"]


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard``'ed module: its full bytes and its compute at world size 1."""

    name: str
    param_bytes: int  # full parameters, in the dtype they are gathered in
    grad_bytes: int  # full gradient, in the dtype it is reduce-scattered in
    forward_ms: float
    backward_ms: float


@dataclass(frozen=True)
class Stage3Policy:
    prefetch: bool = True  # issue the next unit's all-gather when this unit starts computing
    reshard_after_forward: bool = True  # free after forward (gather again in backward); False: 2Ψ, more memory
    overlap: bool = True  # False: compute and communication share the core (see module doc)
    # True: the last unit of the forward stays gathered into its backward, which comes next
    # (minddp.fsdp from its second step; FSDP2 gathers it again unless told otherwise)
    keep_last: bool = False
    # True: the first unit of the forward is the root, around the others, and stays gathered
    # from its forward through the whole backward (minddp.fsdp and FSDP2 both keep their root)
    keep_root: bool = False


@dataclass
class SimulatedCollective:
    kind: str  # "all_gather" or "reduce_scatter"
    unit: str
    phase: str  # "forward" or "backward"
    issue_ms: float  # since the step began
    start_ms: float
    end_ms: float
    nbytes: int  # the full buffer


@dataclass
class Stage3Step:
    world_size: int
    forward_end_ms: float  # since the step began
    backward_end_ms: float  # last unit's gradients computed
    comm_end_ms: float  # last collective over
    optimizer_ms: float  # the sharded optimizer step (1/N of the unsharded one)
    work_ms: float  # forward + backward compute alone
    compute_ms: float  # work + unsharded optimizer: the step at world size 1
    collectives: list[SimulatedCollective] = field(default_factory=list)

    @property
    def step_ms(self) -> float:
        return max(self.backward_end_ms, self.comm_end_ms) + self.optimizer_ms

    @property
    def comm_ms(self) -> float:
        return sum(c.end_ms - c.start_ms for c in self.collectives)

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends per step (rings)."""
        return sum(bytes_sent_per_rank(c.kind, c.nbytes, self.world_size) for c in self.collectives)

    @property
    def waiting_ms(self) -> float:
        """How long compute stood still waiting for the wire: the step minus what it computes."""
        return self.step_ms - self.work_ms - self.optimizer_ms


class _Wire:
    """One process group: collectives run one at a time, in the order they are issued."""

    def __init__(self, network: Link | Hierarchy, world_size: int, policy: Stage3Policy):
        self.network, self.world_size, self.policy = network, world_size, policy
        self.collectives: list[SimulatedCollective] = []
        self.free_ms = 0.0

    def issue(self, kind: str, unit: Unit, phase: str, at_ms: float) -> float:
        """Queue one collective at ``at_ms``; returns when it is done."""
        if self.world_size == 1:
            return at_ms  # nothing to fetch or reduce: the shard is the whole unit
        nbytes = unit.param_bytes if kind == "all_gather" else unit.grad_bytes
        cost = all_gather_time if kind == "all_gather" else reduce_scatter_time
        start = max(at_ms, self.free_ms)
        end = start + cost(nbytes, self.world_size, self.network) * 1e3
        self.collectives.append(SimulatedCollective(kind, unit.name, phase, at_ms, start, end, nbytes))
        self.free_ms = end
        return end

    def compute(self, start_ms: float, work_ms: float) -> float:
        """When ``work_ms`` of compute begun at ``start_ms`` ends (paused by collectives if cores are shared)."""
        if self.policy.overlap:
            return start_ms + work_ms
        t, left = start_ms, work_ms
        for c in sorted(self.collectives, key=lambda c: c.start_ms):
            if c.end_ms <= t:
                continue
            run = min(left, max(0.0, c.start_ms - t))
            t, left = t + run, left - run
            if left <= 0:
                return t
            t = max(t, c.end_ms)
        return t + left


def _pass(units: list[Unit], wire: _Wire, t: float, phase: str, gather: bool,
          whole: frozenset[int] = frozenset()) -> float:
    """Forward (or backward, with ``units`` reversed) through every unit; returns when the last one is done.

    ``whole``: the positions of the units that are gathered already (kept from the forward)."""
    prefetch = wire.policy.prefetch and gather

    def fetch(i: int, at_ms: float) -> float:
        return at_ms if i in whole or not gather else wire.issue("all_gather", units[i], phase, at_ms)

    ready = {0: fetch(0, t)} if prefetch else {}
    for i, unit in enumerate(units):
        if i not in ready:
            ready[i] = fetch(i, t)
        start = max(t, ready[i])
        if prefetch and i + 1 < len(units):
            ready[i + 1] = fetch(i + 1, start)
        t = wire.compute(start, unit.forward_ms if phase == "forward" else unit.backward_ms)
        if phase == "backward":
            wire.issue("reduce_scatter", unit, phase, t)
    return t


def simulate_stage3(units: list[Unit], network: Link | Hierarchy, world_size: int, optimizer_ms: float = 0.0,
                    policy: Stage3Policy = Stage3Policy()) -> Stage3Step:
    """One stage-3 step of ``units`` (in forward order) on ``world_size`` ranks; ``optimizer_ms`` unsharded."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not units:
        raise ValueError("stage 3 needs at least one unit")
    wire = _Wire(network, world_size, policy)
    forward_end = _pass(units, wire, 0.0, "forward", gather=True)
    # Without resharding, the parameters gathered in forward stay for backward: no second all-gather.
    kept = {0} if policy.keep_last else set()  # positions in backward order: the last unit first
    if policy.keep_root:
        kept.add(len(units) - 1)
    backward_end = _pass(units[::-1], wire, forward_end, "backward", gather=policy.reshard_after_forward,
                         whole=frozenset(kept))
    work = sum(u.forward_ms + u.backward_ms for u in units)
    comm_end = max([c.end_ms for c in wire.collectives], default=0.0)
    return Stage3Step(world_size, forward_end, backward_end, comm_end, optimizer_ms / world_size, work,
                      work + optimizer_ms, wire.collectives)


def working_set_bytes(units: list[Unit], policy: Stage3Policy = Stage3Policy()) -> int:
    """Bytes held in full at once, beyond the shards: 2 units' parameters and gradients with prefetch, else 1.

    Without ``reshard_after_forward`` every unit stays gathered from its forward to its backward: all of them.
    """
    if not policy.reshard_after_forward:
        return sum(u.param_bytes for u in units) + max(u.grad_bytes for u in units)
    held = 2 if policy.prefetch else 1
    return held * max(u.param_bytes + u.grad_bytes for u in units)
