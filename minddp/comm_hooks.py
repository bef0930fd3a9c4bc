"""The older name of :mod:`minddp.ddp.default_hooks` (torch's name for the file): the very same module.

``from minddp import comm_hooks`` and ``from minddp.comm_hooks import
allreduce_hook`` keep working; new code imports :mod:`minddp.ddp.default_hooks`.
"""

import sys

from minddp.ddp import default_hooks

sys.modules[__name__] = default_hooks
