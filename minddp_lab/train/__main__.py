"""``python -m minddp_lab.train``: the same program as ``minddp-train``."""

import sys

from minddp_lab.train.cli import main

sys.exit(main())
