"""Exercise 09 padding with the list's first indices once: too few when the padding is longer than the list
(2 samples on 5 ranks need 3 more)."""

import torch

EXPECT = "from its start again"


def rank_indices(dataset_size, rank, world_size, epoch=0, seed=0, shuffle=True, drop_last=False):
    if shuffle:
        indices = torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        indices = list(range(dataset_size))
    if drop_last:
        indices = indices[:dataset_size // world_size * world_size]
    else:
        total = -(-dataset_size // world_size) * world_size
        indices += indices[:total - len(indices)]  # once: short when total - len(indices) > len(indices)
    return indices[rank::world_size]
