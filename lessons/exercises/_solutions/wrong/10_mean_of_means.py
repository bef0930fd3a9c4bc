"""Exercise 10 averaging the ranks' means and variances, as if every rank had as many samples."""

import torch
import torch.distributed as dist

EXPECT = "weight each rank's mean by its count"


def global_mean_and_var(x: torch.Tensor):
    p = dist.get_world_size()
    mean, var = x.mean(dim=0), x.var(dim=0, correction=0)
    dist.all_reduce(mean)
    dist.all_reduce(var)
    return mean / p, var / p
