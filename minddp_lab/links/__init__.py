"""Real network links between the ranks of one machine, and a probe of a link.

* :mod:`~minddp_lab.links.namespaces`: one network namespace per rank, joined by
  links shaped to a rate;
* :mod:`~minddp_lab.links.spawning`: :func:`spawn` (``link="1gbit"``), the
  library's spawn with each rank inside its namespace;
* :mod:`~minddp_lab.links.hosts`: networks that outlive a command
  (``python -m minddp_lab.links.hosts up 2 --rate 1gbit``), to launch by hand;
* :mod:`~minddp_lab.links.probe`: all-reduces through a reducer's own path,
  timed and fitted to a latency and a bandwidth.
"""

from minddp_lab.links.spawning import spawn

__all__ = ["spawn"]
