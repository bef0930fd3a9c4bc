"""Lesson 22: when fully sharded pays -- 1.5x DDP's bytes, hidden by prefetching (or not).

What you will learn
    Lesson 21's stage 3 saves memory, but every step it all-gathers each
    unit twice (forward, and again in backward, since forward freed it) and
    reduce-scatters its gradient once: three half all-reduces against DDP's
    one all-reduce (two halves), **1.5x DDP's bytes on the wire** (a little
    less: the root, around the blocks, and the last block, whose backward
    comes first, stay gathered from forward into backward and are gathered
    once). Whether that costs time depends on whether the wire is busy while
    compute waits.

    **Prefetch** is what keeps compute from waiting: the next unit's
    all-gather is launched as soon as this unit starts computing, so it
    travels while this unit computes. Without it each unit gathers only when
    it is about to run, and compute stands still for every gather; in
    backward the gather even queues behind the reduce-scatter just launched
    (one process group runs its collectives one at a time).

    All collectives go through lesson 06's simulated link
    (``minddp_lab.simulated_link``, now with all-gather and reduce-scatter, each
    ``(p-1) alpha + (p-1)/p * bytes / bandwidth``), so a laptop shows what a
    slow network would: ``minddp.fsdp`` (prefetch on and off) and
    ``MiniDDP`` run on it and the messages are counted. Claims about time
    are decided in the link model's time: this machine's compute, each unit
    timed alone, replayed with the model's wire by
    ``minddp_lab.simulate.stage3`` (DDP's by ``minddp_lab.simulate.simulate_step``).
    Part 2 shows the clock beside the model, labelled: it is not checked,
    since a busy machine stretches the clock, not the model.

What to run
    python lessons/22_when_fsdp_pays.py [--link eth25] [--keep-after-forward] [--world-size 3] [--batch 64]
    One rank sends nothing to compare: ``--world-size 1`` stops with one line saying so.

What to look at
    Part 1: the messages of one step and the bytes each rank sent, FSDP
    against DDP. Part 2: one step with prefetch on and off in model time
    (and, for comparison only, by the clock), and where compute waited. Part 3: the same model on
    slow and fast links: when FSDP costs time against DDP, and when nothing.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. ``--link eth25`` (25 Gb/s Ethernet): predict prefetch's saving and
       FSDP's step against DDP's.
    2. ``--keep-after-forward`` (``reshard_after_forward=False``): predict
       the bytes against DDP's.
    3. ``--world-size 3``: predict the ratio of bytes.
    4. ``--batch 64``: a sixteenth of the compute per unit, the same bytes.
       Predict prefetch's saving and FSDP against DDP.
"""

import time

import torch
import torch.distributed as dist
from torch import nn

from _common import parse_args, print0, run  # imports minddp_lab.simulated_link: it binds the real collectives
from minddp_lab.network import PRESETS, bytes_sent_per_rank
from minddp_lab.simulate import ComputeProfile, DDPPolicy, Gradient, simulate_step
from minddp_lab.simulate.stage3 import Stage3Policy, Unit, simulate_stage3, working_set_bytes
from minddp_lab.simulated_link import SimulatedLink, simulated_allreduce_hook


class ThroughTheLink:
    """torch.distributed's all-gather and reduce-scatter, sent through ``self.link`` while one is set."""

    def __init__(self):
        self.link: SimulatedLink | None = None
        for kind, names in (("all_gather", ("all_gather_single", "all_gather_into_tensor")),
                            ("reduce_scatter", ("reduce_scatter_single", "reduce_scatter_tensor"))):
            for name in names:
                if hasattr(dist, name):
                    setattr(dist, name, self._wrap(kind, getattr(dist, name)))

    def _wrap(self, kind, original):
        def collective(output, input, group=None, async_op=False, **kwargs):
            if self.link is None:
                return original(output, input, group=group, async_op=async_op, **kwargs)
            future = getattr(self.link, kind)(output, input)  # a Future waits like a Work
            if async_op:
                return future
            future.wait()
            return None
        return collective


# Installed before minddp.fsdp is imported: it binds the collectives it calls when imported.
WIRE = ThroughTheLink()

from minddp import MiniDDP  # noqa: E402
from minddp.fsdp import fully_shard  # noqa: E402

WIDTH, DEPTH, STEPS = 256, 6, 4


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)],
                         nn.Linear(WIDTH, 1))


