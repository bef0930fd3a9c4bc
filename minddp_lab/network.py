"""How long a collective takes: the latency-bandwidth (alpha-beta) network model.

Sending ``n`` bytes over one link costs::

    t(n) = alpha + n / bandwidth

``alpha`` is the fixed price of a message (software stack, NIC, switch hops);
``bandwidth`` the bytes per second of the link in one direction. Everything
about buckets follows from these two numbers: many small all-reduces pay
``alpha`` many times, one huge all-reduce cannot start before backward ends.

A **ring all-reduce** of ``n`` bytes over ``p`` ranks is ``p - 1`` steps of
reduce-scatter and ``p - 1`` steps of all-gather, each moving ``n / p`` bytes
per rank, so::

    t_ring(n, p) = 2 (p - 1) alpha + 2 (p - 1) / p * n / bandwidth

The bandwidth term stays under ``2 n / bandwidth`` however many ranks there
are (why the ring scales); the latency term grows with ``p``. A **tree**
(binary reduce then broadcast, as NCCL uses for small messages at scale)
pays ``2 log2(p)`` latencies but sends the whole message at each level.
A **hierarchical** all-reduce (:class:`Hierarchy`) runs a ring inside each
node on fast links and only ``1/g`` of the bytes per rank between nodes.

ZeRO uses the two halves of the ring on their own: a **reduce-scatter**
(each rank ends with the sum of its ``1/p`` of the bytes) and an
**all-gather** (each rank's ``1/p`` to everyone), each ``p - 1`` steps of
``n / p`` bytes::

    t_rs(n, p) = t_ag(n, p) = (p - 1) alpha + (p - 1) / p * n / bandwidth

so ``t_rs + t_ag = t_ring``: sharding gradients moves no extra bytes
(:func:`reduce_scatter_time`, :func:`all_gather_time`; ring only, as NCCL
runs them).

Every preset's figures and their source are in its ``source`` field (and the
comment above :data:`PRESETS`). What the model leaves out: congestion and
topology of the switch fabric, NCCL's pipelining of chunks and several
channels, protocol switches with message size, and a per-collective base
cost; it is a first-order model, good for trends and bucket trade-offs.
:mod:`minddp_lab.simulate.nccl` models those (rings and trees pipelined across
nodes, NCCL's protocols and costs) for a machine of several GPUs per node;
the simulator uses it for every :class:`~minddp_lab.simulate.nccl.Cluster`.

This one model serves two users: :mod:`minddp_lab.simulate` replays a step at
any world size with it, and the lessons' simulated link makes a real Gloo
all-reduce take as long as it says, so trade-offs show on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Link", "Hierarchy", "PRESETS", "HIERARCHIES", "ring_allreduce_time", "tree_allreduce_time",
    "hierarchical_allreduce_time", "allreduce_time", "ring_bytes_sent_per_rank", "fit_link", "get_link", "get_network",
    "ring_half_time", "reduce_scatter_time", "all_gather_time", "collective_time", "bytes_sent_per_rank",
]


@dataclass(frozen=True)
class Link:
    """One link's cost: ``alpha_s`` seconds per message plus ``nbytes / bandwidth_Bps``."""

    name: str
    alpha_s: float
    bandwidth_Bps: float
    source: str = ""  # where the figures come from

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.bandwidth_Bps <= 0:
            raise ValueError(f"link {self.name!r}: need alpha >= 0 and bandwidth > 0, got {self.alpha_s}, {self.bandwidth_Bps}")

    def send_time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` as one message."""
        return self.alpha_s + nbytes / self.bandwidth_Bps


def ring_allreduce_time(nbytes: float, world_size: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` (per rank) over ``world_size`` ranks."""
    if world_size <= 1:
        return 0.0
    steps = 2 * (world_size - 1)
    return steps * link.alpha_s + steps / world_size * nbytes / link.bandwidth_Bps


def tree_allreduce_time(nbytes: float, world_size: int, link: Link) -> float:
    """Seconds for a binary-tree reduce followed by a broadcast (no pipelining)."""
    if world_size <= 1:
        return 0.0
    depth = math.ceil(math.log2(world_size))
    return 2 * depth * link.send_time(nbytes)


ALGORITHMS = {"ring": ring_allreduce_time, "tree": tree_allreduce_time}


def ring_half_time(nbytes: float, world_size: int, link: Link) -> float:
    """Seconds for a ring reduce-scatter, or a ring all-gather, of ``nbytes`` (the whole buffer) over ``world_size``.

    Half a ring all-reduce: ``p - 1`` steps, each sending ``nbytes / p``.
    """
    if world_size <= 1:
        return 0.0
    steps = world_size - 1
    return steps * link.alpha_s + steps / world_size * nbytes / link.bandwidth_Bps


def _half_time(nbytes: float, world_size: int, link: "Link | Hierarchy") -> float:
    if isinstance(link, Hierarchy):
        # Inside the node over its g ranks, then each rank's n/g between the
        # nodes (for an all-gather the other way round; the same cost): the
        # two halves add up to hierarchical_allreduce_time's ring.
        g = min(link.ranks_per_node, world_size)
        return ring_half_time(nbytes, g, link.intra) + ring_half_time(nbytes / g, math.ceil(world_size / g), link.inter)
    return ring_half_time(nbytes, world_size, link)


def reduce_scatter_time(nbytes: float, world_size: int, link: "Link | Hierarchy") -> float:
    """Seconds for a ring reduce-scatter of an ``nbytes`` buffer: each rank keeps the sum of ``1/p`` of it."""
    return _half_time(nbytes, world_size, link)


def all_gather_time(nbytes: float, world_size: int, link: "Link | Hierarchy") -> float:
    """Seconds for a ring all-gather that assembles an ``nbytes`` buffer from ``1/p`` pieces on every rank."""
    return _half_time(nbytes, world_size, link)


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def collective_time(kind: str, nbytes: float, world_size: int, link: "Link | Hierarchy",
                    algorithm: str = "ring") -> float:
    """Seconds for one collective of :data:`COLLECTIVES` over an ``nbytes`` buffer.

    ``algorithm`` applies to the all-reduce; reduce-scatter and all-gather are rings.
    """
    if kind == "all_reduce":
        return allreduce_time(nbytes, world_size, link, algorithm)
    if kind == "reduce_scatter":
        return reduce_scatter_time(nbytes, world_size, link)
    if kind == "all_gather":
        return all_gather_time(nbytes, world_size, link)
    raise ValueError(f"unknown collective {kind!r}; choose one of {', '.join(COLLECTIVES)}")


def allreduce_time(nbytes: float, world_size: int, link: "Link | Hierarchy", algorithm: str = "ring") -> float:
    """Seconds for one all-reduce with the named ``algorithm`` (``"ring"`` or ``"tree"``).

    With a :class:`Hierarchy` the all-reduce is hierarchical and
    ``algorithm`` is the one used between nodes.
    """
    if isinstance(link, Hierarchy):
        return hierarchical_allreduce_time(nbytes, world_size, link, algorithm)
    try:
        return ALGORITHMS[algorithm](nbytes, world_size, link)
    except KeyError:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}") from None


GB = 1e9
# Bandwidth: one direction's nominal rate of the link a rank sends on; a real
# all-reduce reaches perhaps 70-90% of it (NCCL's bus bandwidth on nccl-tests).
# Latency: the per-step cost alpha. For NVLink, PCIe and InfiniBand it is
# NCCL's own cost-model figure for one ring step with its "Simple" protocol
# (``hwLat`` in NCCL's src/graph/tuning.cc: 3.4 us NVLink, 5.7 us PCIe,
# 14 us network; NCCL adds a ~8 us base per collective, left out here). For
# kernel TCP over Ethernet (Gloo, or NCCL's socket transport) a step costs
# a round trip through two network stacks, tens of microseconds.
PRESETS: dict[str, Link] = {
    link.name: link
    for link in [
        Link("pcie4", 5.7e-6, 32 * GB,
             "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding = 31.5 GB/s per direction (PCI-SIG, "
             "PCIe Base Spec 4.0, 2017); 5.7 us per ring step (NCCL tuning.cc hwLat, PCI/Ring/Simple)"),
        Link("nvlink3", 3.4e-6, 300 * GB,
             "A100 NVLink 3: 600 GB/s total, 300 GB/s per direction (NVIDIA A100 datasheet, 2020); "
             "3.4 us per ring step (NCCL tuning.cc hwLat, NVLink/Ring/Simple)"),
        Link("nvlink4", 3.4e-6, 450 * GB,
             "H100 NVLink 4: 900 GB/s total, 450 GB/s per direction (NVIDIA H100 datasheet, 2022); "
             "3.4 us per ring step (NCCL tuning.cc hwLat, NVLink/Ring/Simple)"),
        Link("eth25", 30e-6, 25e9 / 8,
             "25 Gb/s Ethernet (IEEE 802.3by-2016) = 3.1 GB/s; ~30 us per step assumed for kernel TCP "
             "(a socket round trip on commodity NICs is 10-50 us)"),
        Link("eth100", 20e-6, 100e9 / 8,
             "100 Gb/s Ethernet (IEEE 802.3ba-2010 / 802.3bj-2014) = 12.5 GB/s; ~20 us per step assumed "
             "for kernel TCP"),
        Link("ib200", 14e-6, 200e9 / 8,
             "InfiniBand HDR 200 Gb/s = 25 GB/s (NVIDIA ConnectX-6 VPI datasheet); 14 us per ring step "
             "(NCCL tuning.cc hwLat, Net/Ring/Simple; the wire's own MPI latency is ~0.6 us)"),
        Link("ib400", 14e-6, 400e9 / 8,
             "InfiniBand NDR 400 Gb/s = 50 GB/s (NVIDIA ConnectX-7 datasheet); 14 us per ring step "
             "(NCCL tuning.cc hwLat, Net/Ring/Simple)"),
        # Not hardware: slow enough that its costs show against a laptop's
        # millisecond-long backward passes in the lessons.
        Link("laptop", 2e-3, 200e6, "teaching preset: 2 ms per message, 200 MB/s"),
    ]
}


@dataclass(frozen=True)
class Hierarchy:
    """Nodes of ``ranks_per_node`` ranks: fast ``intra`` links inside a node, ``inter`` between nodes.

    ``inter`` is what *one rank* gets between nodes (a DGX H100 has one
    400 Gb/s NIC per GPU, so each GPU gets a whole ``ib400``).
    """

    name: str
    intra: Link
    inter: Link
    ranks_per_node: int
    source: str = ""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"{self.name!r}: ranks_per_node must be >= 1, got {self.ranks_per_node}")


def hierarchical_allreduce_time(nbytes: float, world_size: int, net: Hierarchy, algorithm: str = "ring") -> float:
    """Seconds for a two-level all-reduce (as NCCL and Horovod's hierarchical mode do it).

    1. reduce-scatter inside each node (ring over its ``g`` ranks): each rank
       ends up owning the node's sum of ``1/g`` of the bytes;
    2. every rank all-reduces its ``nbytes / g`` shard with the ranks holding
       the same shard on the other nodes (``algorithm`` over the nodes), all
       ``g`` shards at once, each on its own NIC;
    3. all-gather inside the node.

    Steps 1 and 3 together cost exactly one intra-node ring all-reduce.
    """
    g = min(net.ranks_per_node, world_size)
    nodes = math.ceil(world_size / g)
    inside = ring_allreduce_time(nbytes, g, net.intra)
    return inside + allreduce_time(nbytes / g, nodes, net.inter, algorithm)


# Whole machines, for hierarchical all-reduce.
HIERARCHIES: dict[str, Hierarchy] = {
    h.name: h
    for h in [
        Hierarchy("dgx-h100", PRESETS["nvlink4"], PRESETS["ib400"], 8,
                  "NVIDIA DGX H100: 8 GPUs on NVLink 4, 8 ConnectX-7 400 Gb/s NICs (DGX H100 user guide)"),
        Hierarchy("dgx-a100", PRESETS["nvlink3"], PRESETS["ib200"], 8,
                  "NVIDIA DGX A100: 8 GPUs on NVLink 3, 8 ConnectX-6 200 Gb/s NICs (DGX A100 user guide)"),
        Hierarchy("pcie-eth25", PRESETS["pcie4"], PRESETS["eth25"], 8,
                  "8 GPUs on PCIe 4.0 per node, nodes on 25 Gb/s Ethernet (a typical cloud instance)"),
    ]
}


def ring_bytes_sent_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (p - 1) / p * nbytes`` (< 2 nbytes)."""
    return 2 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def bytes_sent_per_rank(kind: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring ``kind`` over an ``nbytes`` buffer: ``2 (p-1)/p n`` for an
    all-reduce, ``(p-1)/p n`` for a reduce-scatter or an all-gather."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; choose one of {', '.join(COLLECTIVES)}")
    half = (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0
    return 2 * half if kind == "all_reduce" else half


def fit_link(sizes: list[float], seconds: list[float], world_size: int, name: str = "fitted") -> Link:
    """The :class:`Link` whose ring all-reduce time best fits measured ``(sizes, seconds)``.

    ``t = 2 (p-1) alpha + 2 (p-1)/p n / bandwidth`` is a straight line in
    ``n``; fitted by least squares on *relative* error (weights ``1/t``), so
    that a 4 KB all-reduce counts as much as a 64 MB one.
    """
    if world_size < 2 or len(sizes) < 2 or len(sizes) != len(seconds):
        raise ValueError("fit_link needs >= 2 (size, seconds) pairs measured with world_size >= 2")
    w = [1.0 / t for t in seconds]  # weights; minimise sum ((a + b n - t) / t)^2
    sw = sum(x * x for x in w)
    sx = sum(x * x * n for x, n in zip(w, sizes))
    sy = sum(x * x * t for x, t in zip(w, seconds))
    sxx = sum(x * x * n * n for x, n in zip(w, sizes))
    sxy = sum(x * x * n * t for x, n, t in zip(w, sizes, seconds))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    intercept = (sy - slope * sx) / sw
    steps = 2 * (world_size - 1)
    if slope <= 0:
        raise ValueError(f"measured times do not grow with size (slope {slope:.3g} s/B): cannot fit a bandwidth")
    return Link(name, max(intercept, 0.0) / steps, steps / world_size / slope,
                f"fitted to {len(sizes)} all-reduce timings at world size {world_size}")


def get_network(name: str) -> Link | Hierarchy:
    """A :data:`PRESETS` link or a :data:`HIERARCHIES` machine by name."""
    if name in HIERARCHIES:
        return HIERARCHIES[name]
    return get_link(name)


def get_link(name: str) -> Link:
    """A preset by name (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown network {name!r}; choose one of {', '.join([*PRESETS, *HIERARCHIES])}") from None
