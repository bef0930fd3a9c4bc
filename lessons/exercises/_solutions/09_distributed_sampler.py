"""Exercise 09, solved."""

import torch


def rank_indices(dataset_size: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> list[int]:
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        indices = torch.randperm(dataset_size, generator=generator).tolist()
    else:
        indices = list(range(dataset_size))
    if drop_last:
        indices = indices[:dataset_size // world_size * world_size]
    else:
        total = -(-dataset_size // world_size) * world_size
        while len(indices) < total:
            indices += indices[:total - len(indices)]
    return indices[rank::world_size]
