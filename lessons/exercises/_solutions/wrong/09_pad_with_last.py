"""Exercise 09 that pads with the list's last indices instead of its first ones."""

EXPECT = 'the padding is not'


def rank_indices(dataset_size: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> list[int]:
    import torch
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(dataset_size, generator=g).tolist()
    else:
        indices = list(range(dataset_size))
    if drop_last:
        total = dataset_size - dataset_size % world_size
        indices = indices[:total]
    else:
        total = -(-dataset_size // world_size) * world_size
        pad = total - dataset_size
        if pad:
            indices += indices[-pad:]
    return indices[rank::world_size]
