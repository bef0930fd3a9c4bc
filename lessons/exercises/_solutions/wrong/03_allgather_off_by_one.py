"""Exercise 03 that off by one in the all-gather phase: sends chunk (r - s) instead of the finished chunk (r + 1
- s), so stale partial sums are passed on."""

import torch
import torch.distributed as dist

EXPECT = 'the all-gather passed on chunks that were not finished'


def ring_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    p = dist.get_world_size(group)
    r = dist.get_rank(group)
    out = x.reshape(-1).clone()
    if p == 1:
        return out.view(x.shape)
    chunks = list(out.tensor_split(p))
    world = group if group is not None else dist.group.WORLD
    right, left = dist.get_global_rank(world, (r + 1) % p), dist.get_global_rank(world, (r - 1) % p)
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i].contiguous(), dst=right, group=group)
        dist.recv(incoming, src=left, group=group)
        req.wait()
        chunks[recv_i] += incoming
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i].contiguous(), dst=right, group=group)
        dist.recv(incoming, src=left, group=group)
        req.wait()
        chunks[recv_i].copy_(incoming)
    return out.view(x.shape)
