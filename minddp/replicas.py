"""The older name of :mod:`minddp.ddp.replicas` (checking that replicas agree): the very same module.

``from minddp.replicas import check_replicas_in_sync`` keeps working; new
code imports :mod:`minddp.ddp.replicas`.
"""

import sys

from minddp.ddp import replicas

sys.modules[__name__] = replicas
