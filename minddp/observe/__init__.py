"""Watching a step without changing it: the reducer's observers and what reads them.

* :mod:`~minddp.observe.trace`: a step's timeline (``timeline=True``), the
  Chrome trace, the profiler's ranges;
* :mod:`~minddp.observe.trace_view`: draws a trace's overlap of backward and
  communication;
* :mod:`~minddp.observe.follow`: ``model.follow(name)``, one gradient from
  its hook to its ``.grad``.
"""
