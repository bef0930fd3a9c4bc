"""Exercise 10 with the right mean but the variance averaged over the ranks (count-weighted)."""

import torch
import torch.distributed as dist

EXPECT = "misses the spread between the ranks' means"


def global_mean_and_var(x: torch.Tensor):
    n = torch.tensor([float(x.shape[0])])
    sums = torch.cat([n, x.sum(dim=0), x.shape[0] * x.var(dim=0, correction=0)])
    dist.all_reduce(sums)
    C = x.shape[1]
    return sums[1:1 + C] / sums[0], sums[1 + C:] / sums[0]
