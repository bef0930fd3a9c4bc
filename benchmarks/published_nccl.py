"""``python -m minddp_lab.simulate collective`` against published ``all_reduce_perf`` (nccl-tests) tables.

    python benchmarks/published_nccl.py          # the tables of docs/collectives_checked.md (a second)
    python benchmarks/published_nccl.py --fit    # refit LAUNCH_US on the fitting table only

The published rows (size, out-of-place time) are in ``published_nccl.json``,
each table with its source (a GitHub issue), its hardware and the network
flags that describe that hardware to the simulator (presets, and flags for
what differs: NICs per node, the GPUs' link). Nothing in those flags comes
from the table it is checked against. One figure is fitted:
``minddp_lab.simulate.nccl.LAUNCH_US`` (what nccl-tests' time holds beyond
NCCL's cost model: a kernel launch), on the table marked ``fit`` only; the
others are held out. Target: every held-out row above 1 MB within
10%; smaller rows are printed, not targeted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minddp_lab.simulate.collective_report import parse_args as collective_args  # noqa: E402
from minddp_lab.simulate.nccl import LAUNCH_US, bus_factor, nccl_time  # noqa: E402
from minddp_lab.simulate.network_flags import network_from  # noqa: E402

TABLES = os.path.join(ROOT, "benchmarks", "published_nccl.json")
MiB = 2**20
TARGET = 0.10


def tables() -> list[dict]:
    with open(TABLES) as f:
        return json.load(f)["tables"]


def network(t: dict, launch_us: float):
    return replace(network_from(collective_args(["all_reduce", *t["flags"]])), launch_us=launch_us)


def gpus_per_node(t: dict) -> int:
    return network(t, LAUNCH_US).ranks_per_node


def command(t: dict) -> str:
    """The command line that gives one row of ``t`` (SIZE: the row's size); ``algorithm``: NCCL_ALGO as measured."""
    forced = f" --algorithm {t['algorithm']}" if "algorithm" in t else ""
    return f"python -m minddp_lab.simulate collective all_reduce {' '.join(t['flags'])} --world {t['world']}{forced} --bytes SIZE"


def predicted_us(t: dict, size: float, launch_us: float) -> tuple[float, str]:
    c = nccl_time("all_reduce", size, t["world"], network(t, launch_us), t.get("algorithm", "auto"))
    return c.seconds * 1e6, f"{c.algorithm}/{c.protocol}"


def fit(launch_grid=None) -> float:
    """The launch cost (us, 0.1 us steps) with the smallest worst relative error on the fitting tables."""
    grid = launch_grid or [x / 10 for x in range(0, 201)]
    rows = [(t, size, us) for t in tables() if t["set"] == "fit" for size, us in t["rows"]]
    return min(grid, key=lambda g: max(abs(predicted_us(t, size, g)[0] / us - 1) for t, size, us in rows))


def average_sizes(a: dict) -> list[int]:
    """The sizes nccl-tests averaged over: ``first`` then in steps of ``step`` bytes (-i) or times ``factor`` (-f)."""
    if "factor" in a:
        return [a["first"] * a["factor"] ** k for k in range(a["count"])]
    return [a["first"] + k * a["step"] for k in range(a["count"])]


def average_busbw(t: dict, launch_us: float) -> float:
    """The model's 'Avg bus bandwidth' over the table's own sizes (nccl-tests averages busbw over its rows)."""
    sizes = average_sizes(t["avg_busbw"])
    return sum(n / predicted_us(t, n, launch_us)[0] / 1e3 * bus_factor("all_reduce", t["world"]) for n in sizes) / len(sizes)


def report(launch_us: float) -> str:
    lines, worst = [f"LAUNCH_US = {launch_us:g} us", ""], 0.0
    for t in tables():
        lines += [f"**{t['name']}** ({t['set']}): {t['hardware']}. Source: {t['source']}. "
                  f"Each row: `{command(t)}`.", "",
                  "| size (B) | published us | predicted us | algorithm/protocol | error | counts |",
                  "|---:|---:|---:|---|---:|---|"]
        for size, us in t["rows"]:
            got, how = predicted_us(t, size, launch_us)
            counts = size > MiB and t["set"] == "held out"
            if counts:
                worst = max(worst, abs(got / us - 1))
            lines.append(f"| {size} | {us:g} | {got:.2f} | {how} | {got / us - 1:+.1%} | "
                         f"{'target' if counts else ('fitted' if t['set'] == 'fit' else 'under 1 MB')} |")
        if "avg_busbw" in t:
            a = t["avg_busbw"]
            model = average_busbw(t, launch_us)
            steps = f"times {a['factor']}" if "factor" in a else f"in steps of {a['step']} B"
            lines += ["", f"Avg bus bandwidth over the table's {a['count']} sizes ({a['first']} B {steps}): "
                          f"published {a['value']:g} GB/s, predicted {model:.1f} GB/s ({model / a['value'] - 1:+.1%})."]
        lines.append("")
    lines.append(f"target: every held-out row above 1 MiB within {TARGET:.0%}: worst {worst:.1%}, "
                 f"{'met' if worst <= TARGET else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--fit", action="store_true", help="refit LAUNCH_US on the fitting table and use it")
    a = p.parse_args(argv)
    launch = fit() if a.fit else LAUNCH_US
    print(report(launch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
