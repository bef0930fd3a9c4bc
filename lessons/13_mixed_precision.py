"""Lesson 13: mixed precision -- autocast, GradScaler, and fp16 gradients on the wire.

What you will learn
    Three separate ideas that are often mixed up:

    1. ``torch.autocast`` runs chosen operations (matrix products,
       convolutions) in a 16-bit type while the *weights* stay float32. Less
       memory traffic, faster tensor cores; losses and reductions stay in
       float32. On a CPU, bfloat16 autocast works too, which this lesson uses.
    2. ``GradScaler`` exists for float16 only: its smallest normal number is
       ~6e-5; below it the *subnormals* keep fewer and fewer significant bits
       down to ~6e-8, and anything smaller becomes zero. Small gradients
       lose precision or vanish. The scaler multiplies the
       loss by a large factor S before backward (every gradient is S times
       larger, out of the underflow zone), divides the gradients by S before
       the step, and if any gradient is inf/NaN it *skips* the step and halves
       S. Under DDP the all-reduce spreads one rank's inf to every rank, so
       all ranks skip together and stay identical -- checked below.
       bfloat16 has float32's range and needs no scaler.
    3. Gradient *compression* is independent of both: a communication hook
       casts each bucket to float16 before the all-reduce and back after, so
       half the bytes cross the network, at the cost of float16 rounding
       (about 3 significant digits). ``MiniDDP.register_comm_hook`` follows
       torch's contract, so torch's own hooks plug into it unchanged.

What to run
    python lessons/13_mixed_precision.py [--world-size 4] [--no-scaler] [--bf16-hook]

What to look at
    The dtypes under autocast; the scaler skipping a step on every rank; and
    how far fp16-communicated gradients are from exact ones (small, not zero),
    identical whether MiniDDP or torch's DDP, minddp's hook or torch's.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict ``torch.tensor(1e-6).half()``, ``torch.tensor(1e-8).half()``
       and ``torch.tensor(1e5).half()``, then check in a Python shell.
    2. ``--no-scaler``: the same inf on rank 0, without GradScaler. Predict
       what every rank's weights look like after ``opt.step()``.
    3. ``--bf16-hook``: part 3 with ``bf16_compress_hook`` beside
       ``fp16_compress_hook``: predict whether the error grows or shrinks.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp.ddp.default_hooks import bf16_compress_hook, fp16_compress_hook
from _common import parse_args, print0, run


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def batch(rank: int, step: int = 0):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, 32, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def rel_error(a, b) -> float:
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))


def part1_autocast(rank: int) -> None:
    model = make_model()
    x, y = batch(rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)  # autocast keeps this in float32
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    err = rel_error(grads, [p.grad for p in model.parameters()])

    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    # rounding to 8 significant bits, through three layers
    assert 0 < err < 0.2, f"expected bf16's gradients off by more than 0 and less than 20%, saw {err:.1%}"
    print0("1. autocast(cpu, bfloat16):")
    print0(f"   weights {model[0].weight.dtype}, layer output {out.dtype}, loss {loss.dtype}, gradients {model[0].weight.grad.dtype}")
    print0(f"   gradients differ from float32 ones by {err:.1%} (relative): bfloat16 keeps 8 bits, 2-3 digits\n")


def part2_grad_scaler(rank: int, world_size: int) -> None:
    tiny, subnormal = torch.tensor(1e-8), torch.tensor(1e-6)
    assert tiny.half() == 0 and (tiny * 2**16).half() != 0
    assert 0 < subnormal.half().item() < 6.1e-5 and abs(subnormal.half().item() - 1e-6) > 1e-10
    print0(f"2. GradScaler: in float16 1e-6 is a subnormal, {subnormal.half().item():.4e}; 1e-8 is",
           tiny.half().item(), "; scaled by 2^16 first it survives:", f"{(tiny * 2**16).half().item():.3e}")

    model = make_model()
    ddp = MiniDDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x, y = batch(rank)

    # A normal step: gradients arrive scaled; the scaler unscales, then steps.
    loss = nn.functional.cross_entropy(ddp(x), y)
    scaler.scale(loss).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    assert all(torch.allclose(s / 2**16, p.grad) for s, p in zip(scaled, model.parameters()))
    scaler.step(opt)
    scaler.update()

    # An overflow on rank 0 only. MiniDDP's average carries it to every rank.
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.cross_entropy(ddp(x), y)
    if rank == 0:
        loss = loss * float("inf")
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    scales = [None] * world_size
    dist.all_gather_object(scales, (skipped, scaler.get_scale()))
    assert all(s == (True, scale / 2) for s in scales), scales
    print0(f"   an inf on rank 0 only: every rank skipped the step and halved the scale {scale:.0f} -> {scale / 2:.0f}\n")


def grads_after_one_step(wrapper, hook, rank: int) -> list[torch.Tensor]:
    model = make_model()
    ddp = wrapper(model)
    if hook is not None:
        ddp.register_comm_hook(None, hook)  # state None: the default process group
    x, y = batch(rank)
    nn.functional.cross_entropy(ddp(x), y).backward()
    return [p.grad for p in model.parameters()]


def part3_compression(rank: int) -> None:
    exact = grads_after_one_step(MiniDDP, None, rank)
    ours = grads_after_one_step(MiniDDP, fp16_compress_hook, rank)
    torchs_hook_on_ours = grads_after_one_step(MiniDDP, default_hooks.fp16_compress_hook, rank)
    torchs = grads_after_one_step(TorchDDP, default_hooks.fp16_compress_hook, rank)

    err = rel_error(ours, exact)
    assert 0 < err < 1e-3, f"expected fp16 compression's error small but not zero (< 1e-3), saw {err:.2e}"
    torch_vs_ours = rel_error(torchs, ours)
    # Same buckets, same hook arithmetic: identical. torch's DDP buckets the
    # gradients differently, and Gloo may then add three or more fp16 values
    # in another order, so only fp16 rounding separates it from ours.
    hooks_differ = rel_error(torchs_hook_on_ours, ours)
    assert hooks_differ < 1e-6, f"expected torch's hook on MiniDDP == ours to 1e-6, saw {hooks_differ:.1e}"
    assert torch_vs_ours < 1e-3, f"expected torch's DDP within 1e-3 of ours, saw {torch_vs_ours:.1e}"
    numel = sum(g.numel() for g in exact)
    print0("3. fp16 gradient compression (a comm hook):")
    print0(f"   {numel:,} gradients: {numel * 4:,} bytes per all-reduce in float32, {numel * 2:,} in float16")
    print0(f"   compressed vs exact average: {err:.1e} relative difference")
    print0("   minddp's hook == torch's hook on MiniDDP (to 1e-6); torch's DDP with its hook: " +
           ("identical here" if torch_vs_ours == 0 else f"{torch_vs_ours:.0e} relative (other buckets, another order of fp16 sums)"))


def bf16_against_fp16(rank: int) -> None:
    """Exercise 3: the same compression with bf16 instead of fp16."""
    exact = grads_after_one_step(MiniDDP, None, rank)
    fp16 = rel_error(grads_after_one_step(MiniDDP, fp16_compress_hook, rank), exact)
    bf16 = rel_error(grads_after_one_step(MiniDDP, bf16_compress_hook, rank), exact)
    torchs = rel_error(grads_after_one_step(TorchDDP, default_hooks.bf16_compress_hook, rank), exact)
    print0("--bf16-hook: compressed vs exact average, relative difference:")
    print0(f"   fp16 (11 significant bits) {fp16:.1e}")
    print0(f"   bf16 ( 8 significant bits) {bf16:.1e}   ({bf16 / fp16:.1f}x; torch's DDP with its bf16 hook: {torchs:.1e})")
    assert bf16 > 2 * fp16, f"expected bf16's error well above fp16's, saw {bf16:.2e} against {fp16:.2e}"
    assert 0 < bf16 < 1e-2, f"expected bf16's error small but not zero (< 1e-2), saw {bf16:.2e}"
    print0("checked: bf16 compression loses more than fp16 (fewer significant bits), and stays small.")


def without_scaler(rank: int, world_size: int) -> None:
    ddp = MiniDDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = batch(rank)
    loss = nn.functional.cross_entropy(ddp(x), y)
    if rank == 0:
        loss = loss * float("inf")  # the same overflow as in part 2
    loss.backward()
    opt.step()
    finite = [None] * world_size
    dist.all_gather_object(finite, all(torch.isfinite(p).all().item() for p in ddp.parameters()))
    print0(f"--no-scaler: an inf on rank 0, no GradScaler; weights finite after the step, per rank: {finite}")
    assert not any(finite), "the all-reduce carried rank 0's inf into every rank's weights"
    print0("checked: without the scaler's skip, one rank's overflow ruined every replica.")


def main(rank: int, world_size: int, no_scaler: bool = False, bf16_hook: bool = False) -> None:
    if no_scaler:
        return without_scaler(rank, world_size)
    if bf16_hook:
        return bf16_against_fp16(rank)
    part1_autocast(rank)
    part2_grad_scaler(rank, world_size)
    part3_compression(rank)
    print0("\nchecked: every statement above.")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--no-scaler", action="store_true", help="the overflow of part 2 without GradScaler")
        parser.add_argument("--bf16-hook", action="store_true", help="part 3 with bf16 compression beside fp16")
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args.no_scaler, args.bf16_hook)
