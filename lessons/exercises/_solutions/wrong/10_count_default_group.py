"""Exercise 10 that passes group= to the sum all-reduces but all-reduces the sample count over the default group,
so inside a subgroup the count covers every rank."""

import torch
import torch.distributed as dist

EXPECT = 'for the group given'


def global_mean_and_var(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n, C = x.shape
    count = torch.tensor([float(n)], dtype=x.dtype)
    dist.all_reduce(count)
    s = x.sum(0)
    dist.all_reduce(s, group=group)
    mean = s / count
    sq = ((x - mean) ** 2).sum(0)
    dist.all_reduce(sq, group=group)
    return mean, sq / count
