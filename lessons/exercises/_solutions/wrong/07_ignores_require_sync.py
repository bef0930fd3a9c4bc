"""Exercise 07 whose hook and finish() ignore require_sync: it sends every bucket on every micro-batch."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "require_sync False"

right = load(Path(__file__).resolve().parent.parent / "07_buckets.py")


class BucketAverager(right.BucketAverager):
    def _on_gradient(self, param) -> None:
        require_sync, self.require_sync = self.require_sync, True  # as if it were always True
        super()._on_gradient(param)
        self.require_sync = require_sync

    def finish(self) -> None:
        require_sync, self.require_sync = self.require_sync, True
        super().finish()
        self.require_sync = require_sync
