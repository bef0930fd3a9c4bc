"""Exercise 03 whose reduce-scatter takes p - 2 steps instead of p - 1: no chunk is finished when the all-gather
starts, so every rank ends with each chunk summed over only p - 1 ranks. Its grade must say the reduce-scatter
stopped early, not that the all-gather is missing."""

import torch
import torch.distributed as dist

EXPECT = "stopped a step early"


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    out = x.clone()
    chunks = list(out.reshape(-1).tensor_split(p))
    for step in range(p - 2):  # one step short
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        request = dist.isend(chunks[send_i], dst=right)
        dist.recv(incoming, src=left)
        request.wait()
        chunks[recv_i] += incoming
    for step in range(p - 1):  # all-gather, as the reference's
        send_i, recv_i = (r + 1 - step) % p, (r - step) % p
        request = dist.isend(chunks[send_i], dst=right)
        dist.recv(chunks[recv_i], src=left)
        request.wait()
    return out
