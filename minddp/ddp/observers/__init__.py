"""Watching a step without changing it: the reducer's observers and what reads them.

* :mod:`~minddp.ddp.observers.trace`: a step's timeline (``timeline=True``), the
  Chrome trace, the profiler's ranges;
* :mod:`~minddp.ddp.observers.follow`: ``model.follow(name)``, one gradient from
  its hook to its ``.grad``.

Reading a trace back and drawing it is the lab's (:mod:`minddp_lab.trace_view`).
"""
