"""Exercise 09: the distributed sampler -- which samples each rank reads (lesson 09).

Write ``rank_indices`` below; then, from the repository's root:

    python -m lessons.grade 09

The grader calls it for every rank of several dataset sizes, rank counts and
epochs (no processes needed: a sampler never communicates) and compares with
``torch.utils.data.DistributedSampler``; it also checks that torch's global
random generator is left as it was.
"""


def rank_indices(dataset_size: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> list[int]:
    """The indices of the samples rank ``rank`` reads in epoch ``epoch``, in order.

    * Every rank gets the same number of indices (a rank that runs out early
      would leave the others waiting in an all-reduce).
    * Shuffled: every rank draws the same permutation of range(dataset_size),
      ``torch.randperm`` with a ``torch.Generator`` seeded with
      ``seed + epoch``; not shuffled: range(dataset_size) in order.
    * When ``world_size`` does not divide the size: without ``drop_last``
      pad the list with its own first indices (again from the start, if
      needed) up to the next multiple; with ``drop_last`` cut it to the
      multiple below.
    * Rank r takes every ``world_size``-th index of that list, starting at r.
    """
    raise NotImplementedError
