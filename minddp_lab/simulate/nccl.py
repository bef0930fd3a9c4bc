"""Collectives as NCCL runs them: rings and trees over a cluster's nodes, pipelined, in three protocols.

:mod:`minddp_lab.network`'s textbook model runs a hierarchical all-reduce as
phases one after another (a ring inside the node, then one between nodes,
then inside again) at each link's own speed. NCCL does not: a **ring**
threads through every GPU of every node, crossing each node's NIC once per
turn, and cuts the buffer into chunks that flow around it; every hop works
at once on a different chunk. So the hops are *pipelined*: the time is one
latency per step of the ring plus the bytes over the **slowest hop's**
bandwidth, not the sum of the phases. The slowest hop is either a GPU's
links inside the node or the node's NICs, shared by the node's GPUs and
carried by NCCL's channels (one ring each, spread over the NICs)::

    ring:  t = base + sum of the 2 (p - 1) steps' hop latencies + n / (bus / (2 (p - 1) / p))
           bus = min(bus bandwidth inside a node, NICs x one NIC's bandwidth)  (one node: the inside figure)

A **tree** (NCCL's double binary tree between nodes, a chain inside each)
sends every byte up and down once: ``2 (g - 1)`` hops inside and
``2 log2(nodes)`` between, at half its bus bandwidth per byte of the
buffer. NCCL picks, per message size, the (algorithm, protocol) pair its
model says is fastest; so does :func:`collective_time` (``"auto"``).

The three **protocols** trade latency for bandwidth: **LL** (8 bytes of data
and a flag per 16: a quarter of the bandwidth, almost no latency), **LL128**
(120 of every 128 bytes, NVLink only) and **Simple** (full bandwidth, a
flag per chunk, the highest latency). Every figure below is NCCL's own
cost model (``src/graph/tuning.cc`` of NVIDIA/nccl, NCCL 2.8, commit
01afd20), named as there:

* :data:`BASE_LATENCY_US`: ``baseLat``, once per collective;
* :data:`HOP_LATENCY_US`: ``hwLat``, per ring step or tree level, by
  hardware (NVLink, PCI, network), algorithm and protocol. A cluster's own
  latencies (its ``Link.alpha_s``, set by presets or ``--latency-us``) are
  the Ring/Simple ones; the other protocols keep NCCL's ratio to it;
* :data:`PROTOCOL_BANDWIDTH`: the share of the bus bandwidth each protocol
  reaches (``busBw *= ...`` under "Various model refinements");
* :data:`TREE_CORRECTION`: ``treeCorrectionFactor``, NCCL's correction of
  the tree's bandwidth at mid sizes (64 B to 128 MB, powers of two);

NCCL's model also multiplies a multi-node Simple ring's latency by 1.9
above ``p / 16 x 64 KiB`` ("plateau effect of ring"); left out here: the
measured 3-node table of ``docs/collectives_checked.md`` runs at the NICs'
full bandwidth at 128 MB, with no room for it (it would add 0.2 ms, 8%).

* :data:`TREE_MAX_BUS_GBPS`: ``maxTreeBw``, the tree's ceiling (110 GB/s up
  to 2 nodes, 80 beyond; 130 and 105 with LL128 on A100s).

Left out: NCCL's per-channel caps (LL128's 16.7 GB/s per channel),
CollNet/SHARP and NVLS (NVLink SHARP), and congestion in the switches.
:data:`LAUNCH_US` is what nccl-tests' time holds beyond NCCL's model (a
kernel launch, the stream's wait), fitted in ``docs/collectives_checked.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minddp_lab.network import Hierarchy, Link
from minddp_lab.network import collective_time as textbook_time

__all__ = ["Cluster", "Choice", "ALGORITHMS", "PROTOCOLS", "collective_time", "nccl_time", "bus_factor",
           "MAX_GPUS_PER_NODE", "LAUNCH_US"]

ALGORITHMS = ("ring", "tree")
PROTOCOLS = ("LL", "LL128", "Simple")
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
MAX_GPUS_PER_NODE = 576  # NVIDIA's largest NVLink domain (GB200 NVL576); anything above is a typo

_SOURCE = "NCCL 2.8 src/graph/tuning.cc (NVIDIA/nccl commit 01afd20)"
BASE_LATENCY_US = {("tree", "LL"): 4.4, ("tree", "LL128"): 4.4, ("tree", "Simple"): 0.0,
                   ("ring", "LL"): 3.6, ("ring", "LL128"): 10.0, ("ring", "Simple"): 8.4}
HOP_LATENCY_US = {  # (hardware, algorithm) -> (LL, LL128, Simple)
    ("nvlink", "tree"): (0.52, 1.2, 28.0), ("nvlink", "ring"): (0.47, 1.9, 3.4),
    ("pci", "tree"): (1.0, 1.9, 28.0), ("pci", "ring"): (1.0, 2.5, 5.7),
    ("net", "tree"): (5.0, 8.5, 50.0), ("net", "ring"): (2.7, 4.0, 9.6),
}
PROTOCOL_BANDWIDTH = {"ring": {"LL": 1 / 4, "LL128": 0.92, "Simple": 1.0},
                      "tree": {"LL": 0.9 / 3.8, "LL128": 0.9 * 0.915, "Simple": 0.9}}
TREE_MAX_BUS_GBPS = {False: (110.0, 130.0), True: (80.0, 105.0)}  # maxTreeBw: [more than 2 nodes][LL128]
LL128_ONE_GPU_PER_NODE = 0.7  # ring LL128 with one GPU per node: the GPU sends and receives through the NIC
LL128_TREE_ONE_NODE = 0.9 * 7 / 9
LL_INTRA_MULTINODE = 1.8  # LL's hop latency inside a node, when there are several nodes
TREE_CORRECTION = {  # powers of two of (bytes / 64), from 0 to 21
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
# nccl-tests' time beyond NCCL's model (a kernel launch): fitted by `python benchmarks/published_nccl.py --fit`
# to its fitting table only (2 RTX A6000 on PCIe, small messages); docs/collectives_checked.md.
LAUNCH_US = 2.3


@dataclass(frozen=True)
class Cluster(Hierarchy):
    """Nodes of ``ranks_per_node`` GPUs, each node with ``nics_per_node`` NICs of ``nic`` (achieved bandwidth,
    Ring/Simple latency per step); ``intra`` the bus bandwidth and step latency inside a node.

    A :class:`~minddp_lab.network.Hierarchy` too (``inter``: one GPU's share of the NICs), so that code written
    for the two-level model reads it; the simulator times its collectives with :func:`collective_time`.
    ``origins``: each figure's origin (preset, flag, fit), for the "network:" line.
    """

    nics_per_node: int = 1
    nic: Link | None = None
    intra_kind: str = "nvlink"  # or "pci": which of NCCL's latency rows the inside hops take
    launch_us: float = LAUNCH_US
    origins: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ranks_per_node > MAX_GPUS_PER_NODE:
            raise ValueError(f"{self.ranks_per_node} GPUs per node: no node holds more than {MAX_GPUS_PER_NODE}")
        if self.nics_per_node > self.ranks_per_node:
            raise ValueError(f"{self.nics_per_node} NICs per node for {self.ranks_per_node} GPU(s): "
                             "more NICs than GPUs (NCCL drives at most one NIC per GPU)")
        if self.intra_kind not in ("nvlink", "pci"):
            raise ValueError(f"intra_kind must be 'nvlink' or 'pci', got {self.intra_kind!r}")

    @property
    def node_nic_Bps(self) -> float:
        return (self.nic or self.inter).bandwidth_Bps * (self.nics_per_node if self.nic else self.ranks_per_node)

    def shape(self, world_size: int) -> tuple[int, int]:
        """``(nodes, GPUs per node)`` of ``world_size`` ranks; ValueError where nodes cannot all be full."""
        g = self.ranks_per_node
        if world_size <= g:
            return 1, world_size
        if world_size % g:
            raise ValueError(f"world size {world_size} is not a multiple of {g} GPUs per node (nodes are full): "
                             f"take {world_size // g * g} or {(world_size // g + 1) * g}")
        return world_size // g, g


@dataclass(frozen=True)
class Choice:
    seconds: float
    algorithm: str
    protocol: str


def bus_factor(kind: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw: ``2 (p-1) / p`` for an all-reduce, ``(p-1) / p`` for the halves."""
    if world_size <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (world_size - 1) / world_size


def _hop_us(cluster: Cluster, hardware: str, algorithm: str, protocol: str) -> float:
    """One hop's latency: the cluster's Ring/Simple figure, scaled to (algorithm, protocol) as NCCL's table is."""
    own = (cluster.nic or cluster.inter).alpha_s if hardware == "net" else cluster.intra.alpha_s
    row = HOP_LATENCY_US[hardware, algorithm]
    return own * 1e6 * row[PROTOCOLS.index(protocol)] / HOP_LATENCY_US[hardware, "ring"][2]


def _ring(kind: str, nbytes: float, p: int, nodes: int, ppn: int, cluster: Cluster, protocol: str) -> float:
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    inter_steps = (2 if kind == "all_reduce" else 1) * (nodes - 1)
    bus = cluster.intra.bandwidth_Bps if nodes == 1 else min(cluster.intra.bandwidth_Bps, cluster.node_nic_Bps)
    share = PROTOCOL_BANDWIDTH["ring"][protocol]
    if protocol == "LL" and nodes == 1 and kind != "all_reduce":
        share = 1 / 3
    if protocol == "LL128" and ppn < 2:
        share = LL128_ONE_GPU_PER_NODE
    inside = _hop_us(cluster, cluster.intra_kind, "ring", protocol)
    if nodes > 1 and protocol == "LL":
        inside *= LL_INTRA_MULTINODE
    between = _hop_us(cluster, "net", "ring", protocol) if nodes > 1 else inside
    latency = BASE_LATENCY_US["ring", protocol] + (steps - inter_steps) * inside + inter_steps * between
    algbw = bus * share * p / steps
    return latency * 1e-6 + nbytes / algbw


def _tree(nbytes: float, nodes: int, ppn: int, cluster: Cluster, protocol: str) -> float:
    # Each byte goes up the tree and down again: a GPU's links inside the node carry it twice (half the bus
    # bandwidth per byte of the buffer, NCCL's ratio .5), a node's NICs once (each of the two trees sends
    # half the buffer up or down through every node).
    bus = cluster.intra.bandwidth_Bps * 0.5 if nodes == 1 else min(cluster.intra.bandwidth_Bps * 0.5,
                                                                     cluster.node_nic_Bps)
    cap = TREE_MAX_BUS_GBPS[nodes > 2][protocol == "LL128"] * 1e9 * 0.5
    bus = min(bus, cap)
    share = LL128_TREE_ONE_NODE if (protocol == "LL128" and nodes == 1) else PROTOCOL_BANDWIDTH["tree"][protocol]
    log_size = int(math.log2(max(nbytes, 64) / 64))
    if log_size < len(TREE_CORRECTION[protocol]):
        share *= TREE_CORRECTION[protocol][log_size]
    inside = _hop_us(cluster, cluster.intra_kind, "tree", protocol)
    if nodes > 1 and protocol == "LL":
        inside *= LL_INTRA_MULTINODE
    between = _hop_us(cluster, "net", "tree", protocol)
    latency = BASE_LATENCY_US["tree", protocol] + 2 * ((ppn - 1) * inside + int(math.log2(nodes)) * between)
    return latency * 1e-6 + nbytes / (bus * share)


def nccl_time(kind: str, nbytes: float, world_size: int, cluster: Cluster, algorithm: str = "auto",
              protocol: str = "auto") -> Choice:
    """The time of one ``kind`` collective of ``nbytes`` (the buffer each rank holds) and the
    (algorithm, protocol) that gives it: the fastest of those allowed, as NCCL's tuner picks."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; choose one of {', '.join(KINDS)}")
    if algorithm not in ("auto", *ALGORITHMS) or protocol not in ("auto", *PROTOCOLS):
        raise ValueError(f"algorithm must be auto or one of {ALGORITHMS}, protocol auto or one of {PROTOCOLS}")
    if world_size <= 1:
        return Choice(0.0, "none", "none")
    nodes, ppn = cluster.shape(world_size)
    algorithms = [a for a in ALGORITHMS if algorithm in ("auto", a) and (a == "ring" or kind == "all_reduce")]
    if not algorithms:
        raise ValueError(f"NCCL runs {kind} as a ring only")
    protocols = [q for q in PROTOCOLS if protocol in ("auto", q) and (q != "LL128" or cluster.intra_kind == "nvlink"
                                                                       or protocol == q)]
    best = None
    for a in algorithms:
        for q in protocols:
            t = _ring(kind, nbytes, world_size, nodes, ppn, cluster, q) if a == "ring" else _tree(nbytes, nodes, ppn, cluster, q)
            if best is None or t < best.seconds:
                best = Choice(t, a, q)
    return Choice(best.seconds + cluster.launch_us * 1e-6, best.algorithm, best.protocol)


def collective_time(kind: str, nbytes: float, world_size: int, network: Link | Hierarchy,
                    algorithm: str = "auto") -> float:
    """Seconds for one collective: NCCL's model on a :class:`Cluster`, else :mod:`minddp_lab.network`'s
    alpha-beta model (a flat link, or a two-level :class:`~minddp_lab.network.Hierarchy` built by hand)."""
    if isinstance(network, Cluster):
        return nccl_time(kind, nbytes, world_size, network, algorithm).seconds
    return textbook_time(kind, nbytes, world_size, network, "ring" if algorithm == "auto" else algorithm)
