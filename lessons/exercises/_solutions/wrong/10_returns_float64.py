"""Exercise 10 computed in float64 (exact enough) but returned in float64 for float32 data: BatchNorm would then
normalize a float32 batch into a float64 one. The statistics must come back in x's dtype."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "dtype"
right = load(Path(__file__).resolve().parent.parent / "10_sync_batchnorm.py")


def global_mean_and_var(x):
    return right.global_mean_and_var(x.double())
