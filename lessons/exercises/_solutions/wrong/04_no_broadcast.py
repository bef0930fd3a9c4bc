"""Exercise 04 without the broadcast: every rank trains from its own start."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "nothing was broadcast"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
average_gradients = right.average_gradients


def broadcast_parameters(module) -> None:
    pass  # forgotten
