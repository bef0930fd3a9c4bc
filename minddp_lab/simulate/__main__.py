"""``python -m minddp_lab.simulate``: how would this step scale on your cluster?

    python -m minddp_lab.simulate --record mlp --out run.json        # a trace of a minddp model (world size 1)
    python -m minddp_lab.simulate --record my_module:build_model --step-ms 97 --network dgx1-v100 --world 8,16,64
    python -m minddp_lab.simulate --trace run.json --forward-ms 30 --backward-ms 62 \\
        --latency-us 14 --bandwidth 40GB/s --gpus-per-node 8 --nics-per-node 4 --intra-bandwidth 120GB/s
    python -m minddp_lab.simulate --trace run.json --fit-table all_reduce_perf.txt --step-ms 100

    python -m minddp_lab.simulate zero --model 7.5b --network dgx-h100      # DDP vs ZeRO stages 1, 2 and 3
    python -m minddp_lab.simulate collective all_reduce --bytes 8:1G --world 16 --network dgx-a100   # nccl-tests' columns
    python -m minddp_lab.simulate --list-networks                          # the presets: nominal, achieved, sources

The trace gives the step's shape (forward, when each gradient is ready,
sizes); ``--step-ms`` or ``--forward-ms``/``--backward-ms`` give its length
as you measured it on one GPU (``--compute-scale`` divides the traced CPU
times instead). Presets are at their achieved bandwidth (``--nominal``: the
line rate). The overheads the bare model misses are in the table's own
columns (``--overheads none``: leave them out). Prints one row per (bucket
cap, world size). ``--plot PATH`` (matplotlib) draws step time and
efficiency against world size, and (``PATH-timeline.png``) one simulated step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from minddp_lab.simulate.arguments import OneLineParser, at_least_zero, listed, one_line_errors, positive, whole
from minddp_lab.simulate.cluster import network_table
from minddp_lab.simulate.network_flags import add_network_flags, fit_residuals, model_of, network_figures, network_from  # noqa: F401
from minddp_lab.simulate.overheads import OVERHEAD_PRESETS, get_overheads
from minddp_lab.simulate.profile import load_profile
from minddp_lab.models import MODEL_NAMES
from minddp_lab.simulate.nccl import Cluster
from minddp_lab.simulate.record import load_builder, record_trace
from minddp_lab.simulate.replay import DDPPolicy, simulate_step
from minddp_lab.simulate.report import draw_scaling, draw_timeline, format_table, have_matplotlib, sweep

DEFAULT_OVERHEADS = "nccl-v100"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m minddp_lab.simulate", description=__doc__.strip().splitlines()[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="python -m minddp_lab.simulate zero --help: memory per rank and step time of DDP "
                             "against ZeRO stages 1, 2 and 3, for a model given by its size (no trace); "
                             "python -m minddp_lab.simulate --list-networks: the presets; "
                             "python -m minddp_lab.simulate collective --help: one collective in nccl-tests' columns")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Chrome trace of MiniDDP(..., trace=True), or a profile saved by save_profile")
    source.add_argument("--record", metavar="MODEL", help="first trace a model: a minddp_lab.models name, or "
                        "module:function / file.py:function returning (model, batch) or (model, batch, loss_fn)")
    p.add_argument("--out", default="run.json", help="where --record writes its trace (default %(default)s)")
    p.add_argument("--record-world", type=whole, default=1, help="ranks for --record (default %(default)s)")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="--record: MiniDDP(find_unused_parameters=True), for a model whose forward leaves parameters out")
    p.add_argument("--static-graph", action="store_true", help="--record: MiniDDP(static_graph=True)")
    t = p.add_argument_group("compute times (one of)")
    t.add_argument("--step-ms", type=positive, help="one step on one GPU without DDP, measured: the trace scaled to it")
    t.add_argument("--forward-ms", type=positive, help="forward, measured (with --backward-ms)")
    t.add_argument("--backward-ms", type=positive, help="backward, measured (with --forward-ms)")
    t.add_argument("--after-backward-ms", type=positive, help="optimizer step and the rest, measured (optional)")
    t.add_argument("--compute-scale", type=positive, help="divide the traced times by this (a device N x this CPU)")
    add_network_flags(p)
    d = p.add_argument_group("DDP")
    d.add_argument("--world", type=listed(whole), default=[8, 64, 512, 1024], help="world sizes, comma-separated")
    d.add_argument("--bucket-mb", type=listed(positive), default=[1, 5, 25, 100], help="bucket caps in MiB")
    d.add_argument("--algorithm", choices=["ring", "tree"], default="ring")
    d.add_argument("--compression", choices=["fp16", "bf16"], default=None)
    d.add_argument("--accumulation", type=whole, default=1, help="k: k-1 no_sync steps per synchronized one")
    d.add_argument("--shared-cores", action="store_true",
                   help="communication and compute share the cores (a CPU rank): no overlap")
    o = p.add_argument_group("overheads the bare model misses (each shown in its own column)")
    o.add_argument("--overheads", default=DEFAULT_OVERHEADS,
                   help=f"one of: {', '.join(OVERHEAD_PRESETS)} (default %(default)s)")
    o.add_argument("--per-step-ms", type=at_least_zero)
    o.add_argument("--per-gradient-us", type=at_least_zero)
    o.add_argument("--per-bucket-us", type=at_least_zero)
    o.add_argument("--contention-us-per-mb", type=at_least_zero, help="backward's time lost per MB sent beside it")
    o.add_argument("--compute-slowdown", type=at_least_zero, help="backward's slowdown once collectives are in "
                   "flight, a fraction (0.02: 2%%)")
    p.add_argument("--plot", metavar="PATH", help="PNG of step time and efficiency vs world size (matplotlib)")
    p.add_argument("--timeline-world", type=whole, default=None, help="world size of the timeline (default: largest)")
    p.add_argument("--timeline-cap", type=positive, default=None, help="bucket cap of the timeline (default: 25 or first)")
    return p.parse_args(argv)


def compute_from(args: argparse.Namespace, path: str):
    try:
        profile = load_profile(path)
    except OSError as e:
        raise ValueError(f"--trace: cannot read {path} ({e.strerror})") from None
    except json.JSONDecodeError:
        raise ValueError(f"--trace: {path} is not a JSON trace") from None
    except ValueError as e:
        raise ValueError(f"--trace {path}: {e}") from None
    if args.compute_scale is not None:
        if any(v is not None for v in (args.step_ms, args.forward_ms, args.backward_ms)):
            raise ValueError("--compute-scale or measured times (--step-ms, --forward-ms/--backward-ms), not both")
        return profile.scaled(args.compute_scale), f"traced times / {args.compute_scale:g}"
    given = [f"--{k.replace('_', '-')} {v:g}" for k, v in (("step_ms", args.step_ms), ("forward_ms", args.forward_ms),
             ("backward_ms", args.backward_ms), ("after_backward_ms", args.after_backward_ms)) if v is not None]
    try:
        scaled = profile.with_times(args.step_ms, args.forward_ms, args.backward_ms, args.after_backward_ms)
    except ValueError as e:
        raise ValueError(str(e).replace("step_ms", "--step-ms").replace("forward_ms", "--forward-ms")
                         .replace("backward_ms", "--backward-ms").replace("after_--backward-ms", "--after-backward-ms"))
    return scaled, ("the trace's shape at your " + ", ".join(given) if given else "traced times, unscaled")


def overheads_from(args: argparse.Namespace):
    base = get_overheads(args.overheads)
    mine = {k: v for k, v in (("per_step_ms", args.per_step_ms), ("per_gradient_us", args.per_gradient_us),
            ("per_bucket_us", args.per_bucket_us), ("contention_us_per_MB", args.contention_us_per_mb),
            ("compute_slowdown", args.compute_slowdown)) if v is not None}
    return replace(base, **mine, source=base.source + "; changed: " + ", ".join(mine)) if mine else base


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["zero"]:  # no trace needed: a model given by its size (minddp_lab.simulate.zero_report)
        from minddp_lab.simulate.zero_report import main as zero_main

        return zero_main(argv[1:])
    if argv[:1] == ["collective"]:  # one collective in nccl-tests' columns (minddp_lab.simulate.collective_report)
        from minddp_lab.simulate.collective_report import main as collective_main

        return collective_main(argv[1:])
    if argv[:1] == ["--list-networks"]:
        print(network_table())
        return 0
    return one_line_errors(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    network, overheads = network_from(args), overheads_from(args)
    if args.plot and not have_matplotlib():
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or the project's '.[plot]' extra)")
    for world in args.world:  # a world the network cannot hold is said before anything runs
        if isinstance(network, Cluster):
            network.shape(world)
    path = args.trace
    if args.record:
        if args.record not in MODEL_NAMES:
            load_builder(args.record)  # a wrong name is said before anything starts
        path = os.path.abspath(args.out)
        if not os.path.isdir(os.path.dirname(path)):
            raise ValueError(f"--out {args.out}: no folder {os.path.dirname(path)} to write the trace into")
        print(f"recording {args.record} on {args.record_world} rank(s) -> {path}", flush=True)
        record_trace(args.record, path, world_size=args.record_world,
                     find_unused_parameters=args.find_unused_parameters, static_graph=args.static_graph)
    profile, times = compute_from(args, path)
    policy = DDPPolicy(compression=args.compression, accumulation_steps=args.accumulation,
                       algorithm=args.algorithm, overlap=not args.shared_cores, overheads=overheads)
    print(f"compute: forward {profile.forward_ms:.2f} ms, backward {profile.backward_ms:.2f} ms, "
          f"after backward {profile.after_backward_ms:.2f} ms ({times}); {len(profile.gradients)} gradients, "
          f"{profile.gradient_bytes / 2**20:.2f} MiB (from {path})")
    print(f"network: {network.name}: {network.source}; {model_of(network)}")
    if args.fit_table:
        print(fit_residuals(args.fit_table, args.fit_world))
    print(f"overheads: {overheads.describe()}")
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
