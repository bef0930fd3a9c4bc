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
    epoch; then ``python -m minddp.train --help`` for the full training script.
"""

import torch
import torch.distributed as dist
import torch.utils.data
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp.data
import minddp.models
from minddp import MiniDDP
from _common import parse_args, print0, run


def train(wrapper, args, rank: int, world_size: int) -> list[float]:
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
    return epoch_losses


def main(rank: int, world_size: int, args) -> None:
    args.batch_size = args.batch_size or 32 * world_size
    source = f"MNIST from {args.data_dir}" if args.data_dir else "synthetic MNIST"
    steps = args.samples // args.batch_size
    print0(f"autoencoder on {args.samples} images of {source}, {world_size} ranks,")
    print0(f"global batch {args.batch_size} ({args.batch_size // world_size} per rank), {steps} steps per epoch\n")
    ours = train(MiniDDP, args, rank, world_size)
    theirs = train(TorchDDP, args, rank, world_size)

    print0("  epoch | MiniDDP loss | torch DDP loss")
    for epoch, (a, b) in enumerate(zip(ours, theirs)):
        print0(f"  {epoch:>5} | {a:>12.6f} | {b:>14.6f}")
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
    assert ours[-1] < ours[0], "the autoencoder learned something"
    print0("checked: the two wrappers' losses agree to 1e-5 relative in every epoch,")
    print0("         and the loss fell from the first epoch to the last.")


def options(parser) -> None:
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: synthetic data)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024, help="training images used per epoch")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch size, split over the ranks (default 32 per rank)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args)
