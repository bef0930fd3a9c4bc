"""``minddp.models`` moved to the lab: ``minddp_lab.models`` (the examples' models).

The library never imports the lab, so this name cannot stand for the new
one; importing it says where to look instead.
"""

raise ModuleNotFoundError(
    "minddp.models moved to minddp_lab.models (the examples' models): import minddp_lab.models instead",
    name=__name__,
)
