"""ZeRO stage 2 saves gradient memory at its peak, not only after backward.

A rank's gradient bytes (``.grad``, MiniDDP's bucket buffers or stage 2's
pool, ZeRO's shard gradients: :func:`minddp.zero.memory.gradient_bytes`),
sampled at every gradient hook and every bucket launch during a measured
backward (:class:`~minddp.zero.memory.GradientPeak`). A 10.5 M-parameter
model (Psi = 10.5 M, 4 bytes each), AdamW, 4 MB buckets (one layer each).

* peak during backward <= plain MiniDDP's with bucket views (4 Psi bytes,
  the least DDP can hold), in copy mode and with bucket views;
* after backward <= 4 Psi / N (the shard gradients): no pool buffer kept;
* the parameters after each step equal stage 1's, bit for bit (the same
  averages, stepped elementwise);
* during backward the pool holds two buffers with ``overlap_comm=True`` (one bucket on the
  wire while the next fills, DeepSpeed's double buffer), one without;
* a bucket's reduce-scatter needs no hidden full-bucket copy (torch's Gloo
  ``reduce_scatter_tensor`` clones the bucket): counted by torch's profiler
  from the allocator, what it allocates and frees again within the call.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minddp.ddp.parts.comm_hook import CommHook
from minddp import MiniDDP
from minddp.zero import ZeroRedundancyOptimizer
from minddp.zero.memory import GradientPeak, allocation_peak, gradient_bytes

WIDTH, LAYERS, BATCH = 1024, 10, 4
CAP_MB = 4.5  # one layer (4 MiB + bias) per bucket
MiB = 2 ** 20


def tower() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _measure(rank, world_size, setup, overlap_comm=True):
    module = tower()
    peak = GradientPeak(module)
    as_view = setup in ("ddp", "stage2 views")
    model = MiniDDP(module, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=as_view)
    if setup == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model, lr=1e-3,
                                      shard_gradients=setup.startswith("stage2"), overlap_comm=overlap_comm)
    peak.watch(model, opt)
    pool = getattr(opt, "bucket_pool", None)
    most_buffers = [0]  # the pool's buffers, at their most during a backward (sampled at every gradient)
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(
            lambda _: most_buffers.__setitem__(0, max(most_buffers[0], len(pool.buffers) if pool else 0)))
    g = torch.Generator().manual_seed(rank)
    after = 0
    for step in range(3):  # the first backward learns the bucket order (stage 2: all-reduced); measure the third
        x = torch.randn(BATCH, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        peak.reset()
        most_buffers[0] = 0
        F.mse_loss(model(x), x).backward()
        after = peak.sample()
        opt.step()
    psi = sum(p.numel() for p in module.parameters())
    units = len(getattr(opt, "layout").units) if hasattr(opt, "layout") else 0
    return {"peak": peak.peak, "after": after, "pool": pool.nbytes if pool is not None else 0, "psi": psi,
            "pool_buffers": most_buffers[0],
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
            bound = 4 * r["psi"] / world_size + padding  # no pool buffer is kept past backward
            assert r["after"] <= bound, f"{setup}, N={world_size}: {r['after'] / MiB:.1f} MiB after backward, " \
                                        f"more than 4 psi / N (the pool keeps {r['pool'] / MiB:.1f} MiB)"


def test_stage2_equals_stage1_bit_for_bit(ranks):
    pool = ranks(2)
    stage1 = pool.run(_measure, "stage1", timeout_s=120)
    stage2 = pool.run(_measure, "stage2", timeout_s=120)
    for a, b in zip(stage1, stage2):
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q), "stage 2 differs from stage 1"


@pytest.mark.parametrize("overlap_comm, buffers", [(True, 2), (False, 1)])
def test_pool_holds_one_bucket_filling_and_one_on_the_wire(ranks, overlap_comm, buffers):
    """With overlap_comm, a bucket's reduce-scatter overlaps the next bucket's backward: two buffers. An
    older reduce-scatter still in flight, or one arrived and not yet given back, would be a third."""
    for r in ranks(2).run(_measure, "stage2 views", overlap_comm, timeout_s=120):
        assert 0 < r["pool_buffers"] <= buffers, f"overlap_comm={overlap_comm}: the pool held " \
                                                 f"{r['pool_buffers']} buffers during backward"


def _reduce_scatter_transients(rank, world_size):
    """The bytes each bucket's comm hook allocates and frees again (overlap_comm=False: it waits for its
    reduce-scatter inside), measured in the third backward, and one bucket's bytes."""
    module = tower()
    model = MiniDDP(module, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model, lr=1e-3,
                                  shard_gradients=True, overlap_comm=False)
    state, hook = model.reducer.communication.comm_hook
    transients = []

    def profiled(state, bucket):
        future = None

        def send_and_wait():
            nonlocal future
            future = hook(state, bucket)
            future.wait()
        peak, kept = allocation_peak(send_and_wait)
        transients.append(peak - kept)
        return future

    model.reducer.set_communication(CommHook(model.reducer, state, profiled))
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(BATCH, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        transients.clear()
        F.mse_loss(model(x), x).backward()
        opt.step()
    return max(transients), 4 * max(b.numel for b in model.reducer.buckets)


def test_reduce_scatter_allocates_no_copy_of_the_bucket_at_two_ranks(ranks):
    """At two ranks the piece from the other rank is received straight into the shard gradient and this
    rank's own half added to it (a + b == b + a: the same bits): nothing more than a few bytes of
    bookkeeping is allocated. Gloo's reduce_scatter_tensor would clone the whole bucket."""
    for transient, bucket_bytes in ranks(2).run(_reduce_scatter_transients, timeout_s=120):
        assert transient < 64 * 1024, f"a reduce-scatter allocated {transient / MiB:.2f} MiB for a while " \
                                      f"(a bucket is {bucket_bytes / MiB:.2f} MiB)"
