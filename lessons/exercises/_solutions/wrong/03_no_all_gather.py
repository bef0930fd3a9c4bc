"""Exercise 03 stopping after the reduce-scatter: each rank holds one finished chunk only."""

import torch
import torch.distributed as dist

EXPECT = "the all-gather must hand every finished chunk"


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    p, r = dist.get_world_size(), dist.get_rank()
    out = x.clone()
    chunks = list(out.reshape(-1).tensor_split(p))
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        request = dist.isend(chunks[send_i], dst=(r + 1) % p)
        dist.recv(incoming, src=(r - 1) % p)
        request.wait()
        chunks[recv_i] += incoming
    return out  # the all-gather forgotten
