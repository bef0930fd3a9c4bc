"""Exercise 19 that builds a fresh inner optimizer for the shard at every step, so AdamW's moments and step count
restart each time (SGD without state still matches)."""

import torch
import torch.distributed as dist

EXPECT = 'made anew at every step'


class ShardedOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.piece = -(-self.numel // self.world_size)  # elements per rank; the last piece is padded
        self.shard = self.my_piece(torch.cat([p.detach().reshape(-1) for p in self.params])).clone()
        self.optimizer = optimizer_class([self.shard], **defaults)  # its state: the size of the shard

    def my_piece(self, flat: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(flat, (0, self.piece * self.world_size - self.numel))
        return padded[self.rank * self.piece:(self.rank + 1) * self.piece]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.shard.grad = self.my_piece(torch.cat([p.grad.reshape(-1) for p in self.params])).clone()
        self.optimizer = type(self.optimizer)([self.shard], lr=self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        everyone = torch.empty(self.piece * self.world_size)
        dist.all_gather_into_tensor(everyone, self.shard.detach())

        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(everyone[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
