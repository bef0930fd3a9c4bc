"""torch.compile around MiniDDP, and MiniDDP around a compiled module.

Both orders must train exactly like torch's DDP on the same shards (the
``aot_eager`` backend traces and runs the same graph without generating
code, so the test is fast on CPU and still goes through Dynamo and AOT
autograd). MiniDDP's hooks are on the parameters' gradient accumulators,
which run outside the compiled graph, so communication still happens; what
compiling changes (the graph breaks at MiniDDP's collectives, and the
compiled backward hands all gradients over at its end) is in docs/limits.md.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP

STEPS = 3
PER_RANK = 4


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def _compiled_training(rank, world_size, order):
    torch._dynamo.reset()
    if order == "compile(MiniDDP(model))":
        mini = torch.compile(MiniDDP(_model(rank)), backend="aot_eager")
        inner = mini._orig_mod.module
    else:
        mini = MiniDDP(torch.compile(_model(rank), backend="aot_eager"))
        inner = mini.module._orig_mod
    native = TorchDDP(_model(rank))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mini, native)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(PER_RANK * world_size, 8, generator=g), torch.randn(PER_RANK * world_size, 8, generator=g)
        x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        for model, opt in zip((mini, native), opts):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        theirs = dict(native.module.named_parameters())
        for name, p in inner.named_parameters():
            torch.testing.assert_close(p, theirs[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name}: {m}")
    return [p.detach().clone() for p in inner.parameters()]


@pytest.mark.parametrize("order", ["compile(MiniDDP(model))", "MiniDDP(compile(model))"])
def test_compiled_training_matches_torch_ddp(ranks, order):
    rank0, rank1 = ranks(2).run(_compiled_training, order, timeout_s=240)
    for a, b in zip(rank0, rank1):
        assert torch.equal(a, b)  # and the replicas stayed identical
