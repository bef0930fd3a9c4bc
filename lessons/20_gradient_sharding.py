"""Lesson 20: gradient sharding (ZeRO stage 2) -- reduce-scatter the buckets during backward.

What you will learn
    After lesson 19's stage 1 each rank *steps* only its 1/N of the
    elements, yet it still receives the whole averaged gradient from DDP's
    all-reduce, and throws N-1 pieces of it away. An all-reduce is two
    halves (lesson 03's ring): a *reduce-scatter*, after which each rank
    holds the sum of its own 1/N, and an *all-gather*, which hands every
    rank everyone's piece. Stage 2 (Rajbhandari et al. 2020) stops after
    the first half: each rank receives only the averaged gradient of the
    elements it owns. The second half comes after the step, for the
    *parameters*: every rank's updated piece, gathered.

    So nothing more travels than in DDP -- reduce-scatter plus all-gather
    moves exactly what one all-reduce moves (part 1 counts it) -- while the
    full averaged gradient never exists anywhere. And MiniDDP's buckets
    keep their timing: each bucket is reduce-scattered as soon as it is
    full, while backward carries on (lesson 06's overlap).

    ``ZeroRedundancyOptimizer(..., ddp=model, shard_gradients=True)`` does
    this through two narrow contacts with MiniDDP (``minddp/zero/stage2.py``):
    a comm hook that reduce-scatters each bucket (cut into N equal pieces,
    rank r owning piece r) and lent bucket buffers whose reduced result it
    takes (``lend_buckets(reducer, pool, on_reduced)``), which tells the
    reducer not to write ``.grad``.

    Part 2 runs DDP, stage 1 and stage 2 on lesson 19's GPT and counts, for
    one step: every collective and the bytes each rank sends in it (a ring
    sends ``2 (N-1)/N`` of an all-reduced buffer and ``(N-1)/N`` of a
    reduce-scattered or all-gathered one), how many left before the last
    gradient was computed, and each rank's bytes just before the step.

What to run
    python lessons/20_gradient_sharding.py [--world-size 3] [--bucket-cap-mb 25]

What to look at
    Part 1: the reduce-scattered pieces, gathered, are the all-reduce.
    Part 2's table: the wire column (stage 2 = DDP, stage 1 = 1.5 x DDP),
    the collectives that left during backward, and the gradient bytes per
    rank (stage 2 keeps 1/N of them; stage 1 the full ``.grad`` and its
    shard besides).

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Before running: stage 1 on a DDP wrapper all-reduces, then
       all-gathers the parameters. Predict its bytes on the wire against
       DDP's.
    2. ``--bucket-cap-mb 25`` (torch's default): predict how many buckets,
       and how many reduce-scatters leave before the last gradient.
    3. ``--world-size 3``: predict stage 2's gradient bytes per rank, and
       its bytes on the wire against DDP's.
"""

import torch
import torch.distributed as dist

from minddp_lab.network import bytes_sent_per_rank


class WireCounter:
    """Wraps torch.distributed's three collectives; while ``on``, records (kind, bytes sent per rank,
    how many gradients were complete when it was called: ``gradient_ready`` counts them)."""

    NAMES = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
             "reduce_scatter_single": "reduce_scatter", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather"}

    def __init__(self):
        self.on, self.calls, self.gradients_ready = False, [], 0
        for name, kind in self.NAMES.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counting(kind, original))

    def _counting(self, kind, original):
        def call(*args, **kwargs):
            if self.on:
                buffer = max((a for a in args if torch.is_tensor(a)), key=lambda t: t.numel())  # the whole buffer
                sent = bytes_sent_per_rank(kind, buffer.nbytes, dist.get_world_size(kwargs.get("group")))
                self.calls.append((kind, sent, self.gradients_ready))
            return original(*args, **kwargs)
        return call

    def gradient_ready(self, param: torch.Tensor) -> None:
        """A post-accumulate-grad hook: one more gradient of this backward is complete."""
        self.gradients_ready += 1

    def bytes(self, kind=None) -> float:
        return sum(sent for k, sent, _ in self.calls if kind in (None, k))


# Installed before minddp.zero is imported: it binds the collectives it calls when imported.
COUNTER = WireCounter()

from minddp import MiniDDP  # noqa: E402
from minddp.ddp.core.assignment import MiB  # noqa: E402
from minddp_lab.models import GPT, GPTConfig  # noqa: E402
from minddp.zero import ZeroRedundancyOptimizer  # noqa: E402
from minddp.zero.memory import measured_bytes, paper_bytes  # noqa: E402
from _common import parse_args, print0, print_ranks, run  # noqa: E402

