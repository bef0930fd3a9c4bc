"""bucket_cap_mb="auto": the choice follows the alpha-beta model, agrees on every rank, and changes no result.

Two layers. :func:`choose_plan` is pure: a made-up step (when each gradient
is ready) and a made-up link go in, a plan comes out, checked against what
the model says by hand. Then MiniDDP itself, on 2 Gloo ranks whose
all-reduces go through a :class:`~minddp.net.simulated_link.SimulatedLink`: it
measures its own steps, probes the (simulated) link, and must pick few
buckets on a slow high-latency link, several on a fast one with compute to
hide behind, the same on both ranks, with parameters equal to torch's DDP.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp.net.bucket_planner import MEASURED_BACKWARDS, choose_plan, communication_overlaps
from minddp.net.network import Link
from minddp.simulate import ComputeProfile, Gradient
from minddp.net.simulated_link import SimulatedLink, simulated_allreduce_hook
from minddp.zero import ZeroRedundancyOptimizer

MB = 1024 * 1024


def _step(n_gradients=8, nbytes=MB, every_ms=10.0) -> ComputeProfile:
    """Backward produces one ``nbytes`` gradient every ``every_ms``."""
    grads = [Gradient(f"g{i}", every_ms * (i + 1), nbytes) for i in range(n_gradients)]
    return ComputeProfile(forward_ms=20.0, gradients=grads)


# ------------------------------------------------------------- choose_plan
def test_a_slow_high_latency_link_gets_one_bucket():
    # 50 ms per message, 2 ring steps at p=2: each extra bucket costs 100 ms,
    # far more than the 80 ms of backward it could hide behind.
    link = Link("slow", alpha_s=50e-3, bandwidth_Bps=1e9)
    choice = choose_plan(_step(), link, world_size=2, overlap=True)
    assert choice.buckets == 1, f"expected one bucket on a 50 ms-latency link, got {choice}"
    # By hand: backward ends at 80 ms, then 100 ms latency + 8 MiB at 1 GB/s.
    assert choice.predicted_ms == pytest.approx(20 + 80 + 100 + 8 * MB / 1e9 * 1e3)
    # The default: a 1 MiB first bucket (ready at 10 ms), then the other 7 MiB
    # (ready at 80 ms, but the wire is busy until 110 ms): two latencies.
    assert choice.default_buckets == 2
    assert choice.default_ms == pytest.approx(20 + 10 + 2 * 100 + 8 * MB / 1e9 * 1e3)


def test_a_fast_low_latency_link_with_compute_to_hide_behind_keeps_overlap():
    # 10 us latency; 1 MiB takes ~10 ms at 100 MB/s, as long as the backward
    # takes to produce the next gradient: each bucket hides behind the next.
    link = Link("fast", alpha_s=10e-6, bandwidth_Bps=100e6)
    choice = choose_plan(_step(), link, world_size=2, overlap=True)
    one_bucket = 20 + 80 + 2 * 10e-3 + 8 * MB / 100e6 * 1e3
    assert choice.buckets >= 4, f"expected several buckets to overlap with backward, got {choice}"
    assert choice.predicted_ms < one_bucket - 40, "overlap must hide most of the all-reduce"


def test_without_overlap_every_extra_bucket_only_adds_latency():
    # Communication that stops compute while it runs (a CPU with no core to
    # spare) hides nothing: the fewest buckets win even on a fast link.
    link = Link("fast", alpha_s=10e-6, bandwidth_Bps=100e6)
    assert choose_plan(_step(), link, world_size=2, overlap=False).buckets == 1


def test_overlap_on_cpu_needs_a_spare_core_or_an_all_reduce_that_mostly_waits(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # 2 ranks of 1 thread each: no core for Gloo's thread
    torch.set_num_threads(1)
    assert communication_overlaps(gpu, 2, cpu_share=0.9), "a GPU's streams overlap"
    assert not communication_overlaps(cpu, 2, cpu_share=0.3), "Gloo over loopback keeps the cores busy"
    assert communication_overlaps(cpu, 2, cpu_share=0.05), (
        "an all-reduce that waits on a real link (or a sleeping hook) leaves the cores to backward")
    monkeypatch.setattr("os.cpu_count", lambda: 4)  # one core each for compute, one for Gloo
    assert communication_overlaps(cpu, 2, cpu_share=0.9)


# -------------------------------------------------------- MiniDDP, 2 ranks
class Tower(nn.Module):
    """Four 512x512 layers: 1 MiB of gradient each, real compute to hide behind."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def _train_auto(rank, world_size, alpha_s, bandwidth_Bps, steps):
    torch.manual_seed(0)
    mini = MiniDDP(Tower(), bucket_cap_mb="auto")
    mini.register_comm_hook(SimulatedLink(Link("sim", alpha_s, bandwidth_Bps)), simulated_allreduce_hook)
    torch.manual_seed(0)
    native = TorchDDP(Tower())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (mini, native)]
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)
        for model, opt in zip((mini, native), optimizers):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        if step == 0:  # one bucket until the first backward showed the order, then the default caps' buckets
            default_buckets = len(mini.bucket_names)
    diff = max((p - q).abs().max().item() for p, q in zip(mini.parameters(), native.parameters()))
    planner = mini.bucket_planner
    choice, replayed = planner.choice, None
    if choice is not None:  # rank 0 decided: the same model on what it measured must choose the same
        replayed = choose_plan(planner.profile(), choice.link, world_size, choice.overlap, choice.cpu_share)
    return {"buckets": mini.bucket_names, "default_buckets": default_buckets, "diff": diff,
            "choice": choice, "replayed": replayed}


