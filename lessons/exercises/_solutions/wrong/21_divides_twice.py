"""Exercise 21 dividing the reduce-scattered gradient by the world size twice."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "divide by the world size twice"
right = load(Path(__file__).resolve().parent.parent / "21_fsdp_unit.py")
Unit = right.Unit


class GatherComputeFree(right.GatherComputeFree):
    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_shard, _ = right.GatherComputeFree.backward(ctx, grad_out)
        return grad_x, grad_shard / ctx.unit.world_size, None


class Sharded(right.Sharded):  # forward through this file's GatherComputeFree
    def forward(self, x):
        for unit in self.units:
            x = GatherComputeFree.apply(x, unit.shard, unit)
        return x
