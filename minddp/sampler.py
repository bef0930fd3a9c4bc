"""Which samples each rank reads: a distributed sampler written out in full.

Data parallelism only works if the ranks read *different* samples, and if
they all take the same number of steps (a rank that runs out early leaves the
others waiting in an all-reduce forever). :class:`DistributedSampler` gives
both, and it yields exactly the indices that
``torch.utils.data.distributed.DistributedSampler`` yields, so the two can be
swapped freely. One epoch, step by step::

    order   = randperm(N) from a generator seeded with seed + epoch   (or 0..N-1)
    order   = order padded by repeating its front to a multiple of R  (default)
            | order cut down to a multiple of R                        (drop_last)
    rank r  = order[r], order[r + R], order[r + 2R], ...               (striding)

Every rank draws the same permutation (same seed, same epoch), so no
communication is needed: each one simply keeps its own stride of it.

Padding repeats a few samples, which is harmless in training but skews
evaluation: a validation accuracy that counts some images twice is not the
accuracy of the validation set. ``pad=False`` is the evaluation mode: every
sample is yielded exactly once across all ranks, and ranks may then hold
lengths that differ by one. Combine per-rank sums and counts with an
all-reduce (not per-rank means) to get exact metrics.
"""

from __future__ import annotations

import math
from typing import Iterator, Sized

import torch
import torch.distributed as dist

__all__ = ["DistributedSampler"]


def _world_from_group() -> tuple[int, int] | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


class DistributedSampler(torch.utils.data.Sampler[int]):
    """Yield this rank's share of ``range(len(dataset))`` for one epoch.

    Args:
        dataset: anything with ``len()``.
        num_replicas: how many ranks share the data; default: the world size
            of the initialized default process group.
        rank: this rank, in ``[0, num_replicas)``; default: the rank in the
            default process group.
        shuffle: shuffle with ``torch.randperm`` seeded by ``seed + epoch``.
        seed: must be the same on every rank.
        drop_last: cut the tail so the data divides evenly instead of padding.
        pad: repeat samples so every rank gets the same count (torch's
            behaviour, needed for training). ``pad=False``: every sample
            exactly once across ranks (evaluation); it cannot be combined with
            ``drop_last=True``, which drops samples.

    Call :meth:`set_epoch` at the start of every epoch; without it every epoch
    repeats the same order.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        if num_replicas is None or rank is None:
            found = _world_from_group()
            if found is None:
                raise ValueError(
                    f"DistributedSampler got num_replicas={num_replicas!r} and rank={rank!r}, "
                    "and no process group is initialized to fill in the missing value: "
                    "pass both num_replicas (an int >= 1) and rank (an int in [0, num_replicas)), "
                    "or call torch.distributed.init_process_group first"
                )
            if num_replicas is None:
                num_replicas = found[0]
            if rank is None:
                rank = found[1]
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank must be an int in [0, {num_replicas}) for num_replicas={num_replicas}, got {rank!r}"
            )
        if not pad and drop_last:
            raise ValueError(
                "pad=False (every sample exactly once) and drop_last=True (drop the tail) contradict "
                "each other: use pad=False, drop_last=False for evaluation, or pad=True for training"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0

        n = len(dataset)
        if not pad:
            # Striding n indices over R ranks: the first n % R ranks get one more.
            self.num_samples = n // num_replicas + (1 if rank < n % num_replicas else 0)
            self.total_size = n
        else:
            if drop_last:
                per_rank = n // num_replicas  # largest multiple of R that fits
            else:
                per_rank = math.ceil(n / num_replicas)
            # With n == 0 nothing can be padded: every rank gets nothing.
            self.num_samples = per_rank if n > 0 else 0
            self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order :meth:`__iter__` yields (same on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, n: int) -> list[int]:
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        order = self._order(n)
        if self.pad and n > 0:
            if self.total_size > n:
                # Tile the order until it is long enough, then cut: this is
                # "repeat from the front", also when padding exceeds n (R > n).
                repeats = math.ceil(self.total_size / n)
                order = (order * repeats)[: self.total_size]
            else:
                order = order[: self.total_size]
        mine = order[self.rank : self.total_size : self.num_replicas]
        assert len(mine) == self.num_samples, (len(mine), self.num_samples)
        return iter(mine)
