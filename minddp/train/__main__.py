"""``python -m minddp.train``: the same program as ``minddp-train``."""

import sys

from minddp.train.cli import main

sys.exit(main())
