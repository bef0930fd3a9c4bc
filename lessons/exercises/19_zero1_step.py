"""Exercise 19: ZeRO stage 1 -- step only this rank's shard of the optimizer state (lesson 19).

``__init__`` is written for you: it lays the parameters end to end, cuts the
line into one equal piece per rank, and gives the inner optimizer this rank's
piece only. Write ``step``; then, from the repository's root:

    python -m lessons.grade 19

The grader trains the lessons' bench model for 3 steps on 3 ranks (then 2, 4 and 1)
(averaging the gradients itself before every ``step``) and compares the
parameters with the plain optimizer stepping all of them: first SGD, whose
step shows a gradient of the wrong scale, then AdamW. It also weighs the
optimizer state each rank keeps (in every optimizer your object holds): no
more than AdamW's state for this rank's piece, the memory ZeRO-1 saves.
"""

import torch
import torch.distributed as dist


class ShardedOptimizer:
    """An optimizer whose state covers only this rank's 1/N of the parameters' elements."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.piece = -(-self.numel // self.world_size)  # elements per rank; the last piece is padded
        self.shard = self.my_piece(torch.cat([p.detach().reshape(-1) for p in self.params])).clone()
        self.optimizer = optimizer_class([self.shard], **defaults)  # its state: the size of the shard

    def my_piece(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a flat tensor of ``self.numel`` elements (padded with zeros to N pieces)."""
        padded = torch.nn.functional.pad(flat, (0, self.piece * self.world_size - self.numel))
        return padded[self.rank * self.piece:(self.rank + 1) * self.piece]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Update every parameter, keeping optimizer state for this rank's piece only.

        Every ``p.grad`` already holds the gradient averaged over the ranks.
        Step this rank's piece of the elements with ``self.optimizer``; then
        every rank must end with every parameter updated, bit for bit the same
        on every rank and as plain AdamW stepping all of them. On the way a
        rank may lay the gradients end to end, pad that line, and gather the
        updated pieces into one line, but the tensors ``step`` makes may at no
        moment hold more than those three lines and a few pieces (the grader
        follows every one of them).
        """
        raise NotImplementedError