# torch 2.14 renamed these two (the old names warn); either name is the same collective.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Lesson 19's GPT: the token embedding (4096 x 64, tied with the head) is 72% of the parameters.
CONFIG = GPTConfig(vocab_size=4096, block_size=32, n_layer=2, n_head=2, n_embd=64)
STEPS, BATCH = 3, 4
SETUPS = ("ddp", "stage1", "stage2")


def show_the_identity(rank: int, world_size: int) -> None:
    """Part 1: one buffer, all-reduced, and reduce-scattered then all-gathered."""
    n = 2 * world_size  # two elements per rank
    mine = torch.arange(n, dtype=torch.float32) * 10 ** rank  # rank r's "gradient"
    COUNTER.calls.clear()
    COUNTER.on = True
    summed = mine.clone()
    dist.all_reduce(summed)
    all_reduce_bytes = COUNTER.bytes()
    piece = torch.empty(2)
    reduce_scatter(piece, mine.clone())  # this rank: the sum of its 2 elements only
    gathered = torch.empty(n)
    all_gather(gathered, piece)  # everyone's sums, to everyone
    COUNTER.on = False
    print0(f"part 1: a buffer of {n} floats, rank r's = [0, 1, ..., {n - 1}] x 10^r")
    print_ranks(f"all-reduce {summed.tolist()}; reduce-scatter keeps {piece.tolist()}; all-gathered "
                f"{gathered.tolist()}")
    assert torch.equal(piece, summed[2 * rank: 2 * rank + 2]), "reduce-scatter: this rank's part of the sum"
    assert torch.equal(gathered, summed), "all-gather of the reduce-scattered pieces = the all-reduce"
    halves = COUNTER.bytes("reduce_scatter") + COUNTER.bytes("all_gather")
    assert halves == all_reduce_bytes, "a ring sends (N-1)/N of the buffer in each half, 2 (N-1)/N in an all-reduce"
    print0(f"  bytes each rank sends (ring): all-reduce {all_reduce_bytes:.1f}; reduce-scatter "
           f"{COUNTER.bytes('reduce_scatter'):.1f} + all-gather {COUNTER.bytes('all_gather'):.1f} = {halves:.1f}")


def train(rank: int, setup: str, bucket_cap_mb: float):
    """STEPS AdamW steps of the GPT under MiniDDP, the last one counted. Returns (model, bytes, gradients)."""
    torch.manual_seed(0)
    net = GPT(CONFIG)
    for p in net.parameters():  # registered before MiniDDP's: they run before it launches a bucket
        p.register_post_accumulate_grad_hook(COUNTER.gradient_ready)
    model = MiniDDP(net, bucket_cap_mb=bucket_cap_mb)
    if setup == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model,
                                            shard_gradients=setup == "stage2", lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=data)
        optimizer.zero_grad()
        COUNTER.gradients_ready = 0
        COUNTER.calls.clear()
        COUNTER.on = step == STEPS - 1
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        before_step = measured_bytes(model, optimizer)
        optimizer.step()
        COUNTER.on = False
    return model, before_step, len(list(net.parameters()))


