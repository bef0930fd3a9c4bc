"""``python -m minddp_lab.simulate collective``: one collective, in nccl-tests' own columns.

    python -m minddp_lab.simulate collective all_reduce --bytes 8:1G --world 16 --network dgx-a100
    python -m minddp_lab.simulate collective all_reduce --world 24 --network dgx-a100 --nics-per-node 4 \\
        --against all_reduce_perf.txt          # each row of a measured table beside the model's, with the error

Prints what ``all_reduce_perf -b 8 -e 1G -f 2`` prints (size, count, type,
redop, time in us, algbw and busbw in GB/s), so that a row can be held
against a measured one line by line, plus the algorithm and protocol NCCL's
model picks for that size. ``--against FILE`` takes the sizes (and the
ranks, from its ``# Rank`` lines) of a measured ``all_reduce_perf`` output
and adds its time and the model's error per row; ``--fit-table`` fits the
network to a measured table and prints each row's residual.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

from minddp_lab.simulate.arguments import OneLineParser, one_line_errors, positive, whole
from minddp_lab.simulate.cluster import read_collective_table
from minddp_lab.simulate.nccl import ALGORITHMS, KINDS, PROTOCOLS, Cluster, bus_factor, nccl_time
from minddp_lab.simulate.network_flags import add_network_flags, fit_residuals, model_of, network_from
from minddp_lab.network import collective_time as textbook_time

__all__ = ["main", "parse_bytes", "size_range", "table"]

ELEMENT_BYTES = 4  # nccl-tests' default type: float
MAX_BYTES = 2**44  # 16 TiB: a collective larger than that is a typo
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """``"8"``, ``"64K"``, ``"1G"`` (powers of 1024, as nccl-tests reads them) -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"a size like 8, 64K, 128M or 1G, got {text!r}")
    value = int(float(m.group(1)) * _UNIT[m.group(2).upper()])
    if not 1 <= value <= MAX_BYTES:
        raise ValueError(f"a size from 1 byte to {MAX_BYTES // 2**40} TiB, got {text!r}")
    return value


def size_range(text: str, factor: float) -> list[int]:
    """``MIN:MAX`` (or one size) -> MIN, MIN x factor, ... up to MAX, as ``-b MIN -e MAX -f factor``."""
    low, _, high = text.partition(":")
    first, last = parse_bytes(low), parse_bytes(high or low)
    if last < first:
        raise ValueError(f"at most MAX; the largest size is under the smallest in {text!r}")
    sizes, n = [], float(first)
    while n <= last * (1 + 1e-12):
        sizes.append(int(n))
        n *= factor
    return sizes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="python -m minddp_lab.simulate collective", description=__doc__.strip().splitlines()[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS, help="the collective")
    p.add_argument("--bytes", default="8:1G", help="MIN:MAX bytes per rank, as nccl-tests' -b and -e (default %(default)s)")
    p.add_argument("--factor", type=positive, default=2.0, help="size step, as nccl-tests' -f (default %(default)s)")
    p.add_argument("--world", type=whole, help="ranks (default: --against's ranks, else 8)")
    p.add_argument("--algorithm", choices=["auto", *ALGORITHMS], default="auto", help="NCCL_ALGO (default: NCCL's pick)")
    p.add_argument("--protocol", choices=["auto", *PROTOCOLS], default="auto", help="NCCL_PROTO (default: NCCL's pick)")
    p.add_argument("--against", metavar="FILE", help="a measured all_reduce_perf output: its sizes, its time, the error")
    add_network_flags(p)
    args = p.parse_args(argv)
    if args.factor <= 1:
        p.error(f"argument --factor: must be > 1, got {args.factor:g}")
    return args


