"""``minddp.net`` moved to the lab, split by job.

The library never imports the lab, so this name cannot stand for the new
ones; importing it says where to look instead.
"""

raise ModuleNotFoundError(
    "minddp.net moved to the lab, split by job: minddp_lab.network (the alpha-beta model), "
    "minddp_lab.simulated_link, minddp_lab.links (real shaped links: namespaces, hosts, probe) and "
    "minddp_lab.auto (the bucket planner, minddp_lab.auto.plan_buckets): import those instead",
    name=__name__,
)
