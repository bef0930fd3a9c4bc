"""Run one of accelerate's own test scripts with torch's DDP or with MiniDDP swapped in, as a user would.

    python -m torch.distributed.run --nproc_per_node 2 tests/frameworks/accelerate_run.py {torch|minddp} SCRIPT

``minddp``: :func:`minddp.frameworks.accelerate.use_minddp` first (``docs/frameworks.md``), then the
script, unmodified, as ``__main__``. On CPU, ``ACCELERATE_USE_CPU=1`` makes accelerate use Gloo.
"""

import runpy
import sys

import torch

torch.set_num_threads(1)

if __name__ == "__main__":
    which, script = sys.argv[1], sys.argv[2]
    if which == "minddp":
        from minddp.frameworks.accelerate import use_minddp

        use_minddp()
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
