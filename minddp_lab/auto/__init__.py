"""Buckets chosen for the measured link and the first steps' profile: :func:`plan_buckets`.

* :mod:`~minddp_lab.auto.policy`: :func:`plan_buckets` attaches
  :class:`AutoBuckets` to a built MiniDDP, as a policy of its reducer
  (:mod:`minddp.ddp.policies`: an observer, a backward-done callback, rebuilds);
* :mod:`~minddp_lab.auto.planner`: the alpha-beta model that proposes plans,
  replayed by :mod:`minddp_lab.simulate`;
* :mod:`~minddp_lab.auto.trials`: the proposals timed in turn against the default;
* :mod:`~minddp_lab.auto.costs`: what a bucket costs beyond the wire, measured.
"""

from minddp_lab.auto.policy import AutoBuckets, plan_buckets, planner_of

__all__ = ["AutoBuckets", "plan_buckets", "planner_of"]
