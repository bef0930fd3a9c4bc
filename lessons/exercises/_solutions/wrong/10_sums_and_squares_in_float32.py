"""Exercise 10 by sums and sums of squares, in the data's float32: the variance is E[x^2] - E[x]^2, a difference
of two large numbers when the data's mean is large against its spread, and float32 keeps too few digits of
either (lesson 10's Chan combination of counts, means and M2 does not subtract them)."""

import torch
import torch.distributed as dist

EXPECT = "cancel"


def global_mean_and_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    count = torch.tensor([float(x.shape[0])])
    totals = torch.cat([count, x.sum(dim=0), (x * x).sum(dim=0)])
    dist.all_reduce(totals)
    channels = x.shape[1]
    n, sums, squares = totals[0], totals[1:1 + channels], totals[1 + channels:]
    mean = sums / n
    return mean, squares / n - mean * mean
