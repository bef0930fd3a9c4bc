"""Exercise 10 with one all-reduce of each rank's count, sum and sum of squares, in float64 so that the
variance E[x^2] - E[x]^2 loses nothing to cancellation; the statistics go back to x's dtype."""

import torch
import torch.distributed as dist


def global_mean_and_var(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    dtype, x = x.dtype, x.double()
    count = torch.tensor([float(x.shape[0])], dtype=torch.float64)
    totals = torch.cat([count, x.sum(dim=0), (x * x).sum(dim=0)])
    dist.all_reduce(totals, group=group)
    channels = x.shape[1]
    n, sums, squares = totals[0], totals[1:1 + channels], totals[1 + channels:]
    mean = sums / n
    return mean.to(dtype), (squares / n - mean * mean).to(dtype)
