"""``python -m minddp.simulate``: how would this step scale?

    python -m minddp.simulate --record mlp --out run.json        # take a trace (world size 1)
    python -m minddp.simulate --trace run.json --network ib400 \\
        --world 8,64,512,1024 --bucket-mb 1,5,25,100 --plot scaling.png
    python -m minddp.simulate --trace run.json --network dgx-h100 --compression fp16 --compute-scale 20

    python -m minddp.simulate zero --model 7.5b --network dgx-h100      # DDP vs ZeRO stages 1, 2 and 3

Prints one row per (bucket cap, world size). With ``--plot PATH`` (needs
matplotlib) it draws step time and scaling efficiency against world size,
and beside it (``PATH-timeline.png``) the simulated step at
``--timeline-world`` ranks with ``--timeline-cap`` MB buckets.
"""

from __future__ import annotations

import argparse
import os
import sys

from dataclasses import replace

from minddp.network import HIERARCHIES, PRESETS, get_network
from minddp.simulate.profile import load_profile
from minddp.simulate.record import record_trace
from minddp.simulate.replay import DDPPolicy, simulate_step
from minddp.simulate.report import draw_scaling, draw_timeline, format_table, have_matplotlib, sweep


def _numbers(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minddp.simulate", description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="python -m minddp.simulate zero --help: memory per rank and step time of DDP "
                                       "against ZeRO stages 1, 2 and 3, for a model given by its size (no trace)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Chrome trace written by MiniDDP(..., trace=True)")
    source.add_argument("--record", metavar="MODEL", help="first record a trace of this minddp.models model")
    p.add_argument("--out", default="run.json", help="where --record writes its trace (default %(default)s)")
    p.add_argument("--record-world", type=int, default=1, help="ranks for --record (default %(default)s)")
    names = ", ".join([*PRESETS, *HIERARCHIES])
    p.add_argument("--network", default="ib400", help=f"one of: {names} (default %(default)s)")
    p.add_argument("--world", type=_numbers(int), default=[8, 64, 512, 1024], help="world sizes, comma-separated")
    p.add_argument("--bucket-mb", type=_numbers(float), default=[1, 5, 25, 100], help="bucket caps in MiB")
    p.add_argument("--algorithm", choices=["ring", "tree"], default="ring")
    p.add_argument("--compression", choices=["fp16", "bf16"], default=None)
    p.add_argument("--accumulation", type=int, default=1, help="k: k-1 no_sync steps per synchronized one")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="divide the trace's compute times by this (e.g. a GPU N times faster than the traced CPU)")
    p.add_argument("--shared-cores", action="store_true",
                   help="communication and compute share the cores (a CPU rank): no overlap")
    p.add_argument("--plot", metavar="PATH", help="PNG of step time and efficiency vs world size (matplotlib)")
    p.add_argument("--timeline-world", type=int, default=None, help="world size of the timeline (default: largest)")
    p.add_argument("--timeline-cap", type=float, default=None, help="bucket cap of the timeline (default: 25 or first)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["zero"]:  # no trace needed: a model given by its size (minddp.simulate.zero_report)
        from minddp.simulate.zero_report import main as zero_main

        return zero_main(argv[1:])
    args = parse_args(argv)
    try:
        network = get_network(args.network)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot and not have_matplotlib():
        print("error: --plot needs matplotlib: pip install matplotlib (or the project's '.[plot]' extra)",
              file=sys.stderr)
        return 2
    path = args.trace
    if args.record:
        path = os.path.abspath(args.out)
        print(f"recording {args.record} on {args.record_world} rank(s) -> {path}", flush=True)
        record_trace(args.record, path, world_size=args.record_world)
    profile = load_profile(path).scaled(args.compute_scale)
    policy = DDPPolicy(compression=args.compression, accumulation_steps=args.accumulation,
                       algorithm=args.algorithm, overlap=not args.shared_cores)
    print(f"profile: forward {profile.forward_ms:.2f} ms, backward {profile.backward_ms:.2f} ms, "
          f"after backward {profile.after_backward_ms:.2f} ms, {len(profile.gradients)} gradients, "
          f"{profile.gradient_bytes / 2**20:.2f} MiB (from {path}, compute / {args.compute_scale:g})")
    print(f"network: {network.name}: {network.source}")
    rows = sweep(profile, network, args.world, args.bucket_mb, policy)
    print(format_table(rows))
    if args.plot:
        draw_scaling(rows, args.plot, f"{os.path.basename(path)} on {network.name}")
        world = args.timeline_world or max(args.world)
        cap = args.timeline_cap or (25.0 if 25.0 in args.bucket_mb else args.bucket_mb[0])
        step = simulate_step(profile, network, world, replace(policy, bucket_cap_mb=cap))
        timeline = os.path.splitext(args.plot)[0] + "-timeline.png"
        draw_timeline(step, timeline, f"{os.path.basename(path)} on {network.name}, {cap:g} MB buckets")
        print(f"wrote {args.plot} and {timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
