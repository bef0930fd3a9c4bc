"""The simulator against Horovod's published scaling: VGG-16 and ResNet-101 on 128 and 512 GPUs.

    python benchmarks/published_horovod.py          # the table of docs/simulator_checked.md (seconds)
    python benchmarks/published_horovod.py --fit    # refit the one fitted figure on the calibration curve

Published: Horovod's benchmark page (uber/horovod, ``docs/benchmarks.md``),
TensorFlow's ``tf_cnn_benchmarks`` at batch 64 per GPU with
``--variable_update horovod``, synthetic data, servers of 4 Pascal GPUs on a
RoCE-capable 25 Gbit/s network. Its first version (October 2017, "128-GPU
Benchmark", 32 servers) gives 90% scaling efficiency for Inception V3 and
ResNet-101 and 79% for VGG-16; the second (2018, "512-GPU Benchmark", 128
servers; the same figures in arXiv:1802.05799) 90%, 90% and 68%. Efficiency:
images/s on N GPUs over N x one GPU's. VGG-16 (528 MB of gradients) is the
communication-heavy model, ResNet-101 (170 MB) and Inception V3 (104 MB, its
auxiliary head included), with longer backwards, the compute-heavy ones.

The same flags for every point: the ``pcie-eth25`` preset with 4 GPUs per
server, PCIe 3 x16 inside (15.75 GB/s at the 80% the preset assumes for
PCIe: 12.6 GB/s), one 25 Gb/s NIC per server at 96% of its line rate (the
presets' figure for NCCL's InfiniBand verbs transport, which RoCE runs;
``minddp_lab.simulate.cluster.ACHIEVED``). One figure is fitted, on VGG-16's
curve only: the latency of one ring step between servers (``--fit``), which
takes whatever grows with the ring's length (2 x (servers - 1) such steps
per all-reduce). ResNet-101 and Inception V3 are held out. One GPU's step:
TensorFlow's published P100 figures (VGG-16 154 images/s, Inception V3 142, at
batch 64: the DGX-1 table of ``benchmarks/published_scaling.py``); ResNet-101
is not in that table,
its step is modelled between ResNet-50's (219 images/s) and ResNet-152's
(91.8) in proportion to their GFLOP per image (4.1, 7.8, 11.5), as in
lesson 17. Overheads: the ``nccl-v100`` preset (fitted to PyTorch's DDP
table, not to these). Target: every point within 5 points.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchlib import curves  # noqa: E402
from minddp_lab.simulate.arguments import OneLineParser  # noqa: E402
from minddp_lab.simulate.network_flags import add_network_flags, network_from  # noqa: E402
from minddp_lab.simulate.overheads import OVERHEAD_PRESETS  # noqa: E402
from minddp_lab.simulate.profile import load_profiles  # noqa: E402
from minddp_lab.simulate.replay import DDPPolicy, simulate_step  # noqa: E402

PROFILES = os.path.join(ROOT, "benchmarks", "published_ddp_profiles.json")
WORLDS = (128, 512)
PUBLISHED = {"vgg16": (0.79, 0.68), "resnet101": (0.90, 0.90), "inception_v3": (0.90, 0.90)}  # at WORLDS
SOURCES = ("docs/benchmarks.md of uber/horovod, October 2017 (32 servers)",
           "docs/benchmarks.rst of horovod/horovod and arXiv:1802.05799, 2018 (128 servers)")
CALIBRATION = ("vgg16",)  # the rest are held out
TF_P100 = {"vgg16": 154, "inception_v3": 142, "resnet50": 219, "resnet152": 91.8}  # images/s, one P100, batch 64
GFLOP = {"resnet50": 4.1, "resnet101": 7.8, "resnet152": 11.5}
BATCH = 64
FITTED_LATENCY_US = 51.0  # `--fit`
TARGET_POINTS = 5.0


def step_ms(model: str) -> float:
    if model in TF_P100:
        return BATCH / TF_P100[model] * 1e3
    r50, r152 = (BATCH / TF_P100[m] * 1e3 for m in ("resnet50", "resnet152"))
    share = (GFLOP[model] - GFLOP["resnet50"]) / (GFLOP["resnet152"] - GFLOP["resnet50"])
    return r50 + (r152 - r50) * share


def flags(latency_us: float = FITTED_LATENCY_US) -> list[str]:
    return ["--network", "pcie-eth25", "--gpus-per-node", "4", "--intra-bandwidth", "12.6GB/s",
            "--nominal-bandwidth", "25Gb/s", "--efficiency", "0.96", "--latency-us", f"{latency_us:g}"]


def network(latency_us: float = FITTED_LATENCY_US):
    """The cluster exactly as the command line builds it from :func:`flags`."""
    parser = OneLineParser(prog="published_horovod")
    add_network_flags(parser)
    return network_from(parser.parse_args(flags(latency_us)))


def efficiencies(latency_us: float = FITTED_LATENCY_US) -> dict:
    """model -> (published, predicted) efficiencies at WORLDS."""
    net, shapes = network(latency_us), load_profiles(PROFILES)
    policy = DDPPolicy(overheads=OVERHEAD_PRESETS["nccl-v100"])
    out = {}
    for model, published in PUBLISHED.items():
        profile = shapes[model].with_times(step_ms=step_ms(model))
        one = simulate_step(profile, net, 1, policy).step_ms
        out[model] = (published, tuple(one / simulate_step(profile, net, w, policy).step_ms for w in WORLDS))
    return out


def fit() -> float:
    """The latency between servers (1 us steps) with the smallest worst miss on CALIBRATION's points."""
    def worst(latency_us: float) -> float:
        return curves.worst_miss(efficiencies(latency_us), CALIBRATION)
    return min(range(0, 201), key=worst)


def table(latency_us: float = FITTED_LATENCY_US) -> str:
    lines = [f"flags: `{' '.join(flags(latency_us))} --overheads nccl-v100`", "",
             "| model | set | GPUs (servers) | one GPU's step ms | published efficiency | source | predicted | "
             "miss (points) |", "|---|---|---:|---:|---:|---|---:|---:|"]
    worst = {}
    for model, (published, predicted) in efficiencies(latency_us).items():
        kind = "calibration" if model in CALIBRATION else "held out"
        for w, a, b, source in zip(WORLDS, published, predicted, SOURCES):
            miss = 100 * (b - a)
            worst[kind] = max(worst.get(kind, 0.0), abs(miss))
            lines.append(f"| {model} | {kind} | {w} ({w // 4}) | {step_ms(model):.1f} | {a:.0%} | {source} | "
                         f"{b:.1%} | {miss:+.1f} |")
    lines += ["", curves.targets_line(worst, TARGET_POINTS)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return curves.run(__doc__.strip().splitlines()[0], "the latency between servers", fit, FITTED_LATENCY_US, table,
                      lambda latency: f"fitted on {CALIBRATION}: {latency:g} us per ring step between servers", argv)


if __name__ == "__main__":
    sys.exit(main())
