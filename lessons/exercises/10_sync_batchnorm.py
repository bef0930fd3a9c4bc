"""Exercise 10: SyncBatchNorm's forward statistics -- the global batch's mean and variance (lesson 10).

Write ``global_mean_and_var`` below; then, from the repository's root:

    python -m lessons.grade 10

The grader gives each of 3 ranks a batch of its own size (2, 5 and 8
samples), shifted differently, and compares with the mean and variance of all
the samples together in one process; then again with every sample shifted by
10^4, a mean large against the spread, where a formula that subtracts two
large numbers in float32 loses the variance; then one sample on a rank, a
non-contiguous batch and a float64 one; at 4 ranks also within two groups of 2
(ranks 0 and 2, ranks 1 and 3), each over its own ranks' samples.
"""

import torch
import torch.distributed as dist


def global_mean_and_var(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the mean and the variance of the batch formed by every rank's ``x`` of ``group`` together.

    ``group`` is a process group of some of the ranks, or ``None`` for every
    rank (as ``torch.nn.SyncBatchNorm``'s ``process_group``): pass it to every
    collective you call (``group=group``), and count its ranks with
    ``dist.get_world_size(group)``.

    ``x`` is this rank's batch, shape (n, C); n may differ from rank to rank.
    The variance is the biased one BatchNorm normalizes with (divided by the
    total count, not count - 1). Every rank returns the same two tensors of
    shape (C,), in ``x``'s dtype; ``x`` is left unchanged.
    """
    raise NotImplementedError
