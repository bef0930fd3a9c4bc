"""Exercise 06 that forgets the division."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "did you divide by the world size?"
right = load(Path(__file__).resolve().parent.parent / "06_async_overlap.py")
class AsyncAverager(right.AsyncAverager):
    def finish(self) -> None:
        for _param, work in self.pending:
            work.wait()
        self.pending.clear()
