"""Lesson 19: the memory wall -- where DDP's bytes go, and sharding the optimizer state (ZeRO stage 1).

What you will learn
    DDP (lessons 04-08) replicates everything: every rank holds all the
    parameters, all the gradients, all of the optimizer's state, and
    MiniDDP's flat buckets on top. With AdamW in fp32 that is 4 + 4 + 8
    bytes per parameter, whatever the number of ranks (the ZeRO paper,
    Rajbhandari et al. 2020, counts 2 + 2 + 12 for mixed precision: 120 GB
    per GPU for 7.5 B parameters). More ranks make a step faster; they
    never make a model fit.

    Part 1 measures it: a small GPT with AdamW under MiniDDP, each rank's
    bytes counted from the tensors themselves
    (``minddp.zero.memory.measured_bytes``; a view of another tensor's
    storage costs nothing).

    Part 2 removes the largest redundant part. The optimizer state is only
    ever used by ``step()``, and AdamW updates each element on its own. So
    each rank can keep the state of *its 1/N of the elements* only, step
    that piece with the averaged gradient, and all-gather the updated
    pieces so every rank has the whole model again. That is ZeRO stage 1;
    ``HandStage1`` below is the idea in about twenty lines: lay the
    parameters end to end, cut the line into N equal pieces.

    Part 3 compares two ways to cut, with ``minddp.zero.ZeroRedundancyOptimizer``:
    ``partition="flat"`` (the paper's and DeepSpeed's, as HandStage1: a
    tensor may span two ranks) and ``"greedy"`` (torch's own
    ``ZeroRedundancyOptimizer``: whole tensors, largest first, to the rank
    with the fewest elements so far). On a model whose embedding is most of
    the parameters, greedy gives that whole tensor to one rank.

    Every sharded run is checked against the unsharded AdamW on the same
    data: the parameters must come out equal, bit for bit (each element
    gets the same arithmetic, on whichever rank it is stepped).

What to run
    python lessons/19_memory_wall.py [--world-size 3] [--gradient-as-bucket-view] [--optimizer sgd]

What to look at
    Part 1's table (the same on every rank: nothing is sharded), part 2's
    optimizer-state bytes per rank against DDP's, and part 3's two
    partitions side by side: the heaviest rank's share of the state. The
    same formulas at 8 to 1,024 ranks, with step times:
    ``python -m minddp_lab.simulate zero``.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict part 1 with ``--gradient-as-bucket-view``: which column
       drops to zero, and why?
    2. ``--world-size 3``: predict each rank's share of the state under
       both partitions.
    3. ``--optimizer sgd``: plain SGD keeps no state at all. Predict what
       stage 1 saves.
"""

import torch
import torch.distributed as dist

from minddp import MiniDDP
from minddp_lab.models import GPT, GPTConfig
from minddp.zero import ZeroRedundancyOptimizer
from minddp.zero.memory import measured_bytes
from _common import parse_args, print0, print_ranks, run

# A GPT whose token embedding (4096 x 64, tied with the head) is 72% of the parameters.
CONFIG = GPTConfig(vocab_size=4096, block_size=32, n_layer=2, n_head=2, n_embd=64)
STEPS, BATCH = 3, 4
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2}), "sgd": (torch.optim.SGD, {"lr": 0.1})}


