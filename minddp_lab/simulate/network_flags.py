"""The network flags shared by ``python -m minddp_lab.simulate`` and its ``collective`` subcommand.

A preset (``--network``) gives every figure; each flag overrides the one it
names (:mod:`minddp_lab.simulate.figures`); ``--fit-table`` fits the latency and
bandwidth between ranks or nodes to a measured ``all_reduce_perf`` table and
prints each row's residual.
"""

from __future__ import annotations

import argparse
import os

from minddp_lab.network import ring_allreduce_time
from minddp_lab.simulate.nccl import Cluster
from minddp_lab.simulate.arguments import at_least_zero, positive, whole
from minddp_lab.simulate.cluster import (apply_flags, fit_network_table, names, parse_rate, preset_figures,
                                     read_collective_table)

__all__ = ["add_network_flags", "network_figures", "network_from", "fit_residuals", "model_of"]


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be {e}") from None


def add_network_flags(parser: argparse.ArgumentParser) -> None:
    n = parser.add_argument_group("network (a preset; each flag overrides the one figure it names, nothing else)")
    n.add_argument("--network", default="ib400", help=f"one of: {', '.join(names())} (default %(default)s)")
    n.add_argument("--nominal", action="store_true", help="presets at their line rate, not the achieved bandwidth")
    n.add_argument("--latency-us", type=at_least_zero, help="between nodes: microseconds per ring step")
    n.add_argument("--bandwidth", type=_rate, help="between nodes: one NIC's achieved bus bandwidth (50GB/s, 400Gb/s)")
    n.add_argument("--nominal-bandwidth", type=_rate, help="one NIC's line rate (with --efficiency)")
    n.add_argument("--efficiency", type=positive, help="achieved / nominal, in (0, 1]")
    n.add_argument("--gpus-per-node", type=whole, help="GPUs per node (default: the preset's)")
    n.add_argument("--nics-per-node", type=whole, help="NICs the node's GPUs share (default: the preset's; one per GPU where it has none)")
    n.add_argument("--intra-latency-us", type=at_least_zero, help="inside a node: microseconds per ring step")
    n.add_argument("--intra-bandwidth", type=_rate, help="inside a node: achieved bus bandwidth per GPU")
    n.add_argument("--intra-link", choices=["nvlink", "pci"], help="inside a node: NCCL's latencies and protocols "
                   "for NVLink or PCIe (default: the preset's, else nvlink from 50 GB/s up)")
    n.add_argument("--fit-table", metavar="FILE", help="fit the network (with --gpus-per-node > 1: one NIC, measured "
                   "at one GPU per node) to all_reduce_perf (nccl-tests) output, or to the JSON of "
                   "benchmarks/validate_simulator.py --json")
    n.add_argument("--fit-world", type=whole, help="ranks of --fit-table (default: its '# Rank' lines)")
    n.add_argument("--intra-fit-table", metavar="FILE", help="fit the link inside a node to all_reduce_perf output "
                   "measured on one node")


def _fitted(flag: str, path: str, world: int | None):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path} ({e.strerror})") from None
    try:
        return fit_network_table(text, world)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def network_from(args: argparse.Namespace):
    return network_figures(args).build()


def network_figures(args: argparse.Namespace):
    """The preset's figures, each flag overriding the one it names, each fit the ones it fits."""
    figures = preset_figures(args.network, nominal=args.nominal)
    if args.fit_table:
        fitted = _fitted("--fit-table", args.fit_table, args.fit_world)
        figures.override("latency_us", fitted.alpha_s * 1e6, f"fit --fit-table {os.path.basename(args.fit_table)}")
        figures.override("nic_Bps", fitted.bandwidth_Bps, f"fit --fit-table {os.path.basename(args.fit_table)}")
    if args.intra_fit_table:
        if args.intra_latency_us is not None or args.intra_bandwidth is not None:
            raise ValueError("--intra-fit-table or --intra-latency-us/--intra-bandwidth, not both")
        intra = _fitted("--intra-fit-table", args.intra_fit_table, None)
        where = f"fit --intra-fit-table {os.path.basename(args.intra_fit_table)}"
        figures.override("intra_latency_us", intra.alpha_s * 1e6, where)
        figures.override("intra_Bps", intra.bandwidth_Bps, where)
    apply_flags(figures, latency_us=args.latency_us, bandwidth_Bps=args.bandwidth, nominal_Bps=args.nominal_bandwidth,
                efficiency=args.efficiency, gpus_per_node=args.gpus_per_node, nics_per_node=args.nics_per_node,
                intra_latency_us=args.intra_latency_us, intra_bandwidth_Bps=args.intra_bandwidth,
                intra_link=args.intra_link)
    return figures


def fit_residuals(path: str, world: int | None) -> str:
    """Each row of a measured table against the link fitted to it: size, measured, fitted, residual."""
    with open(path) as f:
        text = f.read()
    link = fit_network_table(text, world)
    sizes, seconds, ranks = read_collective_table(text)
    p = world or ranks
    lines = [f"fit of {os.path.basename(path)} ({p} ranks): {link.source}",
             "|       size (B) | measured us | fitted us | residual |", "|---:|---:|---:|---:|"]
    for n, t in zip(sizes, seconds):
        fit = ring_allreduce_time(n, p, link)
        lines.append(f"| {int(n)} | {t * 1e6:.2f} | {fit * 1e6:.2f} | {(fit - t) / t:+.1%} |")
    return "\n".join(lines)


def model_of(network) -> str:
    """Which model times this network's collectives, in words."""
    if isinstance(network, Cluster):
        return "collectives by NCCL's ring/tree model (minddp_lab.simulate.nccl)"
    return "collectives by the alpha-beta ring (minddp_lab.network: a flat link)"
