"""``minddp.simulate`` moved to the lab: ``minddp_lab.simulate`` (the step-time simulator).

The library never imports the lab, so this name cannot stand for the new
one; importing it says where to look instead.
"""

raise ModuleNotFoundError(
    "minddp.simulate moved to minddp_lab.simulate (the step-time simulator; its command is python -m minddp_lab.simulate): import minddp_lab.simulate instead",
    name=__name__,
)