class HandStage1:
    """ZeRO stage 1 in a few lines: this rank steps only its 1/N of the parameters laid end to end."""

    def __init__(self, params, optimizer_class, rank: int, world_size: int, **defaults):
        self.params, self.rank, self.world_size = list(params), rank, world_size
        self.numel = sum(p.numel() for p in self.params)
        self.piece = -(-self.numel // world_size)  # N equal pieces; the last is padded
        self.shard = self._mine(torch.cat([p.detach().reshape(-1) for p in self.params])).clone()
        self.optim = optimizer_class([self.shard], **defaults)  # its state: the size of the shard

    def _mine(self, flat: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(flat, (0, self.piece * self.world_size - self.numel))
        return padded[self.rank * self.piece: (self.rank + 1) * self.piece]

    def step(self) -> None:
        # The gradients are already averaged by DDP; keep this rank's elements.
        self.shard.grad = self._mine(torch.cat([p.grad.reshape(-1) for p in self.params])).clone()
        self.optim.step()
        everyone = torch.empty(self.piece * self.world_size)
        dist.all_gather(list(everyone.chunk(self.world_size)), self.shard.detach())  # every rank's updated piece
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(everyone[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors (a ZeRO optimizer's: this rank's shard)."""
    optimizer = getattr(optimizer, "optim", optimizer)
    return sum(t.nbytes for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))


def train(rank: int, make_optimizer, bucket_view: bool = False):
    """STEPS steps of the GPT under MiniDDP; every rank its own tokens. Returns (model, optimizer, bytes)."""
    torch.manual_seed(0)
    model = MiniDDP(GPT(CONFIG), gradient_as_bucket_view=bucket_view)
    optimizer = make_optimizer(model)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=data)
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        before_step = measured_bytes(model, optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
        optimizer.step()
    return model, optimizer, before_step


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def kib(n: float) -> str:
    return f"{n / 1024:8.1f} KiB"


def main(rank: int, world_size: int, args) -> None:
    optimizer_class, defaults = OPTIMIZERS[args.optimizer]
    plain = lambda m: optimizer_class(m.parameters(), **defaults)

    # Part 1: DDP, everything replicated.
    ddp, ddp_opt, counted = train(rank, plain, args.gradient_as_bucket_view)
    params = counted["params"]
    numel = sum(p.numel() for p in ddp.parameters())
    tensors = len(list(ddp.parameters()))
    print0(f"part 1: MiniDDP + {args.optimizer}, GPT of {numel:,} parameters ({params / 1024:.1f} KiB in fp32), "
           f"bytes per rank just before step {STEPS}:")
    print_ranks("  ".join(f"{k} {kib(counted[k])}" for k in ("params", "grads", "optimizer_state", "bucket_buffers")))
    per_element = counted["optimizer_state"] // numel  # 8 for AdamW (exp_avg, exp_avg_sq), 0 for SGD
    assert counted["grads"] == params, "DDP keeps a full gradient per parameter on every rank"
    assert counted["optimizer_state"] in (0, per_element * numel + 4 * tensors), \
        "the optimizer's state: per_element bytes per parameter, plus a 4-byte step count per tensor for AdamW"
    if args.gradient_as_bucket_view:
        assert counted["bucket_buffers"] == 0, "with bucket views .grad lives in the buckets: no second copy"
    else:
        assert counted["bucket_buffers"] == params, "MiniDDP's buckets: one more copy of the gradients"
    everyone = [None] * world_size
    dist.all_gather_object(everyone, counted)
    assert all(c == counted for c in everyone), "DDP replicates: every rank holds the same bytes"
    model_bytes = counted["params"] + counted["grads"] + counted["optimizer_state"]
    print0(f"  params + grads + optimizer state = {model_bytes / numel:.2f} bytes per parameter on each of the "
           f"{world_size} ranks (fp32: 4 + 4 + {per_element}); "
           f"the buckets add {counted['bucket_buffers'] / numel:.0f} more")
    assert abs(model_bytes / numel - (8 + per_element)) < 0.01, "4 + 4 + the state's bytes, whatever N"

    # Part 2: the optimizer state sharded by hand, checked against the unsharded optimizer.
    hand_model, hand, _ = train(rank, lambda m: HandStage1(m.parameters(), optimizer_class, rank, world_size,
                                                           **defaults))
    same = torch.equal(weights(hand_model), weights(ddp))
    mine = state_bytes(hand)
    print0(f"\npart 2: HandStage1, {numel:,} elements cut into {world_size} pieces of {hand.piece:,}; "
           f"optimizer state per rank (DDP's: {kib(state_bytes(ddp_opt))}):")
    print_ranks(f"{kib(mine)}, elements {rank * hand.piece:,} to {min((rank + 1) * hand.piece, numel):,}")
    assert _all(same), "stage 1 steps the same elements with the same arithmetic: the same parameters"
    expected = per_element * hand.piece + (4 if per_element else 0)  # AdamW's one step count for the shard
    assert mine == expected, f"1/N of the state, padding included: {mine} != {expected}"
    print0(f"  parameters after {STEPS} steps equal DDP + unsharded {args.optimizer}'s, bit for bit, on every rank")

    # Part 3: two partitionings, with the package's ZeroRedundancyOptimizer.
    shares = {}
    for partition in ("flat", "greedy"):
        model, zero, _ = train(rank, lambda m: ZeroRedundancyOptimizer(
            m.parameters(), optimizer_class, ddp=m, partition=partition, **defaults))
        assert _all(torch.equal(weights(model), weights(ddp))), f"{partition}: the same parameters as unsharded"
        elements = sum(s.numel for s in zero.layout.shards)
        shares[partition] = _gather(elements)
    largest = max(ddp.parameters(), key=lambda p: p.numel())
    print0(f"\npart 3: elements each rank steps (and keeps the optimizer state of), {world_size} ranks; "
           f"the largest tensor "
           f"(token embedding, {tuple(largest.shape)}) is {largest.numel() / numel:.0%} of the parameters:")
    print0(f"  {'rank':>4} {'flat':>10} {'greedy':>10}")
    for r in range(world_size):
        print0(f"  {r:>4} {shares['flat'][r]:>10,} {shares['greedy'][r]:>10,}")
    flat, greedy = shares["flat"], shares["greedy"]
    assert sum(flat) == sum(greedy) == numel, "both partitions cover every element once"
    assert max(flat) - min(flat) <= world_size - 1, "flat: equal pieces, up to the padding"
    assert max(greedy) >= largest.numel(), "greedy never splits a tensor: one rank holds all of the largest"
    heavy = max(greedy) / numel
    print0(f"  heaviest rank: flat {max(flat) / numel:.0%}, greedy {heavy:.0%} (1/N = {1 / world_size:.0%})")
    if world_size > 1:
        assert largest.numel() > max(flat), "the embedding alone is more than a flat piece: greedy is uneven"
    if per_element == 0:
        assert mine == 0 and counted["optimizer_state"] == 0, "SGD without momentum has no state"
        print0("checked: DDP replicates params, grads and buckets on every rank; plain SGD keeps no optimizer state,")
        print0("         so stage 1 saves nothing; both partitions and HandStage1 train exactly as unsharded SGD.")
        return
    buckets = "the buckets share .grad's storage" if args.gradient_as_bucket_view else "+ 4 in buckets"
    print0(f"checked: DDP holds {model_bytes / numel:.0f} bytes per parameter on every rank ({buckets}); stage 1 "
           f"keeps 1/{world_size} of the state per rank")
    print0("         and trains bit for bit as the unsharded optimizer; " + (
        "flat pieces are equal, greedy's are not: the embedding sits on one rank." if world_size > 1 else
        "one rank: both partitions are the whole model."))


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _all(flag: bool) -> bool:
    return all(_gather(bool(flag)))


def options(parser) -> None:
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="MiniDDP(..., gradient_as_bucket_view=True) in part 1")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args)
