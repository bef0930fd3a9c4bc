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
    and for the default), then the table. Per link: the buckets of the
    default and of auto's choice, and in brackets what the same rule picks
    on the link's *true* numbers; the step of both plans in the model (this
    machine's forward and backward, measured with no DDP, each plan replayed
    by the simulator on the link's alpha and bandwidth); and by the clock.
    The claims are checked in the model, which a busy machine cannot move:
    fewer buckets on the slow link than on the fast one. Auto measures for
    itself, so on a busy machine its probe can see a slower link than the
    one simulated, and choose otherwise; the clock also pays what the model
    leaves out (a real all-reduce and a thread hand-off per bucket), so it
    may disagree, and the table says where it does.

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

import time

import torch
import torch.distributed as dist

from _common import (REAL, FEATURES, add_link_option, is_exact, is_real, make_model, parse_args, print0, print_results, run,
                     train_and_compare)
from minddp import MiniDDP
from minddp.bucket_planner import DEFAULT_CAP_MB, BucketChoice, choose_plan
from minddp.bucket_assignment import FIRST_BUCKET_CAP_MB
from minddp.links import parse_rate
from minddp.network import Link, get_link
from minddp.simulate import ComputeProfile, DDPPolicy, Gradient, simulate_step
from minddp.simulated_link import SimulatedLink, simulated_allreduce_hook

LINKS = {
    "slow": Link("slow", alpha_s=20e-3, bandwidth_Bps=1e9, source="made up: high latency, plenty of bandwidth"),
    "fast": Link("fast", alpha_s=20e-6, bandwidth_Bps=100e6, source="made up: low latency, the bytes take time"),
}
WIDTH, DEPTH, PER_RANK = 256, 12, 256  # 12 layers of 256: 3.2 MB of gradients, a backward to hide behind
STEPS = 7  # 1 warm-up + 3 measured backwards, the choice, then 3 steps with the chosen buckets
ROUNDS = 6  # timed forward + backward passes per wrapper; the fastest counts
DEFAULT_PLAN = (DEFAULT_CAP_MB, FIRST_BUCKET_CAP_MB)  # torch's: 25 MB buckets, the first 1 MB
TIE = 0.03  # plans within 3% of each other in the model: the clock cannot tell them apart
# The simulated link waits on its own thread: the "wire" runs while backward computes.
OVERLAP = True


def wrap(link: Link, cap, real: bool = False):
    """MiniDDP with ``cap``, its buckets through a simulated ``link`` (``real``: plain Gloo on the real link)."""
    def make(model):
        ddp = MiniDDP(model, bucket_cap_mb=cap)
        if not real:
            ddp.register_comm_hook(SimulatedLink(link), simulated_allreduce_hook)
        return ddp

    return make


def measure_compute(rounds: int = ROUNDS) -> ComputeProfile:
    """This machine's forward and backward of the lesson's model with no DDP at all: when each
    gradient is ready, in ms after forward. Each figure the fastest of ``rounds`` (a busy machine
    only ever adds time), then the slowest rank's: the compute side of the model's step."""
    model = make_model(seed=0, width=WIDTH, depth=DEPTH)
    params = list(model.named_parameters())
    ready = [float("inf")] * len(params)
    clock = {}
    for i, (_, p) in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: clock.__setitem__(i, time.perf_counter()))
    x, forward = torch.randn(PER_RANK, FEATURES), float("inf")
    for _ in range(rounds):
        model.zero_grad()
        start = time.perf_counter()
        loss = model(x).sum()
        forward_done = time.perf_counter()
        loss.backward()
        forward = min(forward, forward_done - start)
        ready = [min(r, clock[i] - forward_done) for i, r in enumerate(ready)]
    worst = torch.tensor([forward] + ready) * 1e3
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    gradients = [Gradient(name, t, p.numel() * p.element_size()) for (name, p), t in zip(params, worst[1:].tolist())]
    return ComputeProfile(worst[0].item(), sorted(gradients, key=lambda g: g.ready_ms))


def model_ms(profile: ComputeProfile, link: Link, world_size: int, plan: tuple[float, float]) -> float:
    """Forward + backward + the wire, as the alpha-beta model replays ``profile`` with buckets ``plan``."""
    return simulate_step(profile, link, world_size, DDPPolicy(*plan, overlap=OVERLAP)).step_ms


def model_choices(profile: ComputeProfile, links: dict[str, Link], world_size: int) -> dict[str, BucketChoice]:
    """What the planner's model picks on each link's *true* numbers, for this backward."""
    return {name: choose_plan(profile, link, world_size, OVERLAP) for name, link in links.items()}


def clock_verdict(same_plan: bool, model: tuple[float, float], clock: tuple[float, float]) -> str:
    """Does the clock say what the model says about (default, auto)? Plans within ``TIE`` of each
    other in the model are a tie: the clock's noise is larger than that on any machine."""
    if same_plan:
        return "same buckets"
    (m_default, m_auto), (t_default, t_auto) = model, clock
    if abs(m_auto - m_default) <= TIE * m_default:
        return "a tie in the model"
    return "agrees" if (m_auto < m_default) == (t_auto < t_default) else "differs this time"


