"""Lesson 21: fully sharded (ZeRO stage 3) -- gather a unit, compute, free it.

What you will learn
    After lessons 19 and 20 each rank keeps 1/N of the optimizer state and
    of the gradients, but still *all* the parameters, 4 bytes each. Stage 3
    (Rajbhandari et al. 2020; torch's FSDP) shards those too: a rank keeps
    one flat 1/N piece of every *unit* (here: every layer), and a unit's
    full parameters exist only while that unit computes:

    * forward, unit by unit: **all-gather** its pieces, compute, **free** them;
    * backward, last unit first: all-gather again, compute the gradients,
      **reduce-scatter** the unit's full gradient (each rank keeps the
      average of its own piece), free it.

    ``HandFSDP`` below is that in about forty lines. Each unit runs inside an
    autograd ``Function``: its ``forward`` gathers, computes and lets the
    full parameters go; its ``backward`` gathers them again and, to stay
    short, recomputes the unit's forward to get the gradients (what
    activation checkpointing does; ``minddp.fsdp`` instead keeps the
    activations and only fetches the parameters again). The optimizer steps
    the flat pieces: an ordinary ``torch.optim`` optimizer, 1/N of the work
    and 1/N of the state.

    A ``Ledger`` notes the bytes of every gathered tensor while it lives, so
    part 1 prints the memory of one step as it goes: shards all the time,
    one unit in full on top. Part 2 runs ``minddp.fsdp.fully_shard`` (torch
    FSDP2's API and recipe: build on the meta device, shard each block then
    the root, ``to_empty`` to materialize, then initialize) on the same model
    and data, and prints what a parameter has become: a DTensor of the full
    shape, ``Shard(0)``, this rank's rows in ``to_local()``. The same
    parameters, and both equal to one process on the whole batch.

What to run
    python lessons/21_fully_sharded.py [--world-size 3] [--depth 8] [--width 512]
    (``--world-size 1`` runs too: nothing is sharded then, see Try this 3.)

What to look at
    Part 1's table: the bytes held in full at each moment of the step (one
    unit's parameters in forward; its parameters and gradient in backward)
    on top of the shards, against DDP's 12 bytes per parameter (SGD with
    momentum: 4 of weight, 4 of gradient, 4 of momentum, on every rank).
    Then part 2's differences: zero, or float32 rounding.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. ``--depth 8``: predict the peak against DDP's.
    2. ``--world-size 3``: predict the shard bytes per rank and the padding.
    3. ``--width 512`` makes every unit 16x bigger. Predict the peak's
       share of DDP's. And
       ``--world-size 1``: predict it against DDP's.
"""

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from _common import parse_args, print0, print_ranks, run

STEPS, BATCH, LR = 3, 8, 0.05
# torch 2.14 renamed these two (the old names warn); either name is the same collective.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Ledger:
    """The gathered tensors of the step, and the bytes their storages hold right now."""

    def __init__(self):
        self.tensors, self.rows = weakref.WeakSet(), []

    def note(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tensors.add(tensor)
        return tensor

    @property
    def held(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors)


def free(tensor: torch.Tensor) -> None:
    """Give the bytes back now, whoever still holds the tensor (a collective's handle may, for a while)."""
    tensor.untyped_storage().resize_(0)


class Unit:
    """One layer, sharded: this rank's flat piece of its parameters, laid end to end and padded to N pieces."""

    def __init__(self, layer: nn.Module, rank: int, world_size: int, ledger: Ledger):
        self.layer, self.world_size, self.ledger = layer, world_size, ledger
        self.shapes = {name: p.shape for name, p in layer.named_parameters()}
        flat = torch.cat([p.detach().reshape(-1) for p in layer.parameters()])
        self.numel, self.piece = flat.numel(), -(-flat.numel() // world_size)
        padded = nn.functional.pad(flat, (0, self.piece * world_size - self.numel))
        self.shard = nn.Parameter(padded[rank * self.piece:(rank + 1) * self.piece].clone())
        layer.to("meta")  # the full parameters are gone: only the shard is left

    def gather(self) -> torch.Tensor:
        full = self.ledger.note(torch.empty(self.piece * self.world_size))
        all_gather(full, self.shard.detach())
        return full

    def run(self, full: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        params, offset = {}, 0
        for name, shape in self.shapes.items():
            params[name] = full[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return functional_call(self.layer, params, (x,))


class GatherComputeFree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, unit):
        ctx.unit = unit
        ctx.save_for_backward(x)  # the input, not the full parameters: those are freed on return
        full = unit.gather()
        unit.ledger.rows.append(("forward", unit, unit.ledger.held))
        out = unit.run(full, x)
        free(full)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,), unit = ctx.saved_tensors, ctx.unit
        full = unit.gather().requires_grad_()
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            grad_x, grad_full = torch.autograd.grad(unit.run(full, x), (x, full), grad_out)
        unit.ledger.note(grad_full)
        unit.ledger.rows.append(("backward", unit, unit.ledger.held))
        grad_shard = torch.empty_like(unit.shard)
        reduce_scatter(grad_shard, grad_full)  # the sum of this rank's piece only
        free(full), free(grad_full)
        return grad_x, grad_shard / unit.world_size, None


class HandFSDP(nn.Module):
    def __init__(self, layers: nn.Sequential, rank: int, world_size: int):
        super().__init__()
        self.ledger = Ledger()
        self.units = [Unit(layer, rank, world_size, self.ledger) for layer in layers]
        self.shards = nn.ParameterList([u.shard for u in self.units])

    def forward(self, x):
        for unit in self.units:
            x = GatherComputeFree.apply(x, unit.shard, unit)
        return x


def make_layers(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)],
                         nn.Linear(width, 1))


