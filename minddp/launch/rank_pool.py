"""``minddp.launch.rank_pool`` moved to the lab: ``minddp_lab.rank_pool`` (the tests' harness of live ranks).

The library never imports the lab, so this name cannot stand for the new
one; importing it says where to look instead.
"""

raise ModuleNotFoundError(
    "minddp.launch.rank_pool moved to minddp_lab.rank_pool (the tests' harness of live ranks): import minddp_lab.rank_pool instead",
    name=__name__,
)