def step_ms(wrappers: list, rounds: int = ROUNDS) -> list[float]:
    """The clock: forward + backward (communication included) of each wrapper in turn, ``rounds``
    times, so that all meet the same load; per wrapper the fastest, slowest rank."""
    x = torch.randn(PER_RANK, FEATURES)
    times = [[] for _ in wrappers]
    for _ in range(rounds):
        for ddp, own in zip(wrappers, times):
            ddp.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            ddp(x).sum().backward()
            own.append(time.perf_counter() - start)
    t = torch.tensor([1e3 * min(own) for own in times])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main(rank: int, world_size: int, args) -> None:
    links = dict(LINKS)
    if is_real(args.link):  # the ranks stand in network namespaces joined by links shaped to this rate
        links[args.link] = Link(args.link, alpha_s=0.0, bandwidth_Bps=parse_rate(args.link[len(REAL):]) / 8,
                                source="a real link shaped by tc: its rate, no added latency")
    elif args.link != "none" and args.link not in links:
        links[args.link] = get_link(args.link)
    results, rows = [], []
    for name, link in links.items():
        print0(f"\n-- link {name}: alpha {link.alpha_s * 1e3:g} ms, {link.bandwidth_Bps / 1e6:g} MB/s")
        default, ddp_default = train_and_compare(f"{name}: default (25 MB, 1 MB first)", wrap(link, DEFAULT_PLAN[0], is_real(name)),
                                                 rank, world_size, width=WIDTH, depth=DEPTH, per_rank=PER_RANK,
                                                 steps=STEPS)
        auto, ddp_auto = train_and_compare(f"{name}: auto", wrap(link, "auto", is_real(name)), rank, world_size,
                                           width=WIDTH, depth=DEPTH, per_rank=PER_RANK, steps=STEPS)
        results += [default, auto]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, ddp_auto.bucket_names)
        assert all(b == everyone[0] for b in everyone), f"link {name}: ranks built different buckets: {everyone}"
        choice = [ddp_auto.bucket_planner.choice]  # rank 0's; the others rebuilt from its broadcast
        dist.broadcast_object_list(choice, src=0)
        assert choice[0].predicted_ms <= choice[0].default_ms, f"link {name}: the choice must not be predicted slower"
        rows.append((name, choice[0], *step_ms([ddp_default, ddp_auto])))

    profile = measure_compute()
    picks = model_choices(profile, links, world_size)
    print0()
    print_results(results)
    print0(f"\nthe model: this machine's forward ({profile.forward_ms:.1f} ms) and backward ({profile.backward_ms:.1f} ms)"
           f" with no DDP, fastest of {ROUNDS}, and each link's true alpha and bandwidth")
    titles = ["link", "buckets: default -> auto (model's pick)", "model: default", "auto", "clock: default", "auto",
              "the clock"]
    table = []
    for name, choice, t_default, t_auto in rows:
        plan = (choice.cap_mb, choice.first_cap_mb)
        m_default, m_auto = (model_ms(profile, links[name], world_size, p) for p in (DEFAULT_PLAN, plan))
        table.append([name, f"{choice.default_buckets} -> {choice.buckets} ({picks[name].buckets})",
                      f"{m_default:.1f} ms", f"{m_auto:.1f} ms", f"{t_default:.1f} ms", f"{t_auto:.1f} ms",
                      clock_verdict(plan == DEFAULT_PLAN, (m_default, m_auto), (t_default, t_auto))])
    widths = [max(len(c) for c in column) for column in zip(titles, *table)]
    for cells in [titles] + table:
        print0("  " + " | ".join(c.ljust(w) if i in (0, 6) else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))))
    print0("  auto: what MiniDDP chose from what it measured itself (its first steps, a probe of the link).")
    print0("  The model: the backward above and each link's true numbers, every plan replayed by the simulator;")
    print0(f"  the model's pick: auto's rule applied to these. The clock: the fastest of {ROUNDS} passes, default")
    print0("  and auto taking turns; it also pays what the model leaves out (per bucket a real Gloo all-reduce")
    print0("  and a thread hand-off under the simulated wire: milliseconds on a busy machine, so many buckets")
    print0("  can lose on the clock). With the same buckets, or plans within 3% in the model, the two clock")
    print0("  figures differ by noise alone.")

    assert all(is_exact(r) for r in results), "buckets change when gradients travel, never what they add up to"
    assert picks["slow"].buckets < picks["fast"].buckets, (
        f"the model asks for fewer buckets on the 20 ms link than on the fast one, got "
        f"{ {n: c.buckets for n, c in picks.items()} } for a {profile.backward_ms:.1f} ms backward")
    print0(f"\nchecked: every rank built rank 0's buckets; each choice is predicted no slower than the default;")
    print0(f"         for this backward the model picks fewer buckets on the slow link ({picks['slow'].buckets}) than")
    print0(f"         on the fast one ({picks['fast'].buckets}); every run matches one process on the whole batch.")


if __name__ == "__main__":
    args = parse_args(__doc__, min_world_size=2, extra=lambda p: add_link_option(p, default="none"))
    run(main, args.world_size, args, link=args.link)
