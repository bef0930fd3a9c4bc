"""``minddp.train`` moved to the lab: ``minddp_lab.train`` (the minddp-train program).

The library never imports the lab, so this name cannot stand for the new
one; importing it says where to look instead.
"""

raise ModuleNotFoundError(
    "minddp.train moved to minddp_lab.train (the minddp-train program; python -m minddp_lab.train): import minddp_lab.train instead",
    name=__name__,
)
