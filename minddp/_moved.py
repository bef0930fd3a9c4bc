"""Names that left the library (most for the lab), and the error that says where each went.

The lab (``minddp_lab``) imports the library, never the reverse, so an old
name cannot stand for its new module. Instead :class:`MovedToTheLab`, first
on ``sys.meta_path``, turns ``import minddp.simulate`` and the like into a
``ModuleNotFoundError`` that names the new place. (First: an editable install
of an older checkout would otherwise still find the old files.) Older names of modules still in the library are
plain aliases (``minddp/comm_hooks.py``, ``minddp/replicas.py``).
"""

from __future__ import annotations

import importlib.abc
import sys

__all__ = ["MOVED", "MovedToTheLab", "install"]

MOVED = {
    "minddp.observe": "minddp.ddp.observers (the observers live beside the reducer they watch; reading a trace "
                      "back and drawing it is the lab's minddp_lab.trace_view)",
    "minddp.simulate": "minddp_lab.simulate (the step-time simulator; python -m minddp_lab.simulate)",
    "minddp.net": "minddp_lab.network (the alpha-beta model), minddp_lab.simulated_link, minddp_lab.links "
                  "(real shaped links: namespaces, hosts, probe) and minddp_lab.auto (the bucket planner)",
    "minddp.train": "minddp_lab.train (the minddp-train program)",
    "minddp.models": "minddp_lab.models (the examples' models)",
    "minddp.data": "minddp_lab.data (the examples' MNIST)",
    "minddp.launch.rank_pool": "minddp_lab.rank_pool (the tests' live ranks)",
    "minddp.observe.trace_view": "minddp_lab.trace_view (a trace read back and drawn)",
}


class MovedToTheLab(importlib.abc.MetaPathFinder):
    """Finds no module: for a moved name, or one below it, raises an error naming where it went."""

    def find_spec(self, fullname: str, path=None, target=None):
        for old in sorted(MOVED, key=len, reverse=True):  # the most precise name first
            if fullname == old or fullname.startswith(old + "."):
                raise ModuleNotFoundError(f"{fullname}: {old} moved to {MOVED[old]}", name=fullname)
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once."""
    if not any(isinstance(finder, MovedToTheLab) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedToTheLab())
