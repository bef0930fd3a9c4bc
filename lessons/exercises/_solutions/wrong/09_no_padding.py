"""Exercise 09 without padding: the ranks get different counts."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "every rank must get the same number"
right = load(Path(__file__).resolve().parent.parent / "09_distributed_sampler.py")
import torch  # noqa: E402


def rank_indices(dataset_size, rank, world_size, epoch=0, seed=0, shuffle=True, drop_last=False):
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    indices = torch.randperm(dataset_size, generator=generator).tolist() if shuffle else list(range(dataset_size))
    return indices[rank::world_size]
