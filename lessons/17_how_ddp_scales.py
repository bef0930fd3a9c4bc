"""Lesson 17: how DDP scales -- from a trace on this laptop to 1,024 simulated ranks.

What you will learn
    A step of DDP on ``p`` ranks is backward plus whatever communication
    did not hide under it. Lesson 16 drew that for 2 ranks from a trace;
    ``minddp.simulate`` replays the same trace for any ``p``: each bucket
    leaves when its last gradient is ready and the one before it is done,
    and lasts ``allreduce_time(bytes, p, link)`` from ``minddp.network``::

        ring: 2 (p - 1) alpha  +  2 (p - 1) / p  x  bytes / bandwidth
              \\__ latency: grows with p   \\__ bandwidth: under 2x bytes/bandwidth

    Four consequences, each checked below with numbers:
    (a) at scale the latency term is paid once per collective, so buckets
        beat one all-reduce per parameter; (b) one giant bucket leaves only
        after backward, so none of it hides; (c) fp16 compression halves the
        bandwidth term and costs two casts, so it pays only where communication
        is exposed and the cast runs faster than about twice the link; (d) the ring's bytes per rank stay
        near 2x the gradient bytes however many ranks there are.

    Then the published numbers: the DDP paper (Li et al., VLDB 2020) reports
    near-linear scaling to 256 GPUs; Horovod (Sergeev and Del Balso, 2018,
    arXiv:1802.05799, and its README) 90% efficiency for ResNet-101 and 68%
    for VGG-16 on 512 GPUs. A rough replay of profiles shaped like those two
    models is printed beside them, and where the model is too simple is said.

What to run
    python lessons/17_how_ddp_scales.py [--world-size 2] [--compute-scale 1]

What to look at
    The tables: simulated step time and scaling efficiency from 8 to 1,024
    ranks on 25 Gb/s Ethernet and 400 Gb/s InfiniBand, and the lines after
    "checked:". The compute times are this laptop's (divide them with
    ``--compute-scale`` to pretend a faster accelerator: communication then
    matters more).

Try this
    1. ``--compute-scale 50``: a GPU fifty times this CPU. Which claims get
       stronger, and where does compression start to pay now?
    2. Replace ``"ib400"`` with ``"dgx-h100"`` (8 GPUs per node on NVLink, a
       hierarchical all-reduce): how much of the latency term goes away?
    3. Pass ``algorithm="tree"`` in the policies: for which bucket sizes does
       a tree beat the ring at 1,024 ranks, and why does NCCL switch?
    4. ``python -m minddp.simulate --record mlp --out mlp.json`` then
       ``python -m minddp.simulate --trace mlp.json --network eth25
       --accumulation 4``: what does ``no_sync`` accumulation buy at scale?
"""

import json
import os
import tempfile

import torch
import torch.nn as nn

from minddp import MiniDDP
from minddp.network import Hierarchy, Link, get_link, ring_bytes_sent_per_rank
from minddp.simulate import ComputeProfile, DDPPolicy, Gradient, profile_from_trace, simulate_step
from _common import parse_args, print0, run

WORLDS = [8, 64, 256, 1024]
NETWORKS = ["eth25", "ib400"]
STEPS = 4
TRACE = os.path.join(tempfile.gettempdir(), "minddp_lesson17_trace.json")
PER_PARAMETER = DDPPolicy(bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)  # every gradient its own bucket
BUCKETS = DDPPolicy(bucket_cap_mb=25)  # torch's default


def make_model() -> nn.Sequential:
    # Twelve 512x512 layers: 24 parameters, 12 MiB of gradients.
    layers = []
    for _ in range(12):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(512, 10))


