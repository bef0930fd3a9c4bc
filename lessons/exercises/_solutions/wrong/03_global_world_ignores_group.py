"""Exercise 03 that uses dist.get_rank()/dist.get_world_size() and the default group for every message, ignoring
the group argument."""

import torch
import torch.distributed as dist

EXPECT = 'sum over all 4 ranks'


def ring_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    p = dist.get_world_size()
    r = dist.get_rank()
    out = x.reshape(-1).clone()
    if p == 1:
        return out.view(x.shape)
    chunks = list(out.tensor_split(p))
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i].contiguous(), dst=right)
        dist.recv(incoming, src=left)
        req.wait()
        chunks[recv_i] += incoming
    for step in range(p - 1):
        send_i, recv_i = (r + 1 - step) % p, (r - step) % p
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i].contiguous(), dst=right)
        dist.recv(incoming, src=left)
        req.wait()
        chunks[recv_i].copy_(incoming)
    return out.view(x.shape)
