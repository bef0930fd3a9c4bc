"""Lesson 17b: let the measured network choose the buckets (minddp_lab.auto.plan_buckets).

What you will learn
    Lesson 07 found the best bucket cap by sweeping; lesson 17 predicted
    step times from two numbers per link, alpha (seconds per message) and
    the bandwidth. Put together, a DDP wrapper can *choose* its buckets: no
    sweep, no fixed 25 MB. ``plan_buckets(MiniDDP(model))`` (the lab's
    planner, :mod:`minddp_lab.auto`, attached to a MiniDDP built as usual):

    1. runs its first synchronized steps with torch's default buckets and
       records when each gradient is ready (its own hooks' clock);
    2. probes the link once: all-reduces of two sizes through the same path
       its buckets take, and fits alpha and the bandwidth
       (``minddp_lab.network.fit_link``); it also measures two costs that grow
       with the number of buckets: its own work per bucket (filling it,
       launching its all-reduce, on the thread that runs backward) and the
       CPU an all-reduce takes from backward when no core is spare for it
       (``minddp_lab.auto.costs``);
    3. replays candidate bucket plans with the simulator of lesson 17
       (``minddp_lab.simulate.simulate_step``) and proposes the default, the
       best plan with fewer buckets, the best with more and one halfway
       between the default and that best, leaving out a plan predicted
       slower than the default by more than the model's own error on the
       default's measured step;
    4. times its proposals in turn on the next steps (a block of steps
       each, a few rounds), each against the default in the same round,
       and keeps the fastest if it is more than 1% faster: the model
       proposes, the clock decides (``minddp_lab.auto.trials``);
    5. rank 0 decides and broadcasts, every rank rebuilds the same buckets,
       and rank 0 prints one line: what it kept, its predicted step
       against the default's, and the steps it timed.

    The answer follows the model. On a high-latency link every bucket costs
    its 2(p-1) alphas, more than it can hide: few buckets. On a low-latency
    link whose transfer takes longer than the backward that is left,
    buckets that leave early hide behind backward: several.

What to run
    python lessons/17b_auto_buckets.py [--world-size 2] [--link laptop]

What to look at
    Part 1, the lesson's answer: the planner of step 3 (``choose_plan``)
    given each link's true alpha and bandwidth and a stated backward
    (this model's gradients, ready evenly over 8 ms, about what one laptop
    core takes for it): the buckets it picks and their predicted step
    against the default's. Nothing in part 1 is measured, so it prints the
    same on every machine and every run.

    Part 2: ``plan_buckets(MiniDDP(model))`` itself, on the same links. It
    measures its own inputs (its backward, the time between backwards, the
    link by a probe), so its line can differ from part 1 and from one run to
    the next: the table puts its measurements beside part 1's, and checks
    that its prediction is the same model applied to them (its costs
    included). Then the test
    bench: default (25 MB buckets, the first 1 MB) and auto both train
    exactly as one process would.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Before running, predict part 1's choice on the high-latency link
       (20 ms per message, 1 GB/s) for 3 MB of gradients: one bucket, or
       several?
    2. ``--link laptop`` (2 ms, 200 MB/s) adds a third link. Predict part
       1's choice: closer to the high-latency link's or the low-bandwidth
       one's? The 3 MB take 15 ms on the wire, each extra bucket 4 ms of
       latency, and backward lasts 8 ms.
    3. ``--link eth25`` (30 us, 3 GB/s): the transfer takes about 1 ms.
       Nothing is worth overlapping; does the planner care how many buckets
       it keeps?
"""

import math

import torch.distributed as dist

from _common import REAL, add_link_option, is_exact, is_real, parse_args, print0, print_results, run, train_and_compare
from minddp import MiniDDP
from minddp_lab.auto import plan_buckets, planner_of
from minddp_lab.auto.policy import SETTLING_BACKWARDS
from minddp_lab.auto.planner import BucketChoice, choose_plan, replay
from minddp_lab.auto.trials import MIN_MEASURED_GAIN
from minddp_lab.links.namespaces import parse_rate
from minddp_lab.network import Link, get_link
from minddp_lab.simulate import ComputeProfile, Gradient
from minddp_lab.simulated_link import SimulatedLink, simulated_allreduce_hook