def unit_compute(batch: int) -> list[Unit]:
    """Each block's forward and backward, timed alone on this rank (no communication): the best of 5."""
    units = []
    for i, block in enumerate(make_model()[:-1]):
        x = torch.randn(batch, WIDTH, requires_grad=True)
        forward, backward = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            out = block(x)
            t1 = time.perf_counter()
            out.sum().backward()
            forward.append(t1 - t0), backward.append(time.perf_counter() - t1)
        nbytes = 4 * sum(p.numel() for p in block.parameters())
        units.append(Unit(f"block {i}", nbytes, nbytes, 1e3 * min(forward), 1e3 * min(backward)))
    return units


def modelled(units: list[Unit], link, world_size: int, reshard: bool) -> dict:
    """Step times in the link model's time: FSDP with and without prefetch, and DDP (one bucket per block)."""
    fsdp = {p: simulate_stage3(units, link, world_size, policy=Stage3Policy(prefetch=p, reshard_after_forward=reshard))
            for p in (True, False)}
    ready, gradients = 0.0, []
    for u in reversed(units):  # backward: the last block's gradient first
        ready += u.backward_ms
        gradients.append(Gradient(u.name, ready, u.grad_bytes))
    profile = ComputeProfile(sum(u.forward_ms for u in units), gradients)
    ddp = simulate_step(profile, link, world_size, DDPPolicy(bucket_cap_mb=0.25, first_bucket_cap_mb=0.25))
    return {"prefetch": fsdp[True], "no prefetch": fsdp[False], "ddp": ddp}