def batch(step: int, rank: int, width: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, 1, generator=g)


def main(rank: int, world_size: int, args) -> None:
    reference = make_layers(args.width, args.depth)  # one process on the whole batch (every rank computes it)
    numel = sum(p.numel() for p in reference.parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    hand = HandFSDP(make_layers(args.width, args.depth), rank, world_size)
    opt = torch.optim.SGD(hand.parameters(), lr=LR, momentum=0.9)  # steps the shards: 1/N of the work and state
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r, args.width) for r in range(world_size)))
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        hand.ledger.rows.clear()
        opt.zero_grad()
        nn.functional.mse_loss(hand(xs[rank]), ys[rank]).backward()
        opt.step()
    shards = sum(u.piece for u in hand.units) * 4  # bytes of this rank's parameter pieces
    state = shards * 2  # their gradients and SGD's momentum, the same size
    largest = max(u.piece * world_size for u in hand.units) * 4
    print0(f"part 1: HandFSDP, {len(hand.units)} units, {numel:,} parameters, {world_size} ranks; rank 0's memory "
           f"during step {STEPS}, KiB:")
    print0(f"  {'moment':<20} {'held in full':>12} {'shards+grads+momentum':>22} {'total':>8}")
    for phase, unit, held in hand.ledger.rows:
        name = f"{phase} unit {hand.units.index(unit)}"
        print0(f"  {name:<20} {held / 1024:>12.1f} {(shards + state) / 1024:>22.1f} {(held + shards + state) / 1024:>8.1f}")
    peak = max(held for *_, held in hand.ledger.rows)
    ddp = 12 * numel  # DDP with SGD + momentum: parameters, gradients, momentum, all replicated
    print0(f"  peak {(peak + shards + state) / 1024:.1f} KiB against DDP's {ddp / 1024:.1f} KiB "
           f"(12 bytes per parameter, every rank)")
    assert hand.ledger.held == 0, "after the step nothing is held in full"
    assert peak == 2 * largest, "at most one unit in full: its parameters, and in backward its gradient"
    assert all(held <= largest for phase, _, held in hand.ledger.rows if phase == "forward"), \
        "in forward only the unit computing is held in full"
    full = torch.cat([u.shard.detach() for u in hand.units])
    everyone = [torch.empty_like(full) for _ in range(world_size)]
    dist.all_gather(everyone, full)
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    gathered = _unpad(everyone, hand.units, world_size)
    hand_diff = (gathered - expected).abs().max().item()
    print_ranks(f"shards {shards / 1024:.1f} KiB ({shards / (4 * numel):.0%} of the parameters); "
                f"max |HandFSDP - one process| = {hand_diff:.1e}")
    assert hand_diff < 1e-5, f"HandFSDP trains as one process on the whole batch (float32 rounding), off by {hand_diff}"

    # Part 2: the package, torch FSDP2's API and recipe: meta -> shard -> materialize -> initialize.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from minddp.fsdp import full_state_dict, fully_shard

    with torch.device("meta"):
        layers = make_layers(args.width, args.depth)  # shapes only: no rank ever holds the whole model
    for block in layers[:-1]:
        fully_shard(block)
    fully_shard(layers)  # the root: the head, and whatever no block owns
    layers.to_empty(device="cpu")  # each rank allocates its shard (uninitialized)
    # Initialize: here the same start as part 1 (FSDP2's example calls layers.reset_parameters(), nn.init on
    # the shards); torch's own helper takes the full tensors and keeps each rank's rows.
    set_model_state_dict(layers, make_layers(args.width, args.depth).state_dict(),
                         options=StateDictOptions(full_state_dict=True))
    weight = layers[0][0].weight
    print0(f"\npart 2: layers[0][0].weight is a {type(weight).__name__}, placements {weight.placements}, "
           f"shape {tuple(weight.shape)}; this rank holds to_local() {tuple(weight.to_local().shape)}")
    opt = torch.optim.SGD(layers.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, rank, args.width)
        opt.zero_grad()
        nn.functional.mse_loss(layers(x), y).backward()
        opt.step()
    weights = full_state_dict(layers)
    package = torch.cat([weights[name].reshape(-1) for name, _ in reference.named_parameters()])
    diff = (package - gathered).abs().max().item()
    print0(f"part 2: minddp.fsdp.fully_shard on each block, then the root: max |minddp.fsdp - HandFSDP| = {diff:.1e}")
    assert diff < 1e-5, f"minddp.fsdp and HandFSDP do the same arithmetic, up to float32 summation order: {diff}"
    print0(f"checked: in forward one unit at a time is held in full, in backward its gradient beside it; the peak is "
           f"{(peak + shards + state) / ddp:.0%} of DDP's;")
    print0(f"         HandFSDP and minddp.fsdp train like one process on the whole batch (within {max(hand_diff, diff):.0e}).")


def _unpad(everyone, units, world_size) -> torch.Tensor:
    """Every rank's concatenated pieces -> the full flat parameters, unit by unit, padding dropped."""
    out, offset = [], 0
    for u in units:
        out.append(torch.cat([e[offset:offset + u.piece] for e in everyone])[:u.numel])
        offset += u.piece
    return torch.cat(out)


def options(parser) -> None:
    parser.add_argument("--depth", type=int, default=4, help="hidden layers (default %(default)s)")
    parser.add_argument("--width", type=int, default=128, help="units per hidden layer (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args)