def bucket_sizes(model) -> list[tuple[float, list[str], float]]:
    """MiniDDP's buckets, in launch order: (MiB, the names of its parameters, the last one's MiB)."""
    return [(b.numel * b.dtype.itemsize / MiB, b.names, b.params[-1].numel() * b.dtype.itemsize / MiB)
            for b in model.reducer.buckets]


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def main(rank: int, world_size: int, args) -> None:
    show_the_identity(rank, world_size)

    # Part 2: DDP, stage 1 and stage 2, one counted step each.
    runs = {}
    for setup in SETUPS:
        model, counted, gradients = train(rank, setup, args.bucket_cap_mb)
        # by the order of events, not the clock: launched while some gradient was still to come
        early = sum(1 for kind, _, ready in COUNTER.calls if kind != "all_gather" and ready < gradients)
        wire = {kind: COUNTER.bytes(kind) for kind in ("all_reduce", "reduce_scatter", "all_gather")}
        runs[setup] = (weights(model), counted, wire, early, bucket_sizes(model))
    numel = runs["ddp"][0].numel()
    reference = runs["ddp"][0]
    sizes = runs["ddp"][4]
    # torch's rule: a bucket closes after the gradient that reaches the cap (the cap given is every
    # bucket's: only MiniDDP(model) without one caps the first at 1 MiB, to leave early)
    cap = args.bucket_cap_mb
    for i, (mib, names, last) in enumerate(sizes):
        assert mib - last < cap, f"bucket {i} holds {names} in {mib:.2f} MiB: it should have closed at {cap:g} MiB"
    print0(f"\npart 2: GPT of {numel:,} parameters, AdamW, {world_size} ranks, {len(sizes)} bucket(s) of "
           f"{', '.join(f'{mib:.2f}' for mib, _, _ in sizes)} MiB; one step, rank 0, KiB")
    print0(f"(cap {cap:g} MiB: a bucket closes after the gradient that reaches it, as torch's DDP)")
    print0(f"  {'setup':<7} {'all-reduce':>10} {'red-scatter':>11} {'all-gather':>10} {'wire':>7} "
           f"{'left before last grad':>21} {'grads':>7} {'model':>7} {'paper':>7}")
    paper = {}
    for i, setup in enumerate(SETUPS):
        _, counted, wire, early, _ = runs[setup]
        model_bytes = counted["params"] + counted["grads"] + counted["optimizer_state"]
        paper[setup] = paper_bytes(i, numel, world_size, param_bytes=4, grad_bytes=4, state_bytes=8)
        print0(f"  {setup:<7} {kib(wire['all_reduce']):>10} {kib(wire['reduce_scatter']):>11} "
               f"{kib(wire['all_gather']):>10} {kib(sum(wire.values())):>7} {early:>21} "
               f"{kib(counted['grads']):>7} {kib(model_bytes):>7} {kib(paper[setup]):>7}")
    print0("  (model = params + grads + optimizer state just before the step; paper = the fp32 formula:\n"
           "   DDP 16 psi, stage 1 8 psi + 8 psi/N, stage 2 4 psi + 12 psi/N; MiniDDP's buckets come on top)")

    ddp_wire, s1_wire, s2_wire = (sum(runs[s][2].values()) for s in SETUPS)
    # ZeRO pads each bucket (stage 2) or group (stage 1) to N equal pieces: under N elements each, sent twice.
    padding = 2 * 4 * world_size * len(runs["stage2"][4])
    assert ddp_wire <= s2_wire <= ddp_wire + padding, "stage 2: reduce-scatter + all-gather = DDP's all-reduce"
    assert abs(s1_wire - 1.5 * ddp_wire) <= padding, "stage 1 on DDP: the all-reduce, then an all-gather"
    buckets = len(runs["ddp"][4])
    if world_size > 1:
        for setup in SETUPS:  # each bucket leaves with its own last gradient; only the last waits for the end
            assert runs[setup][3] == buckets - 1, f"{setup}: every bucket but the last leaves during backward"
    psi = 4 * numel
    s1_grads, s2_grads = runs["stage1"][1]["grads"], runs["stage2"][1]["grads"]
    assert abs(s2_grads - psi / world_size) <= padding, "stage 2 keeps 1/N of the gradients (+- the padding)"
    assert s1_grads >= psi + s2_grads - padding, "stage 1 keeps the whole .grad, and its shard besides"
    s2_model = runs["stage2"][1]
    s2_model = s2_model["params"] + s2_model["grads"] + s2_model["optimizer_state"]
    step_counts = 4 * sum(len(names) for _, names, _ in sizes)  # AdamW's step: 4 bytes per tensor, not in the paper
    assert abs(s2_model - paper["stage2"]) <= 3 * padding + step_counts, "stage 2 measured = the paper's formula (+ padding)"
    # Stage 2 sums each bucket by reduce-scatter, DDP by all-reduce: the same additions, possibly in
    # another order (Gloo's algorithms differ), so float32 rounding may differ in the last bit. After
    # 3 AdamW steps of lr 1e-2 a few ulps of the gradient stay far below 1e-6.
    worst = max((runs[s][0] - reference).abs().max().item() for s in ("stage1", "stage2"))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, worst)
    assert max(everyone) < 1e-6, f"the sharded runs train as DDP + AdamW: max |difference| {max(everyone):.1e}"
    print0("\nchecked: reduce-scatter + all-gather moved exactly the all-reduce's bytes (part 1; in part 2 stage 2 = "
           "DDP, up to ZeRO's padding); stage 1 moved 1.5 x;")
    print0(f"         {buckets - 1 if world_size > 1 else 0} of {buckets} bucket reductions left before the last "
           "gradient was computed, in all three setups;")
    print0(f"         stage 2 keeps {s2_grads / psi:.0%} of the gradients per rank (stage 1: "
           f"{s1_grads / psi:.0%}), its memory is the paper's formula; stages 1 and 2 trained "
           + ("bit for bit as DDP + AdamW." if max(everyone) == 0 else f"within {max(everyone):.0e} of DDP + AdamW."))


def options(parser) -> None:
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25, help="MiniDDP's bucket cap (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args)
