"""``minddp.data`` moved to the lab: ``minddp_lab.data`` (the examples' MNIST data).

The library never imports the lab, so this name cannot stand for the new
one; importing it says where to look instead.
"""

raise ModuleNotFoundError(
    "minddp.data moved to minddp_lab.data (the examples' MNIST data): import minddp_lab.data instead",
    name=__name__,
)
