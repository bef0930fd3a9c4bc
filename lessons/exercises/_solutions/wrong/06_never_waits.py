"""Exercise 06 that divides without waiting for the sums."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "nothing ever waited"
right = load(Path(__file__).resolve().parent.parent / "06_async_overlap.py")
class AsyncAverager(right.AsyncAverager):
    def finish(self) -> None:
        for param, _work in self.pending:
            param.grad /= self.world_size  # the sum may not have arrived yet
        self.pending.clear()