def train_steps(model, link: SimulatedLink, batch: int, rank: int, steps: int) -> list[float]:
    """``steps`` SGD steps, every message through ``link``; the clock of each step (slowest rank)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(batch, WIDTH, generator=g), torch.randn(batch, 1, generator=g)
        dist.barrier()
        WIRE.link, t0 = link, time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        opt.step()
        WIRE.link = None
        took = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(1e3 * took.item())
    return times


def sharded(args) -> nn.Module:
    model = make_model()
    for block in model[:-1]:
        fully_shard(block, reshard_after_forward=not args.keep_after_forward)
    return fully_shard(model)


def sent(messages, world_size: int) -> float:
    return sum(bytes_sent_per_rank(m.kind, m.nbytes, world_size) for m in messages)


def main(rank: int, world_size: int, args) -> None:
    # Part 1: the messages of one step, FSDP against DDP, counted on the link.
    fsdp, ddp = sharded(args), MiniDDP(make_model())
    fsdp_link, ddp_link = SimulatedLink(args.link), SimulatedLink(args.link)
    ddp.register_comm_hook(ddp_link, simulated_allreduce_hook)
    train_steps(fsdp, fsdp_link, args.batch, rank, 1)  # the first step records the order prefetch follows
    train_steps(ddp, ddp_link, args.batch, rank, 1)
    fsdp_link.messages.clear(), ddp_link.messages.clear()
    train_steps(fsdp, fsdp_link, args.batch, rank, 1)  # the step whose messages are counted
    train_steps(ddp, ddp_link, args.batch, rank, 1)
    kinds = {k: sum(m.kind == k for m in fsdp_link.messages) for k in ("all_gather", "reduce_scatter")}
    fsdp_bytes, ddp_bytes = sent(fsdp_link.messages, world_size), sent(ddp_link.messages, world_size)
    psi = sum(p.numel() for p in make_model().parameters())
    print0(f"part 1: {DEPTH} blocks of {WIDTH} x {WIDTH} + a head, {psi:,} parameters, {world_size} ranks, "
           f"link {args.link}; one step:")
    print0(f"  minddp.fsdp: {kinds['all_gather']} all-gathers, {kinds['reduce_scatter']} reduce-scatters, "
           f"{fsdp_bytes / 1024:.1f} KiB sent per rank")
    print0(f"  MiniDDP:     {len(ddp_link.messages)} all-reduce(s), {ddp_bytes / 1024:.1f} KiB sent per rank: "
           f"FSDP sends {fsdp_bytes / ddp_bytes:.2f}x")
    # 1.5x DDP's bytes, less the second gather of the root (the head) and of
    # the last block: both stay gathered from forward into backward.
    block = bytes_sent_per_rank("all_gather", 4 * WIDTH * (WIDTH + 1), world_size)
    expected = ddp_bytes if args.keep_after_forward else 1.5 * ddp_bytes - block
    padding = 3 * 4 * world_size * (DEPTH + 1)  # each unit padded to N pieces: under N elements, 3 collectives
    assert abs(fsdp_bytes - expected) <= padding + 4 * (WIDTH + 1) * 2, (
        f"FSDP sends 1.5x DDP's bytes less the root's and the last block's second gathers: "
        f"{fsdp_bytes:.0f} against {expected:.0f}")

    # Part 2: prefetch on and off, by the clock and in the link model's time.
    clocks = {}
    for prefetch in (True, False, True, False):
        fsdp.set_prefetch(prefetch)  # minddp.fsdp's switch (FSDP2 has none: it always prefetches)
        clocks.setdefault(prefetch, []).extend(train_steps(fsdp, fsdp_link, args.batch, rank, 2))
    fsdp.set_prefetch(True)
    units = unit_compute(args.batch)
    link = PRESETS[args.link]
    model = modelled(units, link, world_size, not args.keep_after_forward)
    on, off = model["prefetch"], model["no prefetch"]
    print0(f"\npart 2: minddp.fsdp, one step, ms: compute {on.work_ms:.1f} (each block timed alone here), "
           f"wire {on.comm_ms:.1f} (the model)")
    print0(f"  {'':<12} {'model':>8} {'compute waited':>15} {'clock, not checked':>19}")
    for name, prefetch, step in (("prefetch", True, on), ("no prefetch", False, off)):
        print0(f"  {name:<12} {step.step_ms:>8.1f} {step.waiting_ms:>15.1f} {min(clocks[prefetch]):>19.1f}")
    saved = off.step_ms - on.step_ms
    print0(f"  prefetch saves {saved:.1f} ms in the model ({saved / off.step_ms:.0%}): the lesson's answer.")
    print0("  (the clock column, the fastest of 4 steps here, is for comparison only and not checked: on a shared")
    print0("   machine it also counts the other programs)")
    assert on.step_ms <= off.step_ms + 1e-9, "in the model, prefetching never makes the step longer"
    if args.keep_after_forward:
        assert [c.kind for c in on.collectives].count("all_gather") == DEPTH, "one gather per block: in forward"
    if link.alpha_s >= 1e-3:  # a slow link: gathers cost as much as a block's compute
        assert saved > 0.25 * min(off.waiting_ms, on.work_ms), (
            f"on a slow link prefetch hides a good part of the waiting: saved {saved:.1f} of {off.waiting_ms:.1f} ms")

    # Part 3: when does FSDP pay? The same compute on a slow and on fast links.
    print0(f"\npart 3: step ms in the model, this compute, {world_size} ranks; memory per rank by the formula "
           f"(fp32 SGD with momentum: 12 bytes per parameter):")
    policy = Stage3Policy(reshard_after_forward=not args.keep_after_forward)
    ws = working_set_bytes(units, policy)  # what is whole at once: 2 units (prefetch), or all without resharding
    print0(f"  memory: DDP {12 * psi / 1024:.0f} KiB, FSDP {12 * psi / world_size / 1024 + ws / 1024:.0f} KiB "
           f"(12 psi / N + the units held whole at once: {ws / 1024:.0f} KiB)")
    print0(f"  {'link':<8} {'DDP':>7} {'FSDP':>7} {'no prefetch':>12} {'FSDP / DDP':>11}")
    ratios = {}
    for name in dict.fromkeys(["laptop", args.link, "eth25", "nvlink4"]):
        m = modelled(units, PRESETS[name], world_size, not args.keep_after_forward)
        ratios[name] = m["prefetch"].step_ms / m["ddp"].step_ms
        print0(f"  {name:<8} {m['ddp'].step_ms:>7.1f} {m['prefetch'].step_ms:>7.1f} {m['no prefetch'].step_ms:>12.1f} "
               f"{ratios[name]:>11.2f}")
    assert ratios["nvlink4"] < 1.05, "on a fast link the wire hides under compute: FSDP costs DDP's time"
    if link.alpha_s < 1e-4:  # --link eth25 and faster
        assert ratios[args.link] < 1.05, f"on {args.link} FSDP's gathers hide under compute: {ratios[args.link]:.2f}x"
    if world_size > 1 and not args.keep_after_forward:
        assert ratios["laptop"] > ratios["nvlink4"], "on a slow link FSDP's extra bytes show"
    print0(f"checked: FSDP sent {fsdp_bytes / ddp_bytes:.2f}x DDP's bytes; prefetch saved {saved:.1f} ms of "
           f"{off.step_ms:.1f} in the link model;")
    print0(f"         on nvlink4 FSDP costs {ratios['nvlink4']:.2f}x DDP's step, on the laptop link "
           f"{ratios['laptop']:.2f}x, for {(12 * psi / world_size + ws) / (12 * psi):.0%} of DDP's memory.")


def options(parser) -> None:
    parser.add_argument("--link", default="laptop", choices=list(PRESETS),
                        help="simulated network (default %(default)s: 2 ms per message, 200 MB/s)")
    parser.add_argument("--keep-after-forward", action="store_true",
                        help="fully_shard(..., reshard_after_forward=False): no second gather in backward")
    parser.add_argument("--batch", type=int, default=1024, help="samples per rank (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args)
