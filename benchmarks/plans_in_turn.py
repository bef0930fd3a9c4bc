"""MiniDDP at fixed bucket plans, timed in turn on one model as ``bucket_cap_mb="auto"``'s trials time them, for many rounds.

    python benchmarks/plans_in_turn.py --model mlp --link 10gbit --rounds 64

``auto`` times its proposals for ``TRIAL_ROUNDS`` (16) rounds of short blocks
(:class:`minddp_lab.auto.trials.PlanTrials`) and keeps the fastest. Here
the same schedule, ``PlanTrials`` itself, runs the given plans for many
rounds on one model per process, as a user's script runs it (in
``auto_vs_caps.py`` five wrappers take turns): each plan's ratio to the
default over every round, and how far the windows of rounds that ``auto``
decides on (``TRIAL_ROUNDS``) stray from it. Rank 0's times, as in ``auto``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from minddp import MiniDDP
from minddp.ddp.bucket_assignment import MiB
from minddp.launch import spawn
from minddp_lab.auto.trials import TRIAL_ROUNDS, PlanTrials

from benchlib.timing import Runner
from benchlib.wrappers import DEFAULT_CAP_MB

WARMUP = 6  # steps before the first round: the bucket order learned, the buffers touched


def _measure(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    runner = Runner(cfg, cfg["model"], DEFAULT_CAP_MB, rank, world_size, torch.device("cpu"))
    ddp = MiniDDP(runner.fresh(), buffer_sync="with_gradients")  # as auto_vs_caps.py's auto
    step = runner.stepper(ddp)
    for _ in range(WARMUP):
        step()
    order, plans = ddp.reducer.bucket_order, [tuple(plan) for plan in cfg["plans"]]
    trials, buckets = PlanTrials(plans, rounds=cfg["rounds"]), {}
    ddp.reducer.rebuild(order, int(plans[0][0] * MiB), int(plans[0][1] * MiB))  # (a block's first step: untimed)
    while not trials.done:
        plan, start = trials.current, time.perf_counter()
        step()
        buckets[str(plan)] = len(ddp.reducer.buckets)
        rebuild = trials.step_done((time.perf_counter() - start) * 1e3)
        if rebuild is not None:
            ddp.reducer.rebuild(order, int(rebuild[0] * MiB), int(rebuild[1] * MiB))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"blocks": {str(plan): blocks for plan, blocks in trials.blocks.items()}, "buckets": buckets}, f)


def round_ratios(blocks: dict[str, list[list[float]]], plan: str, default: str) -> list[float]:
    """``plan``'s block against the default's in each round (their mean steps), as ``PlanTrials`` sets them."""
    return [statistics.mean(b) / statistics.mean(d) for b, d in zip(blocks[plan], blocks[default])]


def window_medians(ratios: list[float], window: int = TRIAL_ROUNDS) -> list[float]:
    """The median ratio of each run of ``window`` consecutive rounds: what one ``auto`` decision would read."""
    return [statistics.median(ratios[i:i + window]) for i in range(0, len(ratios) - window + 1, window)]


def report(measured: dict, plans: list[str]) -> str:
    blocks, default = measured["blocks"], plans[0]
    lines = ["| plan (cap MB, first MB) | buckets | ms per step, median | against the default, every round | "
             f"against the default, each {TRIAL_ROUNDS} rounds |", "|---|---|---|---|---|"]
    for plan in plans:
        ratios = round_ratios(blocks, plan, default)
        windows = ", ".join(f"{w:.3f}" for w in window_medians(ratios))
        ms = statistics.median(t for block in blocks[plan] for t in block)
        lines.append(f"| {plan} | {measured['buckets'][plan]} | {ms:.1f} | {statistics.median(ratios):.3f} | {windows} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--link", default="loopback", help="loopback, or a rate such as 10gbit (root; minddp_lab/links/namespaces.py)")
    parser.add_argument("--plans", default="25:1,16:16,4:4,5:1,1:1",
                        help="cap:first-bucket cap in MB, comma-separated, torch's default first (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=64)
    args = parser.parse_args()
    plans = [tuple(float(x) for x in plan.split(":")) for plan in args.plans.split(",")]
    cfg = {"model": args.model, "plans": plans, "rounds": args.rounds, "comm_hook": "none", "backend": "gloo"}
    with tempfile.TemporaryDirectory(prefix="minddp-plans-in-turn-") as tmp:
        out_path = os.path.join(tmp, "run.json")
        spawn(_measure, 2, cfg, out_path, link=None if args.link == "loopback" else args.link)
        with open(out_path) as f:
            measured = json.load(f)
    print(f"{args.model}, 2 ranks, {args.link}, {args.rounds} rounds ({' '.join(['python', *sys.argv])})")
    print(report(measured, [str(plan) for plan in plans]))


if __name__ == "__main__":
    main()
