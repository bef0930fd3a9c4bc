"""Exercise 21 returning the reduce-scattered sum instead of the average."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "did you divide by the world size?"
right = load(Path(__file__).resolve().parent.parent / "21_fsdp_unit.py")


class GatherComputeFree(right.GatherComputeFree):
    @staticmethod
    def backward(ctx, grad_out):
        grad_x, average, _ = right.GatherComputeFree.backward(ctx, grad_out)
        return grad_x, average * ctx.unit.world_size, None  # the sum, not the average


class Sharded(right.Sharded):
    def forward(self, x):
        for unit in self.units:
            x = GatherComputeFree.apply(x, unit.shard, unit)
        return x
