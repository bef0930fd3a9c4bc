"""MiniDDP inside the frameworks people train with (``docs/frameworks.md``).

* :mod:`minddp.frameworks.lightning`: ``MiniDDPStrategy``, a Lightning ``DDPStrategy`` whose model is a MiniDDP;
* :mod:`minddp.frameworks.accelerate`: ``use_minddp()``, after which accelerate wraps models in MiniDDP.

Each imports its framework only when imported itself: ``pip install -e ".[frameworks]"``
from a clone of the repository (minddp is on no package registry).
"""