STEPS = MEASURED_BACKWARDS + 3  # the measured backwards, the first one, and two with the chosen buckets


def _check_auto_end_to_end(results):
    """What holds whatever the measured times: every rank built the buckets of rank 0's choice, which is
    the model's best plan for what rank 0 measured (never worse than the default), and the
    parameters equal torch's DDP. Which plan wins for a given link is checked without any clock by the
    choose_plan tests above: under load the measured step and probe move, and so may the best plan."""
    assert results[0]["buckets"] == results[1]["buckets"], "every rank must build rank 0's buckets"
    assert results[0]["default_buckets"] >= 2, "the test needs a model the default splits"
    choice = results[0]["choice"]
    assert choice is not None and results[1]["choice"] is None, "rank 0 decides, and only rank 0"
    assert len(results[0]["buckets"]) == choice.buckets, (
        f"the buckets built ({len(results[0]['buckets'])}) are not the plan chosen: {choice.describe()}")
    assert results[0]["replayed"] == choice, "the choice is the model's best plan for what rank 0 measured"
    assert choice.predicted_ms <= choice.default_ms, "the default is a candidate: the choice is never worse"
    for r in results:  # bucketing changes the summation order only: float32 rounding
        assert r["diff"] < 1e-5, f"parameters differ from torch's DDP by {r['diff']}"
    return choice


def test_auto_on_a_slow_link_rebuilds_rank_0s_choice_on_every_rank_and_matches_torch(ranks):
    _check_auto_end_to_end(ranks(2).run(_train_auto, 20e-3, 1e9, STEPS, timeout_s=120))


def test_auto_on_a_fast_link_rebuilds_rank_0s_choice_on_every_rank_and_matches_torch(ranks):
    # 50 us latency, 4 MiB take ~100 ms at 40 MB/s: longer than the backward.
    choice = _check_auto_end_to_end(ranks(2).run(_train_auto, 50e-6, 40e6, STEPS, timeout_s=120))
    assert choice.overlap, "a simulated link sleeps on its own thread: its all-reduces overlap compute"


def _misuse(rank, world_size):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB or 'auto', got 'fast'"):
        MiniDDP(Tower(), bucket_cap_mb="fast")
    auto = MiniDDP(Tower(), bucket_cap_mb="auto")
    with pytest.raises(ValueError, match="ZeRO stage 2"):  # it partitions by buckets that will change
        ZeroRedundancyOptimizer(auto.parameters(), torch.optim.SGD, ddp=auto, lr=0.1, shard_gradients=True)
    return True


def test_auto_misuse_is_named(ranks):
    assert ranks(2).run(_misuse) == [True, True]
