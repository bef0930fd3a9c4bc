"""Exercise 10 with plain BatchNorm's statistics: this rank's batch only."""

import torch

EXPECT = "this rank's own batch"


def global_mean_and_var(x: torch.Tensor):
    return x.mean(dim=0), x.var(dim=0, correction=0)
