"""Lesson 17b: let the measured network choose the buckets (bucket_cap_mb="auto").

What you will learn
    Lesson 07 found the best bucket cap by sweeping; lesson 17 predicted
    step times from two numbers per link, alpha (seconds per message) and
    the bandwidth. Put together, a DDP wrapper can *choose* its buckets: no
    sweep, no fixed 25 MB. ``MiniDDP(model, bucket_cap_mb="auto")``:

    1. runs its first synchronized steps with torch's default buckets and
       records when each gradient is ready (its own hooks' clock);
    2. probes the link once: all-reduces of two sizes through the same path
       its buckets take, and fits alpha and the bandwidth
       (``minddp.network.fit_link``); and checks whether an all-reduce in
       flight slows its compute down (no core to spare: nothing overlaps);
    3. replays candidate bucket plans with the simulator of lesson 17
       (``minddp.simulate.simulate_step``) and keeps the fastest predicted;
    4. rank 0 decides and broadcasts, every rank rebuilds the same buckets,
       and rank 0 prints one line: what it chose, and the predicted step
       time of its choice against the default's.

    The answer follows the model. On a high-latency link every bucket costs
    its 2(p-1) alphas, more than it can hide: few buckets. On a fast link
    whose transfer takes longer than the backward that is left, buckets
    that leave early hide behind backward: several.

What to run
    python lessons/17b_auto_buckets.py [--world-size 2] [--link laptop]

What to look at
    The line MiniDDP prints for each link (chosen plan, predicted ms for it
    and for the default), then the table: buckets chosen on each link, and
    the measured step of the default and of the choice. The measured times
    are one run on your machine, not a claim: the choice is judged by the
    model, and checked below only for what bucketing must never change.

Try this
    1. Before running, predict the choice on the "slow" link (20 ms per
       message, 1 GB/s) for 3 MB of gradients: one bucket, or several?
    2. ``--link laptop`` (2 ms, 200 MB/s) adds a third link. Predict: closer
       to the slow link's choice or the fast one's? The 3 MB take 15 ms on
       the wire, each extra bucket 4 ms of latency.
    3. ``--link eth25`` (30 us, 3 GB/s): the transfer takes about 1 ms.
       Nothing is worth overlapping; does auto care how many buckets it
       keeps? (Look at the predicted ms of the choice and of the default.)
"""

import statistics
import time

import torch
import torch.distributed as dist

from _common import FEATURES, add_link_option, is_exact, parse_args, print0, print_results, run, train_and_compare
from minddp import MiniDDP
from minddp.network import Link, get_link
from minddp.simulated_link import SimulatedLink, simulated_allreduce_hook

LINKS = {
    "slow": Link("slow", alpha_s=20e-3, bandwidth_Bps=1e9, source="made up: high latency, plenty of bandwidth"),
    "fast": Link("fast", alpha_s=20e-6, bandwidth_Bps=100e6, source="made up: low latency, the bytes take time"),
}
WIDTH, DEPTH, PER_RANK = 256, 12, 256  # 12 layers of 256: 3.2 MB of gradients, a backward to hide behind
STEPS = 7  # 1 warm-up + 3 measured backwards, the choice, then 3 steps with the chosen buckets


def wrap(link: Link, cap):
    def make(model):
        ddp = MiniDDP(model, bucket_cap_mb=cap)
        ddp.register_comm_hook(SimulatedLink(link), simulated_allreduce_hook)
        return ddp

    return make


def step_ms(ddp, rounds: int = 5) -> float:
    """Median forward + backward (communication included) over ``rounds``, slowest rank."""
    x = torch.randn(PER_RANK, FEATURES)
    times = []
    for _ in range(rounds):
        ddp.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        ddp(x).sum().backward()
        times.append(time.perf_counter() - start)
    t = torch.tensor([1e3 * statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(rank: int, world_size: int, args) -> None:
    links = dict(LINKS)
    if args.link != "none" and args.link not in links:
        links[args.link] = get_link(args.link)
    results, rows = [], []
    for name, link in links.items():
        print0(f"\n-- link {name}: alpha {link.alpha_s * 1e3:g} ms, {link.bandwidth_Bps / 1e6:g} MB/s")
        default, ddp_default = train_and_compare(f"{name}: default (25 MB, 1 MB first)", wrap(link, 25.0), rank,
                                                 world_size, width=WIDTH, depth=DEPTH, per_rank=PER_RANK, steps=STEPS)
        auto, ddp_auto = train_and_compare(f"{name}: auto", wrap(link, "auto"), rank, world_size,
                                           width=WIDTH, depth=DEPTH, per_rank=PER_RANK, steps=STEPS)
        results += [default, auto]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, ddp_auto.bucket_names)
        assert all(b == everyone[0] for b in everyone), f"link {name}: ranks built different buckets: {everyone}"
        choice = ddp_auto.bucket_planner.choice  # rank 0's (the others took it from the broadcast)
        if rank == 0:
            assert choice.predicted_ms <= choice.default_ms, f"link {name}: the choice must not be predicted slower"
        rows.append((name, len(ddp_default.bucket_names), len(ddp_auto.bucket_names),
                     step_ms(ddp_default), step_ms(ddp_auto)))

    print0()
    print_results(results)
    print0("\n  link  | buckets: default -> auto | measured step: default | auto (median of 5, this machine)")
    for name, n_default, n_auto, t_default, t_auto in rows:
        print0(f"  {name:<5} | {n_default:>10} -> {n_auto:<11} | {t_default:>14.1f} ms | {t_auto:>6.1f} ms")

    assert all(is_exact(r) for r in results), "buckets change when gradients travel, never what they add up to"
    chosen = {name: n_auto for name, _, n_auto, _, _ in rows}
    assert chosen["slow"] < chosen["fast"], (
        f"the model asks for fewer buckets on the 20 ms link than on the fast one, got {chosen}")
    print0(f"\nchecked: every rank built rank 0's buckets; each choice is predicted no slower than the default;")
    print0(f"         fewer buckets on the slow link ({chosen['slow']}) than on the fast one ({chosen['fast']});")
    print0("         every run matches one process training on the whole batch (within float32 rounding).")


if __name__ == "__main__":
    args = parse_args(__doc__, min_world_size=2, extra=lambda p: add_link_option(p, default="none"))
    run(main, args.world_size, args)
