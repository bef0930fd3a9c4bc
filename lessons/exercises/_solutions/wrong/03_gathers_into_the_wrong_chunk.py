"""Exercise 03 whose all-gather stores each chunk it receives one place off, at (r - step - 1) mod p instead of
(r - step): finished chunks land where other chunks belong. Its grade must name the misplaced chunks, not say
that a chunk was never handed on."""

import torch
import torch.distributed as dist

EXPECT = "where chunk"


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    out = x.clone()
    chunks = list(out.reshape(-1).tensor_split(p))
    for step in range(p - 1):  # reduce-scatter, as the reference's
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        request = dist.isend(chunks[send_i], dst=right)
        dist.recv(incoming, src=left)
        request.wait()
        chunks[recv_i] += incoming
    for step in range(p - 1):
        send_i, recv_i = (r + 1 - step) % p, (r - step - 1) % p  # one place off
        request = dist.isend(chunks[send_i], dst=right)
        dist.recv(chunks[recv_i], src=left)
        request.wait()
    return out
