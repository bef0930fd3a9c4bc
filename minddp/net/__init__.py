"""Networks: a model of one, real shaped links to measure on, and the bucket planner that uses both.

* :mod:`~minddp.net.network`: a network's figures (latency, bandwidth, GPUs
  and NICs per node), the simulator's and the planner's;
* :mod:`~minddp.net.links`, :mod:`~minddp.net.link_hosts`: real links between
  network namespaces, shaped to a rate (``spawn(..., link="1gbit")``);
* :mod:`~minddp.net.simulated_link`: a link's delay added in the process;
* :mod:`~minddp.net.auto_buckets`: ``bucket_cap_mb="auto"``, buckets chosen
  for the measured link and the first steps' profile: proposed by the model
  of :mod:`~minddp.net.bucket_planner`, timed in turn by
  :mod:`~minddp.net.plan_trials`; :mod:`~minddp.net.bucket_costs`: what a
  bucket costs beyond the wire.
"""