def _predict(kind: str, nbytes: float, world: int, network, algorithm: str, protocol: str) -> tuple[float, str]:
    if isinstance(network, Cluster):
        c = nccl_time(kind, nbytes, world, network, algorithm, protocol)
        return c.seconds, f"{c.algorithm}/{c.protocol}"
    if protocol != "auto":
        raise ValueError("--protocol needs a cluster (a machine preset, or --gpus-per-node > 1); a flat link has none")
    if algorithm == "tree" and kind != "all_reduce":
        raise ValueError(f"--algorithm tree: {kind} runs as a ring only")
    algo = "ring" if algorithm == "auto" else algorithm
    return textbook_time(kind, nbytes, world, network, algo), f"{algo} (alpha-beta)"


def table(kind: str, sizes: list[float], world: int, network, algorithm: str = "auto", protocol: str = "auto",
          measured: list[float] | None = None) -> list[str]:
    """nccl-tests' columns, one row per size (``measured``: seconds per size, for two more columns)."""
    head = f"#{'size':>11} {'count':>12} {'type':>6} {'redop':>6} {'time':>9} {'algbw':>7} {'busbw':>7}  {'algorithm':<16}"
    unit = f"#{'(B)':>11} {'(elements)':>12} {'':>6} {'':>6} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7}  {'/protocol':<16}"
    if measured is not None:
        head += f" {'measured':>9} {'error':>7}"
        unit += f" {'(us)':>9} {'':>7}"
    lines = [head, unit]
    for i, n in enumerate(sizes):
        seconds, how = _predict(kind, n, world, network, algorithm, protocol)
        algbw = n / seconds / 1e9 if seconds > 0 else 0.0
        row = (f"{int(n):>12} {int(n) // ELEMENT_BYTES:>12} {'float':>6} {'sum':>6} {seconds * 1e6:9.2f} "
               f"{algbw:7.2f} {algbw * bus_factor(kind, world):7.2f}  {how:<16}")
        if measured is not None:
            row += f" {measured[i] * 1e6:9.2f} {(seconds - measured[i]) / measured[i]:+7.1%}"
        lines.append(row)
    return lines


def run(args: argparse.Namespace) -> int:
    network = network_from(args)
    measured = None
    if args.against:
        try:
            with open(args.against) as f:
                sizes, measured, ranks = read_collective_table(f.read())
        except OSError as e:
            raise ValueError(f"--against: cannot read {args.against} ({e.strerror})") from None
        if not sizes:
            raise ValueError(f"--against: {args.against} holds no all_reduce_perf rows")
        world = args.world or ranks
        if world is None:
            raise ValueError(f"--against: {args.against} names no ranks (# Rank lines): give --world")
    else:
        try:
            sizes = size_range(args.bytes, args.factor)
        except ValueError as e:
            raise ValueError(f"--bytes {args.bytes}: must be MIN:MAX, each {e}") from None
        world = args.world or 8
    if not isinstance(network, Cluster) and args.protocol != "auto":
        raise ValueError("--protocol needs a cluster (a machine preset, or --gpus-per-node > 1); a flat link has none")
    if isinstance(network, Cluster):
        nodes, ppn = network.shape(world)
        shape = f"{world} ranks = {nodes} node(s) x {ppn} GPU(s)"
    else:
        shape = f"{world} ranks"
    print(f"# {args.kind}, {shape}, algorithm {args.algorithm}, protocol {args.protocol}; {model_of(network)}")
    print(f"# network: {network.name}: {network.source}")
    if args.fit_table:
        print("\n".join("# " + line for line in fit_residuals(args.fit_table, args.fit_world).splitlines()))
    print("\n".join(table(args.kind, sizes, world, network, args.algorithm, args.protocol, measured)))
    if measured is not None:
        big = [(s, m) for s, m in zip(sizes, measured) if s > 2**20]
        worst = max((abs(_predict(args.kind, s, world, network, args.algorithm, args.protocol)[0] - m) / m
                     for s, m in big), default=math.nan)
        print(f"# rows above 1 MiB: {len(big)}, worst error {worst:.1%}")
    return 0


def main(argv: list[str]) -> int:
    return one_line_errors(run, parse_args(argv))
