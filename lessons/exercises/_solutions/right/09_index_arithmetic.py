"""Exercise 09, another way: no list repetition: the padded/cut list is virtual; rank r's j-th index is base[(r +
j*world_size) % n] for the total length computed arithmetically."""

import torch


def rank_indices(dataset_size: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> list[int]:
    n = dataset_size
    if drop_last:
        per_rank = n // world_size
    else:
        per_rank = -(-n // world_size)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        base = torch.randperm(n, generator=g).tolist()
    else:
        base = None
    out = []
    for j in range(per_rank):
        pos = (rank + j * world_size) % n  # position in the padded list; padding restarts at 0
        out.append(base[pos] if base is not None else pos)
    return out
