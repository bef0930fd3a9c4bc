"""Exercise 03: the ring all-reduce, from send and recv (lesson 03).

Write ``ring_all_reduce`` below; then, from the repository's root:

    python -m lessons.grade 03

The grader runs it on 3 Gloo ranks, on tensors of several sizes (some that 3
does not divide), compares with ``dist.all_reduce``, and counts the numbers
each rank sends.
"""

import torch
import torch.distributed as dist


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Return the sum of ``x`` over all ranks, computed around a ring; leave ``x`` unchanged.

    Only point-to-point messages (``dist.send``, ``dist.recv``, ``dist.isend``,
    ``dist.irecv``): no collective. Rank r sends to rank r + 1 and receives
    from rank r - 1 (modulo p). Cut the tensor into p chunks
    (``tensor_split``), then:

    1. reduce-scatter, p - 1 steps: at step s send chunk (r - s) mod p and add
       the chunk (r - s - 1) mod p that arrives to your own. After it, rank r
       holds the finished sum of chunk (r + 1) mod p;
    2. all-gather, p - 1 steps: pass the finished chunks on; an arriving chunk
       replaces yours.

    Each rank sends 2 (p - 1) / p of the tensor's numbers in all.
    """
    raise NotImplementedError
