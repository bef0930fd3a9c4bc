"""Lesson 10: BatchNorm under data parallelism -- broadcast buffers against SyncBatchNorm.

What you will learn
    BatchNorm breaks the promise of lesson 04 ("p ranks on B/p samples =
    one process on B"), because its forward uses the *batch's* mean and
    variance. Under DDP each rank normalizes with the statistics of its own
    slice. When slices differ (data sorted by class, one hospital per rank,
    or just small per-rank batches), outputs and gradients are not those of
    the full batch.

    * ``broadcast_buffers=True`` (DDP's default, MiniDDP's too) only copies
      rank 0's *running* statistics to everyone before each forward. That
      keeps evaluation consistent across ranks, but training still uses
      local batch statistics, and the running statistics are rank 0's alone.
    * ``minddp.SyncBatchNorm`` all-gathers each rank's per-channel count,
      mean and sum of squared deviations (n, mean, M2) in forward and
      combines them into the *global* batch's mean and variance (Chan et
      al.'s parallel formula: no cancellation, unlike sums and sums of
      squares, see ``minddp/sync_batchnorm.py``); backward all-reduces the
      two sums the input gradient needs. Every rank then normalizes with
      the global statistics: exactly the single-process result, at the
      price of two extra small collectives per BatchNorm layer.
      ``SyncBatchNorm.convert_sync_batchnorm(model)`` swaps every BatchNorm.

What to run
    python lessons/10_batchnorm.py [--world-size 4] [--plain-batchnorm-only] [--shift 0] [--torch-syncbn]

    It compares ranks' statistics, so it needs two at least: given
    ``--world-size 1`` it says so in one line and exits.

What to look at
    For plain BatchNorm and for SyncBatchNorm: how far outputs, gradients
    and running means are from one process on the whole batch.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict the row "running mean" for plain BatchNorm before running:
       rank 0's slice is not shifted, rank 1's by 2, so how far can rank 0's
       running mean be from the global one?
    2. ``--shift 0`` (the default is 2) and predict which differences
       remain for plain BatchNorm.
    3. ``--torch-syncbn``: convert with torch's own ``nn.SyncBatchNorm``
       instead of MiniDDP's, on these CPU tensors. Predict.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from minddp import MiniDDP, SyncBatchNorm
from _common import parse_args, print0, run


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))


def compare(model: nn.Module, single: nn.Module, rank: int, world_size: int, shift: float = 2.0) -> dict:
    """One training step on slices vs one process on the batch; the largest differences."""
    per_rank = 16
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(per_rank * world_size, 8, generator=gen)
    # Shards that differ, as when a dataset is sorted: rank r's slice is shifted by 2r.
    x += shift * torch.arange(world_size).repeat_interleave(per_rank)[:, None]
    y = torch.randn(per_rank * world_size, 1, generator=gen)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    ddp = MiniDDP(model)
    out = ddp(x[mine])
    nn.functional.mse_loss(out, y[mine]).backward()
    full_out = single(x)
    nn.functional.mse_loss(full_out, y).backward()

    diffs = torch.tensor([
        (out - full_out[mine]).abs().max().item(),
        max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), single.parameters())),
        (model[1].running_mean - single[1].running_mean).abs().max().item(),
    ])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)  # the worst rank
    return dict(zip(["output", "gradient", "running mean"], diffs.tolist()))


def torch_syncbn_on_cpu(rank: int, world_size: int) -> None:
    """Exercise 3: torch's nn.SyncBatchNorm, on the CPU tensors of this lesson."""
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    try:
        model(torch.randn(16, 8))
        outcome = "ran"
    except (ValueError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error}"
    print0(f"torch's nn.SyncBatchNorm, training forward on a CPU tensor: {outcome}")
    expected = "SyncBatchNorm expected input tensor to be on GPU"
    assert expected in outcome, f"expected torch's SyncBatchNorm to refuse CPU input ({expected!r}), saw: {outcome}"
    print0("checked: torch's SyncBatchNorm raises on CPU tensors instead of running unsynchronized.")


def main(rank: int, world_size: int, plain_only: bool = False, shift: float = 2.0, torch_syncbn: bool = False) -> None:
    if torch_syncbn:
        return torch_syncbn_on_cpu(rank, world_size)
    torch.manual_seed(0)
    plain = make_model()
    single = copy.deepcopy(plain)
    synced = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
    assert isinstance(synced[1], SyncBatchNorm)

    bn = compare(plain, copy.deepcopy(single), rank, world_size, shift)
    local = f"plain BatchNorm uses local statistics: expected every difference > 1e-2, saw {bn}"
    if plain_only:
        print0(f"{world_size} ranks, plain BatchNorm1d; largest difference from one process on all samples:")
        for key, value in bn.items():
            print0(f"  {key:<14} {value:.2e}")
        assert all(v > 1e-2 for v in bn.values()), local
        print0("checked: outputs, gradients and running mean all differ from the full batch's.")
        return
    sync = compare(synced, copy.deepcopy(single), rank, world_size, shift)

    print0(f"{world_size} ranks, 16 samples each, rank r's samples shifted by {shift:g}r.")
    print0("largest difference from one process on all samples, after one step:")
    print0(f"  {'':<14} {'BatchNorm1d':>12} {'SyncBatchNorm':>14}")
    for key in bn:
        print0(f"  {key:<14} {bn[key]:>12.2e} {sync[key]:>14.2e}")
    assert all(v > 1e-2 for v in bn.values()), local
    assert all(v < 1e-5 for v in sync.values()), f"SyncBatchNorm uses the global batch's: expected every difference < 1e-5, saw {sync}"
    print0("checked: with plain BatchNorm each rank's outputs, averaged gradients and running")
    print0("         mean all differ from the full batch's; with SyncBatchNorm they match.")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--plain-batchnorm-only", action="store_true", help="skip SyncBatchNorm")
        parser.add_argument("--shift", type=float, default=2.0, help="rank r's samples are shifted by SHIFT * r")
        parser.add_argument("--torch-syncbn", action="store_true", help="try torch's nn.SyncBatchNorm on CPU")
    args = parse_args(__doc__, min_world_size=2, extra=options)
    run(main, args.world_size, args.plain_batchnorm_only, args.shift, args.torch_syncbn)
