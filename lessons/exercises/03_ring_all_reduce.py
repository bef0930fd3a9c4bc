"""Exercise 03: the ring all-reduce, from send and recv (lesson 03).

Write ``ring_all_reduce`` below; then, from the repository's root:

    python -m lessons.grade 03

The grader runs it on 3 Gloo ranks (then on 2, 4 and 1), on float32 tensors of shapes (12,), (7,),
(4, 5), (2,) and (1,) -- 3 divides only the first; the last two have fewer
numbers than ranks -- a transposed (4, 5) view (not contiguous) and a float16
one of shape (7,); at 4 ranks also within two groups of 2 (ranks 0 and 2, ranks
1 and 3), each summing its own. It checks three things: the result is
``dist.all_reduce``'s sum, in x's dtype and shape; only point-to-point messages
carried it; no rank sent more numbers than a ring does. A ring's rank sends
2 (p - 1) of the p chunks, all but two, about 2 (p - 1) / p of the tensor; the
grader allows the uneven chunks that ``tensor_split`` cuts, of the flattened
tensor or along dim 0 (as lesson 03 does): for (4, 5) on 3 ranks, 30 of the 40
numbers two whole tensors would be.
"""

import torch
import torch.distributed as dist


def ring_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Return the sum of ``x`` over the ranks of ``group``, computed around a ring; leave ``x`` unchanged.

    ``group`` is a process group of some of the ranks (``dist.new_group``), or
    ``None`` for every rank, as for ``dist.all_reduce(x, group=group)``. Inside
    it the ranks are numbered 0 .. p - 1 (``dist.get_rank(group)``,
    ``dist.get_world_size(group)``), while ``dst`` and ``src`` of send and recv
    take the world's numbers: pass ``group=group`` with ``group_dst=`` /
    ``group_src=`` (the peer's number in the group), or translate with
    ``dist.get_global_rank(group or dist.group.WORLD, r)``. ``x`` may be of any
    shape and floating dtype, as short as one number, and not contiguous (a
    transposed view); messages go from contiguous tensors.

    Only point-to-point messages (``dist.send``, ``dist.recv``, ``dist.isend``,
    ``dist.irecv``, or ``dist.batch_isend_irecv``): no collective. Rank r
    sends to rank r + 1 and receives from rank r - 1 (modulo p). Cut the
    tensor into p chunks (``tensor_split``, of ``x.reshape(-1)`` or along
    dim 0), then:

    1. reduce-scatter, p - 1 steps: at step s send chunk (r - s) mod p and add
       the chunk (r - s - 1) mod p that arrives to your own. After it, rank r
       holds the finished sum of chunk (r + 1) mod p;
    2. all-gather, p - 1 steps: pass the finished chunks on; an arriving chunk
       replaces yours.

    Each rank sends 2 (p - 1) chunks in all: 2 (p - 1) / p of the tensor's
    numbers when p divides them, a little more or less when it does not.
    """
    raise NotImplementedError
