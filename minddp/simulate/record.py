"""Taking a trace to simulate from: a few traced MiniDDP steps of a named model.

The same as these lines in your own training script (every rank calls the
export; rank 0 writes)::

    ddp = MiniDDP(model, trace=True)
    for step in range(warmup + steps):
        if step == warmup:
            ddp.tracer.clear()          # drop allocation and bucket-rebuild steps
        opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
    ddp.tracer.export_chrome_trace("run.json")

World size 1 (the default) gives the cleanest compute profile: no rank
waits for a peer, and no all-reduce competes with backward for the cores.

This is the command line's helper, the one part of the simulator that runs
an example model; the replay never imports it (``tests/test_layout.py``
counts it with the floor above the core). Its functions live here, not in
``__main__``, because spawned ranks cannot import a ``__main__`` module.
"""

from __future__ import annotations

import torch

from minddp import MiniDDP
from minddp.launch import spawn
from minddp.models import build_model, model_loss

__all__ = ["record_trace"]

BATCH_SIZE = 32
WARMUP_STEPS = 3


def _rank(rank: int, world_size: int, model_name: str, path: str, steps: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = MiniDDP(build_model(model_name), trace=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(100 + rank)
    x, y = torch.rand(BATCH_SIZE, 1, 28, 28, generator=data), torch.randint(0, 10, (BATCH_SIZE,), generator=data)
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            ddp.tracer.clear()
        opt.zero_grad()
        model_loss(model_name, ddp(x), x, y).backward()
        opt.step()
    ddp.tracer.export_chrome_trace(path)


def record_trace(model_name: str, path: str, world_size: int = 1, steps: int = 5) -> None:
    """Run ``steps`` traced steps of ``minddp.models.build_model(model_name)`` on Gloo, write ``path``."""
    spawn(_rank, world_size, model_name, path, steps, backend="gloo")
