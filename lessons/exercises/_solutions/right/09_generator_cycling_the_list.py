"""Exercise 09 as a generator: the padding taken by cycling over the list (``itertools.cycle``), and the
rank's indices yielded one by one."""

import itertools

import torch


def rank_indices(dataset_size, rank, world_size, epoch=0, seed=0, shuffle=True, drop_last=False):
    if shuffle:
        indices = torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        indices = list(range(dataset_size))
    if drop_last:
        total = dataset_size - dataset_size % world_size
    else:
        total = -(-dataset_size // world_size) * world_size
    yield from itertools.islice(itertools.cycle(indices), rank, total, world_size)
