"""Your cluster, described by what you know: achieved bandwidths, node shape, NICs, or a measured table.

:mod:`minddp_lab.network`'s presets are line rates (what the datasheet says).
A collective reaches less: NCCL's own maintainers put its protocol overhead
on NVLink at about 20% (450 GB/s line rate, about 370 GB/s achieved on an
H100 node; NVIDIA/nccl-tests issue 212). :data:`ACHIEVED` gives each preset
its achieved fraction and where that figure comes from, and
:func:`achieved_network` applies it: a flat link's bandwidth, or both levels
of a machine.

:func:`build_network` makes a network from flags: a latency and an achieved
bandwidth (or a nominal rate and an efficiency), GPUs per node and NICs per
node. The GPUs of a node share its NICs: each rank's share between nodes is
``NIC bandwidth x NICs / GPUs`` (a DGX-1 has 4 NICs for 8 GPUs: half a NIC
each). :func:`parse_collective_table` reads the output of NCCL's
``all_reduce_perf`` (nccl-tests) and :func:`fit_network_table` fits a link
to it with :func:`minddp_lab.network.fit_link`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace

from minddp_lab.network import HIERARCHIES, PRESETS, Hierarchy, Link, fit_link
from minddp_lab.simulate.figures import FLAGS, Figures
from minddp_lab.simulate.nccl import Cluster

__all__ = ["Achieved", "ACHIEVED", "MACHINES", "achieved_network", "lookup_network", "build_network", "network_table",
           "parse_rate", "parse_collective_table", "read_collective_table", "fit_network_table", "preset_figures", "figures_of", "apply_flags"]

GB = 1e9


@dataclass(frozen=True)
class Achieved:
    efficiency: float  # achieved bus bandwidth / line rate
    source: str


_NVLINK_OVERHEAD = "NCCL's ~20% protocol overhead on NVLink (NVIDIA/nccl-tests issue 212, a maintainer's answer)"
_IB = ("NCCL's maintainers: ~24 GB/s all-reduce bus bandwidth per 200 Gb/s NIC (NVIDIA/nccl-tests issue 252), "
       "46-48 GB/s per 400 Gb/s NIC (nccl-tests issue 290): 96% of the line rate")
_TCP = "assumed: kernel TCP reaches less than InfiniBand's 96% (NCCL's socket transport, Gloo)"
ACHIEVED: dict[str, Achieved] = {
    "nvlink4": Achieved(370 / 450, "about 370 GB/s bus bandwidth on 8 H100s with NCCL_ALGO=Ring; " + _NVLINK_OVERHEAD),
    "nvlink3": Achieved(200 / 300, "about 200 GB/s bus bandwidth on 8 A100s (NVIDIA/nccl-tests issues 149, 178)"),
    "nvlink2": Achieved(0.8, "assumed: " + _NVLINK_OVERHEAD),
    "pcie4": Achieved(0.8, "assumed: the same 20% as NVLink; on PCIe the CPU's memory often limits more"),
    "ib200": Achieved(0.96, _IB),
    "ib400": Achieved(0.96, _IB),
    "ib100": Achieved(0.96, _IB),
    "eth25": Achieved(0.8, _TCP),
    "eth100": Achieved(0.8, _TCP),
    "laptop": Achieved(1.0, "teaching preset: the figure is the model"),
}

# Links and machines beyond minddp_lab.network's presets (line rates, as there).
_EXTRA_LINKS = {
    "nvlink2": Link("nvlink2", 3.4e-6, 150 * GB,
                    "DGX-1 V100 NVLink 2: 6 links of 25 GB/s per direction per GPU, run as 6 one-way rings "
                    "(NVIDIA DGX-1 V100 whitepaper, hybrid cube-mesh); 3.4 us per ring step (NCCL tuning.cc hwLat)"),
    "ib100": Link("ib100", 14e-6, 100e9 / 8,
                  "InfiniBand EDR 100 Gb/s = 12.5 GB/s (Mellanox ConnectX-4/5); 14 us per ring step (NCCL tuning.cc "
                  "hwLat, Net/Ring/Simple)"),
}
MACHINES: dict[str, tuple[str, str, int, int, str]] = {  # name: (intra link, NIC, GPUs per node, NICs per node, source)
    "dgx1-v100": ("nvlink2", "ib100", 8, 4, "NVIDIA DGX-1 (V100): 8 GPUs, NVLink 2 hybrid cube-mesh, 4 x 100 Gb/s "
                  "InfiniBand EDR per machine (as PyTorch's DDP benchmark README describes its DGX-1s)"),
}


# minddp_lab.network's machines give every GPU a NIC of its own; a typical cloud instance has one for all 8.
NICS_PER_NODE = {"pcie-eth25": 1}
_PCI_INSIDE = {"pcie-eth25"}  # machines whose GPUs talk over PCIe (NCCL's PCI latencies, no LL128)


def _link(name: str) -> Link:
    return _EXTRA_LINKS[name] if name in _EXTRA_LINKS else PRESETS[name]


def _scaled(link: Link, factor: float, note: str) -> Link:
    return Link(link.name, link.alpha_s, link.bandwidth_Bps * factor, f"{link.source}; {note}" if note else link.source)


def _achieved(link: Link, name: str) -> Link:
    a = ACHIEVED.get(name)
    if a is None:
        return link
    return _scaled(link, a.efficiency, f"achieved {a.efficiency:.0%} of {link.bandwidth_Bps / GB:g} GB/s = "
                   f"{link.bandwidth_Bps * a.efficiency / GB:.3g} GB/s: {a.source}")


def names() -> list[str]:
    return [*PRESETS, *_EXTRA_LINKS, *HIERARCHIES, *MACHINES]


def _shape(name: str) -> tuple[str | None, str, int, int]:
    """``(link inside a node or None, link between, GPUs per node, NICs per node)`` of a preset."""
    if name in MACHINES:
        intra, nic, g, nics, _ = MACHINES[name]
        return intra, nic, g, nics
    if name in HIERARCHIES:
        h = HIERARCHIES[name]
        return h.intra.name, h.inter.name, h.ranks_per_node, NICS_PER_NODE.get(name, h.ranks_per_node)
    if name in PRESETS or name in _EXTRA_LINKS:
        return None, name, 1, 1
    raise ValueError(f"--network must be one of {', '.join(names())}, got {name!r}")


def _rate(link_name: str, nominal: bool, preset: str) -> tuple[float, str]:
    link = _link(link_name)
    if nominal or link_name not in ACHIEVED:
        return link.bandwidth_Bps, f"preset {preset}, line rate"
    a = ACHIEVED[link_name]
    return link.bandwidth_Bps * a.efficiency, f"preset {preset}: {a.efficiency:.0%} of {link.bandwidth_Bps / GB:.3g}"


def preset_figures(name: str, nominal: bool = False) -> Figures:
    """A preset's figures, each marked as the preset's (bandwidths achieved unless ``nominal``)."""
    intra, nic, g, nics = _shape(name)
    origin = f"preset {name}"
    f = Figures.of(name, origin, gpus_per_node=g, latency_us=_link(nic).alpha_s * 1e6)
    f.override("nic_Bps", *_rate(nic, nominal, name))
    if intra is not None:
        f.override("nics_per_node", nics, origin)
        f.override("intra_latency_us", _link(intra).alpha_s * 1e6, origin)
        f.override("intra_Bps", *_rate(intra, nominal, name))
        f.override("intra_kind", "pci" if name in _PCI_INSIDE else "nvlink", origin)
    return f


def lookup_network(name: str, nominal: bool = False) -> Link | Cluster:
    """A preset by name, its bandwidths the achieved ones (``nominal=True``: the line rates): a flat
    :class:`Link` for one GPU per node, else a :class:`~minddp_lab.simulate.nccl.Cluster`."""
    return preset_figures(name, nominal).build()


def figures_of(net: Link | Hierarchy, origin: str = "given") -> Figures:
    """The figures of a network object (a :class:`Cluster` keeps its origins)."""
    if isinstance(net, Cluster):
        f = Figures.of(net.name, origin, gpus_per_node=net.ranks_per_node, nics_per_node=net.nics_per_node,
                       latency_us=net.nic.alpha_s * 1e6, nic_Bps=net.nic.bandwidth_Bps,
                       intra_latency_us=net.intra.alpha_s * 1e6, intra_Bps=net.intra.bandwidth_Bps,
                       intra_kind=net.intra_kind)
        f.origins.update(dict(net.origins))
        return f
    if isinstance(net, Hierarchy):  # the textbook machine: one NIC per GPU, ``inter`` is each GPU's
        return Figures.of(net.name, origin, gpus_per_node=net.ranks_per_node, nics_per_node=net.ranks_per_node,
                          latency_us=net.inter.alpha_s * 1e6, nic_Bps=net.inter.bandwidth_Bps,
                          intra_latency_us=net.intra.alpha_s * 1e6, intra_Bps=net.intra.bandwidth_Bps)
    return Figures.of(net.name, origin, gpus_per_node=1, latency_us=net.alpha_s * 1e6, nic_Bps=net.bandwidth_Bps)


def apply_flags(f: Figures, *, latency_us: float | None = None, bandwidth_Bps: float | None = None,
                nominal_Bps: float | None = None, efficiency: float | None = None,
                gpus_per_node: int | None = None, nics_per_node: int | None = None,
                intra_latency_us: float | None = None, intra_bandwidth_Bps: float | None = None,
                intra_link: str | None = None, origin: str = "flag") -> Figures:
    """``f`` with each given figure replaced, and only those; ValueError naming the flag at fault."""
    for flag, value in (("--gpus-per-node", gpus_per_node), ("--nics-per-node", nics_per_node)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a whole number >= 1, got {value}")
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ValueError(f"--efficiency must be in (0, 1] (achieved / nominal), got {efficiency:g}")
    if (nominal_Bps is None) != (efficiency is None):
        raise ValueError("--nominal-bandwidth and --efficiency go together (achieved = nominal x efficiency)")
    if bandwidth_Bps is not None and nominal_Bps is not None:
        raise ValueError("give --bandwidth (achieved) or --nominal-bandwidth with --efficiency, not both")
    if intra_link not in (None, "nvlink", "pci"):
        raise ValueError(f"--intra-link must be nvlink or pci, got {intra_link!r}")
    named = origin == "flag"
    f.override("latency_us", latency_us, f"{origin} --latency-us" if named else origin)
    f.override("nic_Bps", bandwidth_Bps, f"{origin} --bandwidth" if named else origin)
    if nominal_Bps is not None:
        f.override("nic_Bps", nominal_Bps * efficiency, f"{origin}s --nominal-bandwidth x --efficiency"
                   if named else origin)
    for key, value in (("gpus_per_node", gpus_per_node), ("nics_per_node", nics_per_node),
                       ("intra_latency_us", intra_latency_us), ("intra_Bps", intra_bandwidth_Bps),
                       ("intra_kind", intra_link)):
        f.override(key, value, f"{origin} {FLAGS[key]}" if named else origin)
    return f


def build_network(base: Link | Hierarchy, **figures) -> Link | Cluster:
    """``base`` with the given figures replaced, and nothing else (:func:`apply_flags`' arguments). The
    between-node figures are *one NIC's*; each GPU gets NICs / GPUs of the node's. ValueError naming the
    flag at fault."""
    return apply_flags(figures_of(base), origin="given", **figures).build()


def achieved_network(net: Link | Hierarchy, parts: tuple[str, ...] | None = None) -> Link | Hierarchy:
    """``net`` with each link's bandwidth at its achieved fraction (:data:`ACHIEVED`, by preset name)."""
    if isinstance(net, Hierarchy):
        intra_name, inter_name = parts or (net.intra.name, net.inter.name)
        return replace(net, intra=_achieved(net.intra, intra_name), inter=_achieved(net.inter, inter_name))
    return _achieved(net, (parts or (net.name,))[0])


def network_table() -> str:
    """Every preset's nominal and achieved bandwidth and latency, and where the achieved figure comes from."""
    lines = ["| network | GPUs per node | NICs per node | nominal GB/s (per NIC) | achieved GB/s | latency us | "
             "achieved figure from |", "|---|---:|---:|---:|---:|---:|---|"]
    for name in names():
        intra, nic, g, nics = _shape(name)
        levels = [("inside", intra), ("between", nic)] if intra else [("", nic)]
        for where, part in levels:
            link = _link(part)
            achieved = link.bandwidth_Bps * (ACHIEVED[part].efficiency if part in ACHIEVED else 1.0)
            label = f"{name} ({where})" if where else name
            source = ACHIEVED[part].source if part in ACHIEVED else "line rate"
            lines.append(f"| {label} | {g} | {nics} | {link.bandwidth_Bps / GB:.3g} | {achieved / GB:.3g} "
                         f"| {link.alpha_s * 1e6:.3g} | {source} |")
    return "\n".join(lines)


_RATE = re.compile(r"^\s*([0-9.eE+-]+)\s*(GB/s|Gb/s|MB/s|Mb/s|TB/s)?\s*$")
_UNITS = {None: GB, "GB/s": GB, "Gb/s": GB / 8, "MB/s": 1e6, "Mb/s": 1e6 / 8, "TB/s": 1e12}


def parse_rate(text: str) -> float:
    """``"400Gb/s"``, ``"50GB/s"``, ``"50"`` (GB/s) -> bytes per second; ValueError unless positive."""
    m = _RATE.match(text)
    value = float(m.group(1)) if m else math.nan
    if not (m and math.isfinite(value) and value > 0):
        raise ValueError(f"a positive rate like 50GB/s, 400Gb/s or 800MB/s (a bare number is GB/s), got {text!r}")
    return value * _UNITS[m.group(2)]


def parse_collective_table(text: str) -> tuple[list[float], list[float], int | None]:
    """Sizes (bytes), out-of-place times (s) and world size (from its ``# Rank`` lines, if any) of an
    ``all_reduce_perf`` output. Its data lines end in two blocks of time, algbw, busbw, #wrong."""
    sizes, seconds, ranks = [], [], set()
    for line in text.splitlines():
        rank = re.match(r"#\s*Rank\s+(\d+)", line.strip())
        if rank:
            ranks.add(int(rank.group(1)))
        tokens = line.split()
        if len(tokens) < 10 or not tokens[0].isdigit():
            continue
        try:
            size, time_us = int(tokens[0]), float(tokens[-8])
        except ValueError:
            continue
        if size > 0 and time_us > 0:
            sizes.append(float(size))
            seconds.append(time_us * 1e-6)
    return sizes, seconds, (len(ranks) or None)


def _benchmark_json(text: str) -> tuple[list[float], list[float], int | None]:
    """Sizes and median times of ``benchmarks/validate_simulator.py --json`` (its ``fit``): all-reduces here."""
    fit = json.loads(text).get("fit", {})
    if "sizes" not in fit or "median_ms" not in fit:
        raise ValueError("a JSON table needs the 'fit' of benchmarks/validate_simulator.py --json (sizes, median_ms)")
    return [float(n) for n in fit["sizes"]], [t / 1e3 for t in fit["median_ms"]], fit.get("world_size")


def read_collective_table(text: str) -> tuple[list[float], list[float], int | None]:
    """Sizes, seconds and ranks of an ``all_reduce_perf`` output or a ``validate_simulator.py --json``."""
    return _benchmark_json(text) if text.lstrip().startswith("{") else parse_collective_table(text)


def fit_network_table(text: str, world_size: int | None = None, min_bytes: float = 0) -> Link:
    """A :class:`Link` fitted to an ``all_reduce_perf`` table, or to the all-reduce timings of
    ``benchmarks/validate_simulator.py --json`` (sizes >= ``min_bytes``); ValueError if it cannot."""
    sizes, seconds, ranks = read_collective_table(text)
    world = world_size or ranks
    if world is None:
        raise ValueError("the table names no ranks (# Rank lines): give --fit-world")
    kept = [(n, t) for n, t in zip(sizes, seconds) if n >= min_bytes]
    if len(kept) < 2:
        raise ValueError(f"need at least 2 rows of all_reduce_perf output, found {len(kept)}")
    link = fit_link([n for n, _ in kept], [t for _, t in kept], world, "fitted")
    return replace(link, source=f"fitted to {len(kept)} all-reduce timings at {world} ranks: "
                                f"{link.alpha_s * 1e6:.2f} us per ring step, {link.bandwidth_Bps / GB:.3g} GB/s bus bandwidth")