def take_trace(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = MiniDDP(make_model(), trace=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(2 + STEPS):
        if step == 2:
            ddp.tracer.clear()  # the first steps allocate and rebuild buckets
        x, y = torch.randn(64, 512, generator=data), torch.randint(0, 10, (64,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    ddp.tracer.export_chrome_trace(TRACE)


def scaling_table(profile: ComputeProfile, network: str) -> None:
    link = get_link(network)
    print0(f"\n{network} ({link.source}):")
    print0("  ranks | per-parameter ms | 25 MB buckets ms | one bucket ms | efficiency (25 MB)")
    giant = DDPPolicy(bucket_cap_mb=1e6, first_bucket_cap_mb=1e6)
    for p in WORLDS:
        a, b, c = (simulate_step(profile, link, p, pol) for pol in (PER_PARAMETER, BUCKETS, giant))
        print0(f"  {p:5d} | {a.step_ms:16.1f} | {b.step_ms:16.1f} | {c.step_ms:13.1f} | {b.scaling_efficiency:.0%}")


def check_claims(profile: ComputeProfile) -> None:
    n = len(profile.gradients)
    for network in NETWORKS:
        link = get_link(network)
        per_param = simulate_step(profile, link, 1024, PER_PARAMETER)
        bucketed = simulate_step(profile, link, 1024, BUCKETS)
        # (a) The bandwidth term is the same for any grouping (linear in bytes): the gap is all latency.
        latency_gap = (len(per_param.buckets) - len(bucketed.buckets)) * 2 * 1023 * link.alpha_s * 1e3
        assert len(per_param.buckets) == n and per_param.step_ms > bucketed.step_ms
        assert abs((per_param.comm_ms - bucketed.comm_ms) - latency_gap) < 1e-6 * per_param.comm_ms
        print0(f"checked (a) {network}, 1024 ranks: {n} per-parameter all-reduces cost "
               f"{per_param.comm_ms - bucketed.comm_ms:.1f} ms more than {len(bucketed.buckets)} buckets, "
               f"exactly {n - len(bucketed.buckets)} x 2 x 1023 x alpha")
    # (b) One giant bucket: its all-reduce starts after the last gradient, so all of it is exposed.
    link = get_link("eth25")
    giant = simulate_step(profile, link, 8, DDPPolicy(bucket_cap_mb=1e6, first_bucket_cap_mb=1e6))
    bucketed = simulate_step(profile, link, 8, DDPPolicy(bucket_cap_mb=1))
    assert len(giant.buckets) == 1 and abs(giant.exposed_ms - giant.comm_ms) < 1e-9 and giant.hidden_fraction < 0.01
    assert bucketed.hidden_fraction > 0.2 and bucketed.step_ms < giant.step_ms
    print0(f"checked (b) eth25, 8 ranks: one bucket hides {giant.hidden_fraction:.0%} of its "
           f"{giant.comm_ms:.1f} ms; 1 MB buckets hide {bucketed.hidden_fraction:.0%}, "
           f"step {bucketed.step_ms:.1f} ms against {giant.step_ms:.1f} ms")
    # (c) fp16 compression saves (p-1)/p x bytes / bandwidth on the wire and costs two casts,
    # 2 x bytes / cast rate: it pays, where communication is exposed, once cast > 2 x bandwidth x p/(p-1).
    # A CPU core casts at ~5 GB/s, a GPU at hundreds of GB/s.
    for network in NETWORKS:
        link = get_link(network)
        threshold = 2 * link.bandwidth_Bps * 1024 / 1023
        plain = simulate_step(profile, link, 1024, BUCKETS)
        for cast in (5e9, 30e9, 1e12):
            fp16 = simulate_step(profile, link, 1024, DDPPolicy(compression="fp16", cast_Bps=cast))
            pays = fp16.step_ms < plain.step_ms
            assert pays == (cast > threshold), (network, cast)
            print0(f"checked (c) {network}, 1024 ranks, casting at {cast / 1e9:g} GB/s: fp16 step "
                   f"{fp16.step_ms:.1f} ms against {plain.step_ms:.1f} ms: "
                   f"{'pays' if pays else 'does not pay'} (rule: cast > {threshold / 1e9:.1f} GB/s)")
    # (d) Ring traffic per rank, for the whole gradient: 2 (p - 1) / p of its bytes.
    total = profile.gradient_bytes
    ratios = [ring_bytes_sent_per_rank(total, p) / total for p in [2, *WORLDS]]
    assert all(1.0 <= r < 2.0 for r in ratios) and ratios == sorted(ratios) and ratios[-1] > 1.99
    print0("checked (d) ring bytes sent per rank / gradient bytes: "
           + ", ".join(f"{p} ranks {r:.3f}" for p, r in zip([2, *WORLDS], ratios)))


def shaped_like(layer_params: list[int], compute_ms: float) -> ComputeProfile:
    """A rough profile: gradients ready evenly over backward (2/3 of compute), last layer first."""
    backward = compute_ms * 2 / 3
    grads = [Gradient(f"layer{i}", backward * (k + 1) / len(layer_params), 4 * n)
             for k, (i, n) in enumerate(reversed(list(enumerate(layer_params))))]
    return ComputeProfile(compute_ms / 3, grads)


def compare_with_published() -> None:
    # Horovod's setup: 4 Pascal GPUs per server on PCIe, one 25 Gb/s RoCE NIC per server (so a
    # quarter of it per GPU). Compute per step (batch 64, a P100 at ~4 TFLOP/s achieved, backward
    # = 2 x forward): ResNet-101 7.8 GFLOP/image -> ~370 ms, VGG-16 15.5 GFLOP/image -> ~740 ms.
    # Parameters: ResNet-101 44.5 M over ~100 layers; VGG-16 138 M, 124 M in its 3 dense layers.
    eth = get_link("eth25")
    shared_nic = Link("eth25 / 4 GPUs", eth.alpha_s, eth.bandwidth_Bps / 4, eth.source)
    cluster = Hierarchy("horovod-2017", get_link("pcie4"), shared_nic, 4)
    resnet = shaped_like([445_000] * 100, 370.0)
    vgg = shaped_like([2_000] + [600_000] * 12 + [102_800_000, 16_800_000, 4_100_000], 740.0)
    published = {"ResNet-101": 0.90, "VGG-16": 0.68}
    got = {name: simulate_step(prof, cluster, 512, BUCKETS).scaling_efficiency
           for name, prof in (("ResNet-101", resnet), ("VGG-16", vgg))}
    print0("\npublished against simulated, 512 GPUs (Horovod's cluster: 4 GPUs per server, 25 Gb/s):")
    for name in published:
        print0(f"  {name:10s}: Horovod {published[name]:.0%}, simulated {got[name]:.0%}")
        # The replay leaves costs out and never adds any: it must not be more pessimistic.
        assert got[name] >= published[name] - 0.05, (name, got[name])
    print0("  checked: the replay is never more pessimistic than the measurement, as it must be: it")
    print0("  leaves out congestion in the switches, stragglers, the framework's own overhead")
    print0("  (Horovod's 5 ms fusion cycle, TensorFlow's scheduling), protocol and chunking choices")
    print0("  of the all-reduce, and treats PCIe 3 servers of 2017 as PCIe 4. Its VGG-16 figure is")
    print0("  far too good: VGG's 124 M dense-layer parameters are ready first in backward, so the")
    print0("  replay hides them under the convolutions' backward; in the real run they evidently did")
    print0("  not hide (e.g. the wire ran far below 25 Gb/s). The profiles are shaped by hand, too.")
    print0("  The DDP paper's near-linear scaling to 256 GPUs (NVLink servers, 100 Gb/s InfiniBand)")
    print0("  is what the replay gives for long compute on fast links: little communication exposed.")


def main(rank: int, world_size: int, compute_scale: float) -> None:
    take_trace(rank, world_size)
    if rank != 0:
        return
    with open(TRACE) as f:
        profile = profile_from_trace(json.load(f)).scaled(compute_scale)
    print0(f"trace of {world_size} ranks x {STEPS} steps -> profile: forward {profile.forward_ms:.1f} ms, "
           f"backward {profile.backward_ms:.1f} ms, {len(profile.gradients)} gradients, "
           f"{profile.gradient_bytes / 2**20:.0f} MiB (compute / {compute_scale:g})")
    for network in NETWORKS:
        scaling_table(profile, network)
    print0("")
    check_claims(profile)
    compare_with_published()


if __name__ == "__main__":
    args = parse_args(__doc__, extra=lambda p: p.add_argument("--compute-scale", type=float, default=1.0,
                                                               help="divide traced compute times by this"))
    run(main, args.world_size, args.compute_scale)
