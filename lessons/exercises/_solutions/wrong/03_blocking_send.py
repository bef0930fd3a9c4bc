"""Exercise 03 with a plain, blocking send before the recv: every rank waits for its neighbour."""

import torch
import torch.distributed as dist

EXPECT = "a deadlock"


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    p, r = dist.get_world_size(), dist.get_rank()
    out = x.clone()
    chunks = list(out.reshape(-1).tensor_split(p))
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        dist.send(chunks[send_i], dst=(r + 1) % p)  # waits for the right neighbour's recv, which never comes
        dist.recv(incoming, src=(r - 1) % p)
        chunks[recv_i] += incoming
    return out
