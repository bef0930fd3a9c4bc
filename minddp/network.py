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

This one model serves two users: :mod:`minddp.simulate` replays a step at
any world size with it, and the lessons' simulated link makes a real Gloo
all-reduce take as long as it says, so trade-offs show on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Link", "PRESETS", "ring_allreduce_time", "tree_allreduce_time", "allreduce_time", "get_link"]


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


def allreduce_time(nbytes: float, world_size: int, link: Link, algorithm: str = "ring") -> float:
    """Seconds for one all-reduce with the named ``algorithm`` (``"ring"`` or ``"tree"``)."""
    try:
        return ALGORITHMS[algorithm](nbytes, world_size, link)
    except KeyError:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}") from None


GB = 1e9
# Bandwidths are one direction's nominal link rate; latencies are typical
# small-message figures. Real all-reduces reach perhaps 70-90% of the rate.
PRESETS: dict[str, Link] = {
    link.name: link
    for link in [
        Link("pcie4", 2e-6, 32 * GB, "PCIe 4.0 x16: 16 GT/s x 16 lanes, ~32 GB/s per direction (PCI-SIG spec)"),
        Link("nvlink4", 2e-6, 450 * GB, "H100 NVLink 4: 900 GB/s total, 450 GB/s per direction (NVIDIA H100 datasheet)"),
        Link("eth25", 30e-6, 25e9 / 8, "25 Gb/s Ethernet (IEEE 802.3by); ~30 us TCP small-message latency"),
        Link("eth100", 20e-6, 100e9 / 8, "100 Gb/s Ethernet (IEEE 802.3ba); ~20 us TCP small-message latency"),
        Link("ib200", 2e-6, 200e9 / 8, "InfiniBand HDR 200 Gb/s; ~1-2 us MPI latency (NVIDIA ConnectX-6 datasheet)"),
        Link("ib400", 2e-6, 400e9 / 8, "InfiniBand NDR 400 Gb/s; ~1-2 us MPI latency (NVIDIA ConnectX-7 datasheet)"),
        # Not hardware: slow enough that its costs show against a laptop's
        # millisecond-long backward passes in the lessons.
        Link("laptop", 2e-3, 200e6, "teaching preset: 2 ms per message, 200 MB/s"),
    ]
}


def get_link(name: str) -> Link:
    """A preset by name (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown network {name!r}; choose one of {', '.join(PRESETS)}") from None
