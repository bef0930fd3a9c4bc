"""The ``minddp-train`` program: MNIST models trained data-parallel with MiniDDP (or torch's DDP).

Built on the core of the package, never the other way round:

* :mod:`~minddp_lab.train.cli`: the command line, its checks, and how the run starts;
* :mod:`~minddp_lab.train.local`: ``--nproc N`` local ranks, and which one failed first;
* :mod:`~minddp_lab.train.loop`: one rank's training (the step loop, logging, when to evaluate and save);
* :mod:`~minddp_lab.train.setup`: the parts built from the command line (data splits, device, wrapper);
* :mod:`~minddp_lab.train.step`: one optimizer step (gradient accumulation on ``no_sync``, clipping);
* :mod:`~minddp_lab.train.optimizer`: SGD, whole or sharded by ZeRO (``--zero 1|2``), its clipping and checkpoint state;
* :mod:`~minddp_lab.train.evaluate`: exact held-out evaluation shared over the ranks;
* :mod:`~minddp_lab.train.resume`: what an exact resume needs, saved and restored;
* :mod:`~minddp_lab.train.metrics`: ``metrics.jsonl``, without rows a resume redoes;
* :mod:`~minddp_lab.train.checkpoint`: crash-safe save and device-correct load;
* :mod:`~minddp_lab.train.errors`: bad input versus a failed rank.
"""

from minddp_lab.train.cli import UsageError, build_parser, check_args, main

__all__ = ["main", "build_parser", "UsageError", "check_args"]
