"""A network as figures, each with where it came from: a preset, a flag, a fit.

A preset fills every figure; a flag **overrides the one figure it names and
nothing else** (``--latency-us`` on ``pcie-eth25`` changes the latency
between nodes; its one NIC for eight GPUs stays one NIC). :class:`Figures`
keeps each value beside its origin, so the command's "network:" line can
say, figure by figure, whether it is the preset's, yours, or fitted.
:meth:`Figures.build` checks the combination (more NICs than GPUs, figures
inside a node for a preset with one GPU per node, a million GPUs per node)
and gives a flat :class:`~minddp_lab.network.Link` (one GPU per node: the
alpha-beta ring between ranks) or a :class:`~minddp_lab.simulate.nccl.Cluster`
(NCCL's model, :mod:`minddp_lab.simulate.nccl`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minddp_lab.network import Link
from minddp_lab.simulate.nccl import MAX_GPUS_PER_NODE, Cluster

__all__ = ["Figures", "FLAGS", "NVLINK_FROM_Bps", "DEFAULT_INTRA_LATENCY_US"]

GB = 1e9
# Below this bus bandwidth inside a node, the GPUs talk over PCIe (NVLink 1, the slowest, gives 80 GB/s).
NVLINK_FROM_Bps = 50 * GB
DEFAULT_INTRA_LATENCY_US = 3.4  # NCCL's NVLink Ring/Simple hwLat (minddp_lab.simulate.nccl.HOP_LATENCY_US)

# figure -> the flag that names it
FLAGS = {"gpus_per_node": "--gpus-per-node", "nics_per_node": "--nics-per-node", "latency_us": "--latency-us",
         "nic_Bps": "--bandwidth", "intra_latency_us": "--intra-latency-us", "intra_Bps": "--intra-bandwidth",
         "intra_kind": "--intra-link"}
INTRA = ("intra_latency_us", "intra_Bps", "intra_kind")


@dataclass
class Figures:
    """Values of :data:`FLAGS`' figures and their origins (``None``: the preset has none)."""

    name: str
    values: dict = field(default_factory=dict)
    origins: dict = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, origin: str, **values) -> "Figures":
        given = {k: v for k, v in values.items() if v is not None}
        return cls(name, given, {k: origin for k in given})

    def override(self, key: str, value, origin: str) -> None:
        """Set one figure (``value`` None: leave it as it is)."""
        if key not in FLAGS:
            raise KeyError(key)
        if value is not None:
            self.values[key] = value
            self.origins[key] = origin

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def build(self) -> Link | Cluster:
        """The network these figures describe; ValueError naming the flag at fault where they cannot be."""
        g, nics = self.get("gpus_per_node", 1), self.get("nics_per_node")
        for key in ("latency_us", "intra_latency_us"):
            value = self.get(key)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{FLAGS[key]} must be a number of microseconds >= 0, got {value:g}")
        for key in ("nic_Bps", "intra_Bps"):
            value = self.get(key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{FLAGS[key]} must be a rate > 0, got {value:g}")
        if g > MAX_GPUS_PER_NODE:
            raise ValueError(f"--gpus-per-node {g}: no node holds more than {MAX_GPUS_PER_NODE} GPUs "
                             "(NVIDIA's largest NVLink domain)")
        if nics is not None and nics > g:
            raise ValueError(f"--nics-per-node {nics} with {g} GPU(s) per node ({self.origins.get('gpus_per_node')}): "
                             "more NICs than GPUs; NCCL drives at most one NIC per GPU")
        if g == 1:
            flagged = [FLAGS[k] for k in INTRA if self.origins.get(k, "").startswith(("flag", "fit"))]
            if flagged:
                raise ValueError(f"{flagged[0]} describes the link inside a node, but {self.name} has one GPU per "
                                 "node: give --gpus-per-node > 1 or a machine preset (--list-networks)")
            if self.get("intra_Bps") is None:  # a flat preset: the link between ranks, Gloo's alpha-beta ring
                return Link(self.name, self.values["latency_us"] * 1e-6, self.values["nic_Bps"], self.describe())
        if self.get("intra_Bps") is None:
            raise ValueError(f"--gpus-per-node {g} on {self.name} (one GPU per node) needs the link inside a node: "
                             "--intra-bandwidth (and --intra-latency-us), or a machine preset as --network")
        if nics is None:
            self.override("nics_per_node", g, "one per GPU, as none was given")
            nics = g
        if self.get("intra_latency_us") is None:
            self.override("intra_latency_us", DEFAULT_INTRA_LATENCY_US, "NCCL's NVLink step latency, as none was given")
        if self.get("intra_kind") is None:
            kind = "nvlink" if self.values["intra_Bps"] >= NVLINK_FROM_Bps else "pci"
            self.override("intra_kind", kind, f"{'at least' if kind == 'nvlink' else 'under'} "
                          f"{NVLINK_FROM_Bps / GB:g} GB/s inside")
        lat = self.values["latency_us"] * 1e-6
        nic = Link("NIC", lat, self.values["nic_Bps"], "one NIC")
        return Cluster(self.name, Link("inside", self.values["intra_latency_us"] * 1e-6, self.values["intra_Bps"], "inside"),
                       Link("NIC share", lat, nic.bandwidth_Bps * nics / g, f"{nics} NIC(s) shared by {g} GPUs"), g,
                       self.describe(), nics_per_node=nics, nic=nic, intra_kind=self.values["intra_kind"],
                       origins=tuple(self.origins.items()))

    def describe(self) -> str:
        """Each figure with its origin: ``8 GPUs per node (preset dgx1-v100), ...``."""
        v, o = self.values, self.origins
        g = v.get("gpus_per_node", 1)
        between = "between ranks" if g == 1 else "between nodes, per NIC"
        parts = []
        if g > 1:
            parts += [f"{g} GPUs per node ({o['gpus_per_node']})",
                      f"{v['nics_per_node']} NIC(s) per node ({o['nics_per_node']})"]
        parts += [f"{between}: {v['nic_Bps'] / GB:.3g} GB/s ({o['nic_Bps']}), {v['latency_us']:.3g} us per step "
                  f"({o['latency_us']})"]
        if g > 1:
            parts += [f"inside a node ({v['intra_kind']}: {o['intra_kind']}): {v['intra_Bps'] / GB:.3g} GB/s "
                      f"({o['intra_Bps']}), {v['intra_latency_us']:.3g} us per step ({o['intra_latency_us']})"]
        return "; ".join(parts)
