"""Exercise 10, another way: shifted-data sums: broadcast group rank 0's first sample as a pivot K, then
all_reduce (count, sum(x-K), sum((x-K)^2)); var = E[d^2] - E[d]^2 is safe since d is centred near 0."""

import torch
import torch.distributed as dist


def global_mean_and_var(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    xs = x.detach()
    n, C = xs.shape
    src = 0 if group is None else dist.get_global_rank(group, 0)
    pivot = xs[0].clone() if dist.get_rank(group) == 0 else torch.empty(C, dtype=xs.dtype)
    dist.broadcast(pivot, src=src, group=group)
    d = xs - pivot
    packed = torch.cat([torch.tensor([float(n)], dtype=xs.dtype), d.sum(0), (d * d).sum(0)])
    dist.all_reduce(packed, group=group)
    count, s1, s2 = packed[0], packed[1:1 + C], packed[1 + C:]
    md = s1 / count
    var = (s2 / count - md * md).clamp_min(0)
    return pivot + md, var
