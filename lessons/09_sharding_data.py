"""Lesson 09: sharding the data -- the distributed sampler, epochs, batch size and learning rate.

What you will learn
    In lessons 04-08 every rank cut its slice out of one shared batch by
    hand. Real training reads a dataset, and the ranks must read *different*
    samples and the *same number* of batches (a rank that runs out early
    leaves the others waiting in an all-reduce forever).
    ``minddp.DistributedSampler`` does it without any communication: every
    rank draws the same permutation (same seed) and keeps every p-th index.

    * Padding: when p does not divide the dataset, a few indices are repeated
      so all ranks get the same count; ``drop_last=True`` cuts instead, and
      ``pad=False`` yields every sample exactly once (for evaluation).
    * ``set_epoch(e)``: the permutation is seeded with ``seed + epoch``;
      forget to call it and every epoch repeats the same order.
    * Batch size: ``DataLoader(batch_size=b)`` is the *per-rank* batch; the
      step averages over the *global* batch ``b * p``. Keep ``b`` fixed and
      add ranks, and each step sees p times more data, with p times fewer
      steps per epoch. The *linear scaling rule* (Goyal et al., 2017): scale
      the learning rate by the same factor (with a warm-up for large ones).

What to run
    python lessons/09_sharding_data.py [--world-size 3] [--forget-set-epoch] [--lr 0.05]

What to look at
    Each rank's indices of an 11-sample dataset under the three modes; two
    epochs with and without ``set_epoch``; and the small experiment behind
    the linear scaling rule.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict each rank's indices for 11 samples on 3 ranks with padding:
       how many are repeated?
    2. ``--forget-set-epoch``: a small training loop over 3 epochs that
       never calls ``set_epoch``. Predict what each epoch reads.
    3. ``--lr 0.05`` (ten times the default 0.005) in the scaling
       experiment: predict whether the scaled big step still matches.
"""

import torch
import torch.distributed as dist
import torch.utils.data

import minddp_lab.data
from minddp import DistributedSampler
from _common import parse_args, print0, print_ranks, run


