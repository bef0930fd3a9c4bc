"""Exercise 09 shuffling with torch's global generator, reseeded with seed + epoch: the right indices, but
every other random draw of the program (dropout, augmentation) now repeats each epoch."""

import torch

EXPECT = "global random generator"


def rank_indices(dataset_size, rank, world_size, epoch=0, seed=0, shuffle=True, drop_last=False):
    if shuffle:
        torch.manual_seed(seed + epoch)
        indices = torch.randperm(dataset_size).tolist()
    else:
        indices = list(range(dataset_size))
    if drop_last:
        indices = indices[:dataset_size // world_size * world_size]
    else:
        total = -(-dataset_size // world_size) * world_size
        while len(indices) < total:
            indices += indices[:total - len(indices)]
    return indices[rank::world_size]
