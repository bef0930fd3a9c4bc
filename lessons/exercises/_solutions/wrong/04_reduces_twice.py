"""Exercise 04 that all-reduces every gradient twice a step: the average of equal averages is right, the cost is
twice the all-reduce's."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "twice"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    right.average_gradients(module)
    right.average_gradients(module)  # "to be sure": every rank already holds the average
