"""The oracle of the whole project.

After every optimizer step, MiniDDP's parameters must equal
(a) one process training on the concatenated global batch, and
(b) torch's own DistributedDataParallel on the same data.

Each rank builds its replica from a *different* seed, so unless the
construction broadcast works, nothing below can match. Each rank takes its
slice of the same global batch; the loss is a mean over the local slice, so
averaging gradients over ranks gives exactly the full-batch gradient.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from models_for_tests import build, global_batch

PER_RANK_BATCH = 4
STEPS = 4
TINY_CAP_MB = 1e-4  # ~100 bytes: nearly every parameter in its own bucket


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


def _train_three_ways(rank, world_size, model_name, cap_mb, opt_name, as_view):
    reference = build(model_name, seed=0)  # what rank 0 starts with
    mini = MiniDDP(build(model_name, seed=rank), bucket_cap_mb=cap_mb, gradient_as_bucket_view=as_view)
    native = TorchDDP(build(model_name, seed=rank), bucket_cap_mb=cap_mb, gradient_as_bucket_view=as_view)
    models = {"reference": reference, "minddp": mini, "torch": native}
    optimizers = {k: _optimizer(opt_name, [p for p in m.parameters() if p.requires_grad]) for k, m in models.items()}
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK_BATCH * world_size)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        for name, model in models.items():
            optimizers[name].zero_grad()
            xb, yb = (x, y) if name == "reference" else (x[mine], y[mine])
            F.mse_loss(model(xb), yb).backward()
        ref = dict(reference.named_parameters())
        nat = dict(native.module.named_parameters())
        for name, p in mini.module.named_parameters():
            # The averaged gradient itself, before an optimizer shrinks an error
            # below the parameter tolerance (lr * 1% of a gradient would pass it).
            assert (p.grad is None) == (ref[name].grad is None), f"step {step} {name}: .grad set on one side only"
            if p.grad is not None:
                # float32: a few ulp of the tensor's largest entry, the scale the sums work at.
                atol = 1e-5 * ref[name].grad.abs().max().item() + 1e-12
                for other, label in ((ref[name].grad, "single process"), (nat[name].grad, "torch DDP")):
                    torch.testing.assert_close(p.grad, other, rtol=1e-5, atol=atol, msg=lambda m: f"step {step} {name} grad vs {label}: {m}")
        for optimizer in optimizers.values():
            optimizer.step()
        for name, p in mini.module.named_parameters():
            # float32 rounding: the full batch is reduced in one mean, the
            # shards in a mean per rank then a sum; both ways differ by a few ulp.
            torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name} vs single process: {m}")
            torch.testing.assert_close(p, nat[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name} vs torch DDP: {m}")


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("cap_mb", [TINY_CAP_MB, 25.0], ids=["tiny_buckets", "default_buckets"])
@pytest.mark.parametrize("model_name", ["mlp", "awkward", "cnn"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_minddp_equals_single_process_and_torch_ddp(ranks, world_size, model_name, cap_mb, opt_name, as_view):
    # Every rank asserts, after every step; a rank whose assertion fails fails the call.
    ranks(world_size).run(_train_three_ways, model_name, cap_mb, opt_name, as_view)
