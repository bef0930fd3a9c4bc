"""Exercise 09 giving each rank a contiguous block: valid sharding, not torch's."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "split them differently"
right = load(Path(__file__).resolve().parent.parent / "09_distributed_sampler.py")
def rank_indices(dataset_size, rank, world_size, epoch=0, seed=0, shuffle=True, drop_last=False):
    everyone = [i for r in range(world_size)
                for i in right.rank_indices(dataset_size, r, world_size, epoch, seed, shuffle, drop_last)]
    per_rank = len(everyone) // world_size
    return sorted(everyone)[rank * per_rank:(rank + 1) * per_rank] if not shuffle else \
        everyone[rank * per_rank:(rank + 1) * per_rank]
