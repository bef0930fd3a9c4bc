"""Exercise 03 as a parameter server: the right sum, but rank 0 carries all the traffic."""

import torch
import torch.distributed as dist

EXPECT = "a parameter server"


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    p, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        total = x.clone()
        for src in range(1, p):
            incoming = torch.empty_like(x)
            dist.recv(incoming, src=src)
            total += incoming
        for dst in range(1, p):
            dist.send(total, dst=dst)
        return total
    dist.send(x, dst=0)
    total = torch.empty_like(x)
    dist.recv(total, src=0)
    return total
