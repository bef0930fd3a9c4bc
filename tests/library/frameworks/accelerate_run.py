"""Run one of accelerate's own test scripts with torch's DDP or with MiniDDP swapped in, as a user would.

    python -m torch.distributed.run --nproc_per_node 2 tests/library/frameworks/accelerate_run.py {torch|minddp} SCRIPT [--cpu]

``minddp``: :func:`minddp.frameworks.accelerate.use_minddp` first (``docs/frameworks.md``), then the
script, unmodified, as ``__main__``. On CPU, ``ACCELERATE_USE_CPU=1`` makes accelerate use Gloo.
``--cpu``: for a script written for GPUs that builds its own reference DDP with ``device_ids=[rank]``
(``test_ddp_comm_hook.py``), which torch's DDP refuses for a CPU module: those two arguments are
dropped, whichever DDP is in use; nothing else changes.
"""

import os
import runpy
import sys

import torch

torch.set_num_threads(1)

if __name__ == "__main__":
    which, script = sys.argv[1], sys.argv[2]
    if which == "minddp":
        from minddp.frameworks.accelerate import use_minddp

        use_minddp()
    if "--cpu" in sys.argv[3:]:
        chosen = torch.nn.parallel.DistributedDataParallel

        class OnCPU(chosen):
            def __init__(self, module, device_ids=None, output_device=None, **kwargs):
                super().__init__(module, **kwargs)

        torch.nn.parallel.DistributedDataParallel = OnCPU
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    # Leave the process group before the interpreter exits: a group torn down at exit aborts now and
    # then ("terminate called without an active exception"), with torch's DDP as with MiniDDP.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the script passed: skip the interpreter's teardown, where that abort comes from
