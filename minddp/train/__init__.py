"""The ``minddp-train`` program: MNIST models trained data-parallel with MiniDDP (or torch's DDP).

Built on the core of the package, never the other way round:

* :mod:`~minddp.train.cli`: the command line, its checks, and how the run starts;
* :mod:`~minddp.train.local`: ``--nproc N`` local ranks, and which one failed first;
* :mod:`~minddp.train.loop`: one rank's training (the step loop, logging, when to evaluate and save);
* :mod:`~minddp.train.setup`: the parts built from the command line (data splits, device, wrapper);
* :mod:`~minddp.train.step`: one optimizer step (gradient accumulation on ``no_sync``, clipping);
* :mod:`~minddp.train.optimizer`: SGD, whole or sharded by ZeRO (``--zero 1|2``), its clipping and checkpoint state;
* :mod:`~minddp.train.evaluate`: exact held-out evaluation shared over the ranks;
* :mod:`~minddp.train.resume`: what an exact resume needs, saved and restored;
* :mod:`~minddp.train.metrics`: ``metrics.jsonl``, without rows a resume redoes;
* :mod:`~minddp.train.checkpoint`: crash-safe save and device-correct load;
* :mod:`~minddp.train.errors`: bad input versus a failed rank.
"""

from minddp.train.cli import UsageError, build_parser, check_args, main

__all__ = ["main", "build_parser", "UsageError", "check_args"]