def gather(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def main(rank: int, world_size: int, forget_set_epoch: bool = False, lr: float = 0.005) -> None:
    p, n = world_size, 11
    dataset = list(range(n))  # a sampler needs only len(dataset)

    print0(f"a dataset of {n} samples over {p} ranks, shuffled with seed 0:")
    for label, kwargs in [("pad (training, default)", {}), ("drop_last=True", dict(drop_last=True)), ("pad=False (evaluation)", dict(pad=False))]:
        mine = list(DistributedSampler(dataset, shuffle=True, seed=0, **kwargs))
        print0(f" {label}")
        print_ranks(f"{mine}")
        everyone = gather(mine)
        flat = [i for part in everyone for i in part]
        if kwargs == {}:
            assert len({len(part) for part in everyone}) == 1, "same count on every rank"
            assert sorted(set(flat)) == dataset and len(flat) == -(-n // p) * p
            # torch's sampler is the same algorithm: the two are interchangeable.
            theirs = list(torch.utils.data.DistributedSampler(dataset, num_replicas=p, rank=rank, shuffle=True, seed=0))
            assert mine == theirs
        elif "drop_last" in kwargs:
            assert len(set(flat)) == len(flat) == (n // p) * p, "cut to a multiple of p, nothing repeated"
        else:
            assert sorted(flat) == dataset, "every sample exactly once"
    extra = -(-n // p) * p - n
    print0(f"checked: padding repeated {extra} sample(s) so all ranks have {-(-n // p)}; drop_last kept {(n // p) * p};")
    print0("         pad=False covered each sample once; the padded order equals torch's DistributedSampler.\n")

    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    forgot = [list(sampler) for epoch in range(2)]
    remembered = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        remembered.append(list(sampler))
    assert forgot[0] == forgot[1], "without set_epoch both epochs read the same order"
    assert remembered[0] != remembered[1], "with set_epoch each epoch has a new order"
    print0("two epochs on rank 0, without and with set_epoch(epoch):")
    print0(f"  without: {forgot[0]} then {forgot[1]}   (same order again)")
    print0(f"  with:    {remembered[0]} then {remembered[1]}\n")

    # A real loader over the synthetic MNIST: the global batch is split.
    global_batch = 16 * p
    loader = minddp_lab.data.make_loader(
        minddp_lab.data.SyntheticMNIST(256, seed=0), global_batch, shuffle=True, seed=0, rank=rank, world_size=p
    )
    images, labels = next(iter(loader))
    assert images.shape[0] == global_batch // p
    print0(f"make_loader(global_batch_size={global_batch}) on {p} ranks: each rank's batch has {images.shape[0]} images\n")

    if forget_set_epoch:
        # A fresh sampler, as a training script builds one: the sampler above
        # was left at epoch 1 by its last set_epoch.
        forgetful = DistributedSampler(dataset, shuffle=True, seed=0)
        epochs_read = []
        for epoch in range(3):  # the training loop, without forgetful.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=forgetful)
            epochs_read.append([i for batch in loader for i in batch.tolist()])
        print0(f"--forget-set-epoch: three epochs of a loop that never calls set_epoch, rank {rank} of {p} read:")
        for epoch, order in enumerate(epochs_read):
            print0(f"  epoch {epoch}: {order}")
        print0(f"  with set_epoch, epoch 1 would have read {remembered[1]}")
        assert epochs_read[0] == remembered[0], f"epoch 0 reads set_epoch(0)'s order: expected {remembered[0]}, saw {epochs_read[0]}"
        assert epochs_read[1] == epochs_read[2] == epochs_read[0], f"every epoch repeats epoch 0's order; saw {epochs_read}"
        print0("checked: without set_epoch every epoch read epoch 0's order again.")
        return
    if rank == 0:
        linear_scaling_experiment(p, lr)


DEFAULT_LR = 0.005


def step_errors(k: int, lr: float) -> tuple[torch.Tensor, float, float]:
    """k steps of batch 64 against one step on all 64k samples, unscaled and scaled:
    the small steps' move, and how far each big step is from it (relative)."""
    torch.manual_seed(0)
    w0 = torch.randn(10)
    x, y = torch.randn(64 * k, 10), torch.randn(64 * k)

    def grad(w, xs, ys):  # of the mean squared error of a linear model
        return 2 * xs.T @ (xs @ w - ys) / len(ys)

    w = w0.clone()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):  # k steps on batches of 64
        w -= lr * grad(w, xb, yb)
    small_steps = w - w0
    same_lr = -lr * grad(w0, x, y)  # one step on 64k samples, lr unchanged
    scaled_lr = -k * lr * grad(w0, x, y)  # one step, lr scaled by k
    err = lambda u: ((u - small_steps).norm() / small_steps.norm()).item()  # noqa: E731
    return small_steps, err(same_lr), err(scaled_lr)


def linear_scaling_experiment(k: int, lr: float = DEFAULT_LR) -> None:
    """k small steps on batches of B, against one big step on the kB samples.

    Why scaling the rate works: with a small learning rate the gradient
    barely changes over k steps, so k steps of size lr each move the weights
    about as far as one step of size k*lr on all the samples together. With
    the *same* lr, the big-batch step moves only 1/k of the way.
    """
    k = max(k, 2)
    small_steps, same_err, scaled_err = step_errors(k, lr)
    print0(f"linear scaling rule, global batch 64 -> {64 * k} (k = {k}):")
    print0(f"  {k} steps of batch 64, lr {lr}            moved the weights by |dw| = {small_steps.norm():.4f}")
    print0(f"  1 step of batch {64 * k}, lr {lr}          differs from that by {same_err:.0%}")
    print0(f"  1 step of batch {64 * k}, lr {k} x {lr} = {k * lr:.3f}  differs by {scaled_err:.0%}")
    if lr == DEFAULT_LR:
        assert scaled_err < 0.1, f"expected the scaled step within 10% of the k small ones, saw {scaled_err:.1%}"
        assert same_err > 0.4, f"expected the unscaled step more than 40% off, saw {same_err:.1%}"
        print0("checked: with the rate scaled by k, one big-batch step does what k small ones did.")
    else:
        _, _, default_err = step_errors(k, DEFAULT_LR)
        print0(f"  (at the default lr {DEFAULT_LR} the scaled step differed by {default_err:.0%})")
        if lr > DEFAULT_LR:
            assert scaled_err > default_err, (
                f"expected a larger rate to match less well: {scaled_err:.1%} at lr {lr}, {default_err:.1%} at lr {DEFAULT_LR}")
            print0(f"checked: at lr {lr} the scaled big step is further from the k small steps than at {DEFAULT_LR}:")
            print0("         the rule holds while the gradient barely changes over the k steps.")
        else:
            print0("checked: the comparison above (a smaller rate than the default only fits better).")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--forget-set-epoch", action="store_true", help="train three epochs without set_epoch")
        parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="learning rate of the scaling experiment")
    args = parse_args(__doc__, extra=options)
    run(main, args.world_size, args.forget_set_epoch, args.lr)
