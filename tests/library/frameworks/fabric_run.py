"""Lightning Fabric on 2 CPU ranks, with torch's DDP and with MiniDDP; each rank saves what happened step by step.

    python -m torch.distributed.run --nproc_per_node 2 tests/library/frameworks/fabric_run.py OUT_DIR PACKAGE:PRECISION...

For each ``PACKAGE:PRECISION`` (``lightning_fabric:32-true``, ``lightning.fabric:bf16-mixed``), one Fabric
with torch's DDP (``strategy="ddp"``), then one with MiniDDP, in the same processes (torchrun started
them, so Fabric launches none). Each:
four steps of two micro-batches each, the first under ``fabric.no_backward_sync(model)``, gradients
clipped, a BatchNorm in the model; ``fabric.save`` after step 2; then a fresh model and optimizer
``fabric.load`` that checkpoint and take steps 3 and 4 again. Each rank saves ``OUT_DIR/rank{R}.pt``:
by (package, precision, torch|minddp), per step the loss, the parameters and the buffers, for the first
run and the resumed one. MiniDDP: ``MiniDDPStrategy`` from ``minddp.frameworks.fabric``, as
``docs/frameworks.md`` tells a user (``package=`` named: both packages are imported here).
"""

import importlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

from both_ddps import save_and_leave  # (this script's folder is on sys.path)

torch.set_num_threads(1)


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def snapshot(model: nn.Module, loss: torch.Tensor) -> dict:
    return {"loss": loss.detach().float().clone(),
            "state": {name: t.detach().clone() for name, t in model.state_dict().items()}}


def train(fabric, steps: range, checkpoint: str, resume: bool) -> list[dict]:
    torch.manual_seed(fabric.global_rank)  # different on each rank: the first broadcast makes them equal
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    if resume:
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    record = []
    for step in steps:
        for micro in (0, 1):
            x, y = batch(fabric.global_rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = F.mse_loss(model(x).float(), y)
                fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        record.append(snapshot(model, loss))
        if step == 2 and not resume:
            fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    return record


def run(package: str, precision: str, which: str, out: str) -> dict:
    strategy = "ddp"
    if which == "minddp":
        from minddp.frameworks.fabric import MiniDDPStrategy

        strategy = MiniDDPStrategy(package=package)
    fabric = importlib.import_module(package).Fabric(accelerator="cpu", devices=2, strategy=strategy,
                                                     precision=precision)
    fabric.launch()
    checkpoint = f"{out}/{package}-{precision}-{which}.ckpt"
    first = train(fabric, range(1, 5), checkpoint, resume=False)
    resumed = train(fabric, range(3, 5), checkpoint, resume=True)
    wrapper = type(fabric.setup(net())._forward_module).__name__
    fabric.barrier()
    return {"first": first, "resumed": resumed, "wrapper": wrapper}


def main(out: str, *cases: str) -> None:
    results = {}
    for case in cases:
        package, precision = case.split(":")
        for which in ("torch", "minddp"):
            results[package, precision, which] = run(package, precision, which, out)
    save_and_leave(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
