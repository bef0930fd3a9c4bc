"""``minddp.observe.trace_view`` moved to the lab: ``minddp_lab.trace_view`` (reading a trace back, drawing it).

The library never imports the lab (nor matplotlib, which drawing needs), so
this name cannot stand for the new one; importing it says where to look instead.
"""

raise ModuleNotFoundError(
    "minddp.observe.trace_view moved to minddp_lab.trace_view (reading MiniDDP's Chrome trace back and "
    "drawing its overlap): import minddp_lab.trace_view instead",
    name=__name__,
)