LINKS = {
    "high-latency": Link("high-latency", alpha_s=20e-3, bandwidth_Bps=1e9,
                         source="made up: 20 ms per message, plenty of bandwidth"),
    "low-bandwidth": Link("low-bandwidth", alpha_s=20e-6, bandwidth_Bps=300e6,
                          source="made up: 20 us per message, the bytes take time"),
}
WIDTH, DEPTH, PER_RANK = 256, 12, 256  # 12 layers of 256: 2.9 MB of gradients, a backward to hide behind
FEATURES, CLASSES = 20, 4  # the bench's (lessons/_common.py)
STATED_BACKWARD_MS = 8.0  # part 1's backward: about what one laptop core takes for this model and 256 samples
STEPS = SETTLING_BACKWARDS + 2  # the first, the measured backwards, the trials, then two with the kept buckets
LR = 0.01  # over this many steps a larger rate lets float32's rounding grow past is_exact's 1e-5, with any buckets


def stated_profile(backward_ms: float = STATED_BACKWARD_MS) -> ComputeProfile:
    """The lesson's model (20 -> 12 x 256 -> 4) as the planner sees it: its 26 gradients, last
    layer first (bias, then weight), ready evenly over ``backward_ms``, after a forward half as long."""
    shapes = [(CLASSES,), (CLASSES, WIDTH)]
    for _ in range(DEPTH - 1):
        shapes += [(WIDTH,), (WIDTH, WIDTH)]
    shapes += [(WIDTH,), (WIDTH, FEATURES)]
    sizes = [4 * math.prod(shape) for shape in shapes]
    return ComputeProfile(backward_ms / 2, [Gradient(f"g{i}", backward_ms * (i + 1) / len(sizes), n)
                                            for i, n in enumerate(sizes)])


def wrap(link: Link, real: bool = False, planned: bool = False):
    """MiniDDP at the default cap, its buckets through a simulated ``link`` (``real``: plain Gloo on the real
    link); ``planned``: with the planner attached, to choose its buckets in its first steps."""
    def make(model):
        ddp = MiniDDP(model)
        if not real:
            ddp.register_comm_hook(SimulatedLink(link), simulated_allreduce_hook)
        if planned:
            plan_buckets(ddp)
        return ddp

    return make


def model_choices(profile: ComputeProfile, links: dict[str, Link], world_size: int) -> dict[str, BucketChoice]:
    """What the planner picks on each link's *true* numbers, for this compute (no costs beyond the wire)."""
    return {name: choose_plan(profile, link, world_size) for name, link in links.items()}


def show_part_1(links: dict[str, Link], world_size: int) -> dict[str, BucketChoice]:
    profile = stated_profile()
    picks = model_choices(profile, links, world_size)
    print0(f"part 1: the planner, given each link's true numbers and a stated compute ({profile.gradient_bytes / 1e6:.1f} MB "
           f"of gradients ready evenly over a {profile.backward_ms:g} ms backward, after a {profile.forward_ms:g} ms "
           f"forward), {world_size} ranks:")
    print0(f"  {'link':<14} {'alpha':>8} {'MB/s':>6} | {'buckets: default -> pick':>24} | {'predicted: default':>18} {'pick':>9}")
    for name, pick in picks.items():
        link = links[name]
        print0(f"  {name:<14} {link.alpha_s * 1e3:>5.2f} ms {link.bandwidth_Bps / 1e6:>6g} | "
               f"{pick.default_buckets:>19} -> {pick.buckets:<2} | {pick.default_ms:>15.1f} ms {pick.predicted_ms:>6.1f} ms")
    return picks


def timed(choice: BucketChoice) -> str:
    """How many plans MiniDDP timed, and the kept one's step against the default's ('-': only the default)."""
    kept = [t for t in choice.trials if t.plan == (choice.cap_mb, choice.first_cap_mb)]
    return f"{len(choice.trials)}, {kept[0].ratio:.3f}" if kept else "-"


