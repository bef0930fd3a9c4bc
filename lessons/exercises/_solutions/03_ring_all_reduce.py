"""Exercise 03, solved."""

import torch
import torch.distributed as dist


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    out = x.clone()
    chunks = list(out.reshape(-1).tensor_split(p))  # views into out
    for step in range(p - 1):  # reduce-scatter
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        request = dist.isend(chunks[send_i], dst=right)  # not send: every rank sending first would deadlock
        dist.recv(incoming, src=left)
        request.wait()
        chunks[recv_i] += incoming
    for step in range(p - 1):  # all-gather
        send_i, recv_i = (r + 1 - step) % p, (r - step) % p
        request = dist.isend(chunks[send_i], dst=right)
        dist.recv(chunks[recv_i], src=left)
        request.wait()
    return out
