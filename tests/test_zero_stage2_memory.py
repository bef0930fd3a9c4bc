"""ZeRO stage 2 saves gradient memory at its peak, not only after backward (issue #29, part 1).

A rank's gradient bytes (``.grad``, MiniDDP's bucket buffers or stage 2's
pool, ZeRO's shard gradients: :func:`minddp.zero.memory.gradient_bytes`),
sampled at every gradient hook and every bucket launch during a measured
backward (:class:`~minddp.zero.memory.GradientPeak`). A 10.5 M-parameter
model (Psi = 10.5 M, 4 bytes each), AdamW, 4 MB buckets (one layer each).

* peak during backward <= plain MiniDDP's with bucket views (4 Psi bytes,
  the least DDP can hold), in copy mode and with bucket views;
* after backward <= 4 Psi / N (the shard gradients) + the pool;
* the parameters after each step equal stage 1's, bit for bit (the same
  averages, stepped elementwise).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minddp import MiniDDP
from minddp.zero import ZeroRedundancyOptimizer
from minddp.zero.memory import GradientPeak, gradient_bytes

WIDTH, LAYERS, BATCH = 1024, 10, 4
CAP_MB = 4.5  # one layer (4 MiB + bias) per bucket
MiB = 2 ** 20


def tower() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _measure(rank, world_size, setup):
    module = tower()
    peak = GradientPeak(module)
    as_view = setup in ("ddp", "stage2 views")
    model = MiniDDP(module, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=as_view)
    if setup == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model, lr=1e-3,
                                      shard_gradients=setup.startswith("stage2"))
    peak.watch(model, opt)
    g = torch.Generator().manual_seed(rank)
    after = 0
    for step in range(3):  # the first backward learns the bucket order (stage 2: all-reduced); measure the third
        x = torch.randn(BATCH, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        peak.reset()
        F.mse_loss(model(x), x).backward()
        after = peak.sample()
        opt.step()
    pool = getattr(opt, "bucket_pool", None)
    psi = sum(p.numel() for p in module.parameters())
    units = len(getattr(opt, "layout").units) if hasattr(opt, "layout") else 0
    return {"peak": peak.peak, "after": after, "pool": pool.nbytes if pool is not None else 0, "psi": psi,
            "units": units,
            "params": [p.detach().clone() for p in module.parameters()] if world_size == 2 else None}


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage2_peak_gradient_bytes_at_most_ddp_with_bucket_views(ranks, world_size):
    pool = ranks(world_size)
    ddp = max(r["peak"] for r in pool.run(_measure, "ddp", timeout_s=120))
    for setup in ("stage2", "stage2 views"):
        results = pool.run(_measure, setup, timeout_s=120)
        worst = max(r["peak"] for r in results)
        assert worst <= ddp, f"{setup}, N={world_size}: peak {worst / MiB:.1f} MiB of gradients during backward, " \
                             f"MiniDDP with bucket views {ddp / MiB:.1f}"
        for r in results:
            padding = 4 * (world_size - 1) * r["units"]  # each bucket padded to N equal pieces
            bound = 4 * r["psi"] / world_size + r["pool"] + padding
            assert r["after"] <= bound, f"{setup}, N={world_size}: {r['after'] / MiB:.1f} MiB after backward, " \
                                        f"more than 4 psi / N + the pool ({r['pool'] / MiB:.1f} MiB)"


def test_stage2_equals_stage1_bit_for_bit(ranks):
    pool = ranks(2)
    stage1 = pool.run(_measure, "stage1", timeout_s=120)
    stage2 = pool.run(_measure, "stage2", timeout_s=120)
    for a, b in zip(stage1, stage2):
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q), "stage 2 differs from stage 1"
