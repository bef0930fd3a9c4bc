"""Lesson 14: the MNIST autoencoder, end to end, with MiniDDP and with torch's DDP.

What you will learn
    Everything so far, in the shape of a real training script: a process
    group per rank, a sharded loader with ``set_epoch``, the model wrapped
    for data parallelism, a loss averaged over ranks for reporting, and one
    rank printing. The model is an autoencoder (``minddp.models``' ``ae``):
    it squeezes each 28x28 image through 32 numbers and rebuilds it; its
    loss is the pixel-wise mean squared error, no labels needed.

    The same script trains it twice -- once wrapped in ``minddp.MiniDDP``,
    once in ``torch.nn.parallel.DistributedDataParallel`` -- from the same
    start on the same batches, and the two loss curves agree.

What to run
    python lessons/14_mnist_autoencoder.py                    # synthetic MNIST, offline
    python lessons/14_mnist_autoencoder.py --data-dir ./data  # real MNIST in ./data/MNIST/raw
    python lessons/14_mnist_autoencoder.py --world-size 4 --epochs 3 --samples 4096

What to look at
    The loss per epoch for both wrappers (equal), falling from epoch to
    epoch; the training throughput in samples per second on 1 rank and on
    all of them (measured, not asserted: on a shared 2-core laptop the gain
    is far from 2x); with matplotlib installed, a PNG of a few images and
    their reconstructions. Then ``python -m minddp.train --help`` for the
    full training script.

Try this
    1. Predict the samples/s at 2 ranks against 1 on your machine before
       running. (On a laptop with 2 free cores, somewhat under 2x: every step
       also all-reduces the gradients; with 1 free core, no gain at all.)
    2. ``--epochs 6``: predict whether the two wrappers still agree.
       (Yes: same start, same batches, same averages.)
    3. ``--batch-size 16`` at ``--world-size 2``: each rank's batch is 8;
       predict what happens to the loss curve and why. (More, noisier steps:
       the global batch, not the per-rank one, is what the optimizer sees.)
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.utils.data
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp.data
import minddp.models
from minddp import MiniDDP
from _common import parse_args, print0, run


def train(wrapper, args, rank: int, world_size: int):
    torch.manual_seed(0)  # the same start for both wrappers (and rank 0 broadcasts it anyway)
    model = minddp.models.build_model("ae")
    ddp = wrapper(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)

    if args.data_dir:
        dataset = minddp.data.load_mnist(args.data_dir, train=True)
    else:
        dataset = minddp.data.SyntheticMNIST(args.samples, seed=0)
    if len(dataset) > args.samples:
        dataset = torch.utils.data.Subset(dataset, range(args.samples))
    loader = minddp.data.make_loader(dataset, args.batch_size, shuffle=True, seed=0, rank=rank, world_size=world_size)

    epoch_losses = []
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2)  # (sum of losses, number of batches)
        for images, labels in loader:
            opt.zero_grad()
            loss = minddp.models.model_loss("ae", ddp(images), images, labels)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item(), 1.0])
        # Each rank saw only its shard; the epoch's loss is over all ranks.
        dist.all_reduce(total)
        epoch_losses.append((total[0] / total[1]).item())
    return epoch_losses, model, dataset


def samples_per_second(group, rank: int, steps: int = 8, per_rank: int = 32) -> float:
    """Train the autoencoder a few steps on ``group``; samples per second over the group."""
    torch.manual_seed(0)
    model = MiniDDP(minddp.models.build_model("ae"), process_group=group)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    images = torch.rand(per_rank, 1, 28, 28, generator=torch.Generator().manual_seed(rank))
    dist.barrier(group)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        minddp.models.model_loss("ae", model(images), images, None).backward()
        opt.step()
    dist.barrier(group)
    return steps * per_rank * dist.get_world_size(group) / (time.perf_counter() - start)


def throughput(rank: int, world_size: int) -> None:
    solo = dist.new_group(ranks=[0])  # every rank takes part in creating a group, even one it is not in
    one = samples_per_second(solo, rank) if rank == 0 else None
    dist.barrier()
    everyone = samples_per_second(dist.group.WORLD, rank)
    if rank == 0:
        print(f"\nthroughput (measured here, not asserted): 1 rank {one:,.0f} samples/s, "
              f"{world_size} ranks {everyone:,.0f} samples/s ({everyone / one:.2f}x)")


def save_reconstructions(model, dataset, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("(no matplotlib: pip install '.[plot]' to get a PNG of images and their reconstructions)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = torch.stack([dataset[i][0] for i in range(8)])
    with torch.no_grad():
        rebuilt = model(images).reshape(images.shape)
    fig, axes = plt.subplots(2, 8, figsize=(8, 2.2))
    for i in range(8):
        for row, batch in enumerate((images, rebuilt)):
            axes[row, i].imshow(batch[i, 0], cmap="gray")
            axes[row, i].axis("off")
    fig.suptitle("top: images, bottom: the autoencoder's reconstructions")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"wrote {path}")


def main(rank: int, world_size: int, args) -> None:
    args.batch_size = args.batch_size or 32 * world_size
    source = f"MNIST from {args.data_dir}" if args.data_dir else "synthetic MNIST"
    steps = args.samples // args.batch_size
    print0(f"autoencoder on {args.samples} images of {source}, {world_size} ranks,")
    print0(f"global batch {args.batch_size} ({args.batch_size // world_size} per rank), {steps} steps per epoch\n")
    ours, model, dataset = train(MiniDDP, args, rank, world_size)
    theirs, _, _ = train(TorchDDP, args, rank, world_size)

    print0("  epoch | MiniDDP loss | torch DDP loss")
    for epoch, (a, b) in enumerate(zip(ours, theirs)):
        print0(f"  {epoch:>5} | {a:>12.6f} | {b:>14.6f}")
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
    assert ours[-1] < ours[0], "the autoencoder learned something"
    print0("checked: the two wrappers' losses agree to 1e-5 relative in every epoch,")
    print0("         and the loss fell from the first epoch to the last.")
    throughput(rank, world_size)
    if rank == 0:
        save_reconstructions(model, dataset, os.path.join(tempfile.gettempdir(), "minddp_lesson14_reconstructions.png"))


def options(parser) -> None:
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: synthetic data)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024, help="training images used per epoch")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch size, split over the ranks (default 32 per rank)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args)
