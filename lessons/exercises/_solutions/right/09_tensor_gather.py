"""Exercise 09, another way: tensor ops: positions rank + world_size * arange(total // world_size) taken modulo n
index into the generator's randperm (or arange); .tolist() at the end."""

def rank_indices(dataset_size: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> list[int]:
    import torch
    total = (dataset_size // world_size) * world_size if drop_last else -(-dataset_size // world_size) * world_size
    if shuffle:
        order = torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(dataset_size)
    positions = rank + world_size * torch.arange(total // world_size, dtype=torch.long)
    return order[positions % dataset_size].tolist()