def main(rank: int, world_size: int, args) -> None:
    links = dict(LINKS)
    if is_real(args.link):  # the ranks stand in network namespaces joined by links shaped to this rate
        links[args.link] = Link(args.link, alpha_s=0.0, bandwidth_Bps=parse_rate(args.link[len(REAL):]) / 8,
                                source="a real link shaped by tc: its rate, no added latency")
    elif args.link != "none" and args.link not in links:
        links[args.link] = get_link(args.link)
    picks = show_part_1(links, world_size)

    print0("\npart 2: plan_buckets(MiniDDP(model)) on the same links, measuring for itself:")
    results, rows = [], []
    for name, link in links.items():
        default = train_and_compare(f"{name}: default", wrap(link, is_real(name)),
                                    rank, world_size, width=WIDTH, depth=DEPTH, per_rank=PER_RANK, lr=LR)[0]  # 3 steps
        auto, ddp_auto = train_and_compare(f"{name}: auto", wrap(link, is_real(name), planned=True), rank, world_size,
                                           width=WIDTH, depth=DEPTH, per_rank=PER_RANK, steps=STEPS, lr=LR)
        results += [default, auto]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, ddp_auto.bucket_names)
        assert all(b == everyone[0] for b in everyone), f"link {name}: ranks built different buckets: {everyone}"
        planner = planner_of(ddp_auto)
        decided = [(planner.choice, planner.profile() if rank == 0 else None)]  # rank 0 decides; the others rebuilt
        dist.broadcast_object_list(decided, src=0)
        rows.append((name, *decided[0]))

    print0(f"\n  {'link':<14} | {'buckets':>7} | {'its backward':>12} {'outside it':>10} | {'probed: alpha':>13} {'MB/s':>6} | "
           f"{'per bucket':>10} {'CPU/MB':>8} {'per step':>8} | {'its prediction':>14} | {'on the true link':>16} | "
           f"{'timed: plans, kept':>18}")
    for name, choice, measured in rows:
        plan = (choice.cap_mb, choice.first_cap_mb)
        replayed = replay(measured, choice.link, world_size, plan, choice.costs)
        assert abs(replayed - choice.predicted_ms) < 1e-6, (
            f"link {name}: MiniDDP's prediction is the model on its own measurements: {choice.predicted_ms:.3f} ms "
            f"printed, {replayed:.3f} ms replayed")
        assert plan in choice.contenders, f"link {name}: the plan kept was not proposed: {choice.describe()}"
        if choice.trials:  # the clock decided: the lowest ratio to the default, if low enough, else the default
            best = min(choice.trials, key=lambda trial: trial.ratio)
            expected = best.plan if best.ratio < 1 - MIN_MEASURED_GAIN else choice.contenders[0]
            assert plan == expected, f"link {name}: the plan kept is not the fastest timed: {choice.describe()}"
        assert choice.costs.per_bucket_us > 0, f"link {name}: MiniDDP's own work per bucket was not measured"
        on_true = replay(measured, links[name], world_size, plan, choice.costs)
        print0(f"  {name:<14} | {choice.buckets:>7} | {measured.backward_ms:>9.1f} ms {measured.forward_ms:>7.1f} ms | "
               f"{choice.link.alpha_s * 1e3:>10.3f} ms {choice.link.bandwidth_Bps / 1e6:>6.0f} | "
               f"{choice.costs.per_bucket_us:>7.0f} us {choice.costs.contention_us_per_MB:>5.0f} us "
               f"{choice.costs.per_step_ms:>5.1f} ms | "
               f"{choice.predicted_ms:>11.1f} ms | {on_true:>13.1f} ms | {timed(choice):>18}")
    print0("  (its backward, and the time outside it -- the optimizer step and the next forward -- are the medians")
    print0("   MiniDDP measured in its first steps, and the probe its fit of the link; per bucket: its own fill and")
    print0("   launch of a bucket, measured then too; CPU/MB: backward's CPU an all-reduce beside it takes per MB")
    print0("   sent, from the probe (0 with a core to spare); per step: how much longer its measured steps, with the")
    print0("   default's buckets, took than the model of them, added to every plan. Its prediction replays its plan")
    print0("   on all of these. Timed: how many plans it proposed and timed in turn, and the kept plan's median step")
    print0("   against the default's in the same rounds (1.000: the default stayed).")
    print0("   It differs from part 1 exactly where these differ from part 1's stated compute and")
    print0("   the true links, which a busy machine moves from run to run: part 1 is the lesson's answer.)")
    print0()
    print_results(results)

    assert all(is_exact(r) for r in results), "buckets change when gradients travel, never what they add up to"
    assert picks["high-latency"].buckets < picks["low-bandwidth"].buckets, (
        f"the planner asks for fewer buckets on the 20 ms link than on the 20 us one, got "
        f"{ {n: c.buckets for n, c in picks.items()} }")
    assert all(c.predicted_ms <= c.default_ms for c in picks.values()), "the planner's pick is never predicted slower"
    print0(f"\nchecked: part 1's planner picks fewer buckets on the high-latency link ({picks['high-latency'].buckets}) than")
    print0(f"         on the low-bandwidth one ({picks['low-bandwidth'].buckets}), none predicted slower than the default;")
    print0("         in part 2 every rank built rank 0's buckets, each prediction MiniDDP printed is the")
    print0("         model replayed on its own measurements, each plan kept the fastest it timed; every run")
    print0("         matches one process on the whole batch.")


if __name__ == "__main__":
    args = parse_args(__doc__, min_world_size=2, extra=lambda p: add_link_option(p, default="none"))
    run(main, args.world_size, args, link=args.link)
