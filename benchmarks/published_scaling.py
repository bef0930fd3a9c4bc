"""The simulator against a published scaling curve: TensorFlow's DGX-1 (P100) benchmark, 1 to 8 GPUs.

    python benchmarks/published_scaling.py          # the table of docs/simulator_checked.md (seconds)
    python benchmarks/published_scaling.py --fit    # refit the one fitted figure on the calibration rows

Published: TensorFlow's performance benchmarks (May 2017; the page is
``tensorflow/docs_src/performance/benchmarks.md`` in tensorflow/tensorflow,
"Details for NVIDIA DGX-1 (NVIDIA Tesla P100)"): images/s of synthetic-data
training on 1, 2, 4 and 8 P100s of one DGX-1, at batch 64 per GPU and (its
"other results") at batch 32. VGG16 and AlexNet exchanged gradients with
NCCL all-reduces ("replicated (with NCCL)"); ResNet-50 through parameter
servers on the CPU, which this simulator does not model: its rows only check
that a compute-heavy model stays near 100% on the same network.

The same network flags for every row: a DGX-1's hybrid cube-mesh as two
fully connected quads of 4 GPUs (``--gpus-per-node 4``), inside a quad a
P100's 4 NVLinks of 20 GB/s at the 80% NVLink efficiency of the presets
(64 GB/s), between the quads one link per GPU (``--nics-per-node 4``,
``--latency-us 3.4``) whose achieved bandwidth is the one figure fitted
(``--fit``, on CALIBRATION's rows only). The overheads are the ``nccl-v100``
preset, fitted to PyTorch's DDP table, not to these rows. Shapes: torchvision's
models traced on CPU (``benchmarks/published_ddp_profiles.json``), at the
published one-GPU step (batch / images per second). Efficiency: images/s at
N GPUs over N x one GPU's, published and predicted alike. Target:
every point within 5 points.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchlib import curves  # noqa: E402
from minddp_lab.simulate.cluster import apply_flags, preset_figures  # noqa: E402
from minddp_lab.simulate.overheads import OVERHEAD_PRESETS  # noqa: E402
from minddp_lab.simulate.profile import load_profiles  # noqa: E402
from minddp_lab.simulate.replay import DDPPolicy, simulate_step  # noqa: E402

PROFILES = os.path.join(ROOT, "benchmarks", "published_ddp_profiles.json")
WORLDS = (1, 2, 4, 8)
# (model, batch per GPU): images/s on 1, 2, 4, 8 GPUs, synthetic data
PUBLISHED = {
    ("vgg16", 64): (154, 295, 584, 1081),
    ("vgg16", 32): (144, 281, 549, 820),
    ("alexnet", 512): (2987, 5658, 10509, 17822),
    ("resnet50", 64): (219, 422, 852, 1734),
}
EXCHANGE = {"vgg16": "NCCL all-reduce", "alexnet": "NCCL all-reduce", "resnet50": "parameter servers (CPU)"}
CALIBRATION = (("vgg16", 64),)  # the rest are held out
INSIDE_QUAD_Bps = 0.8 * 4 * 20e9  # 4 NVLink 1 links of 20 GB/s a direction (P100 datasheet), at 80%
FITTED_CROSS_Bps = 0.7e9  # `--fit`: between the quads, per GPU
TARGET_POINTS = 5.0


def flags(cross_Bps: float = FITTED_CROSS_Bps) -> dict:
    return dict(gpus_per_node=4, nics_per_node=4, latency_us=3.4, bandwidth_Bps=cross_Bps,
                intra_bandwidth_Bps=INSIDE_QUAD_Bps)


def command(cross_Bps: float = FITTED_CROSS_Bps) -> str:
    return (f"--network dgx1-v100 --gpus-per-node 4 --nics-per-node 4 --latency-us 3.4 --bandwidth "
            f"{cross_Bps / 1e9:g}GB/s --intra-bandwidth {INSIDE_QUAD_Bps / 1e9:g}GB/s --overheads nccl-v100")


def efficiencies(cross_Bps: float = FITTED_CROSS_Bps) -> dict:
    """(model, batch) -> (published, predicted) efficiencies at WORLDS[1:]."""
    net = apply_flags(preset_figures("dgx1-v100"), **flags(cross_Bps)).build()
    shapes, out = load_profiles(PROFILES), {}
    policy = DDPPolicy(overheads=OVERHEAD_PRESETS["nccl-v100"])
    for (model, batch), images in PUBLISHED.items():
        profile = shapes[model].with_times(step_ms=batch / images[0] * 1e3)
        steps = [simulate_step(profile, net, w, policy).step_ms for w in WORLDS]
        out[model, batch] = ([images[i] / (w * images[0]) for i, w in enumerate(WORLDS)][1:],
                             [steps[0] / s for s in steps][1:])
    return out


def fit() -> float:
    """The cross-quad bandwidth (0.1 GB/s steps) with the smallest worst miss on CALIBRATION's rows."""
    def worst(cross: float) -> float:
        return curves.worst_miss(efficiencies(cross), CALIBRATION)
    return min((x / 10 * 1e9 for x in range(5, 201)), key=worst)


def table(cross_Bps: float = FITTED_CROSS_Bps) -> str:
    lines = [f"flags: `{command(cross_Bps)}`", "",
             "| model | batch | exchange | set | GPUs | published images/s | published efficiency | predicted | "
             "miss (points) |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    worst = {}
    for key, (published, predicted) in efficiencies(cross_Bps).items():
        kind = "calibration" if key in CALIBRATION else "held out"
        for w, images, a, b in zip(WORLDS[1:], PUBLISHED[key][1:], published, predicted):
            miss = 100 * (b - a)
            worst[kind] = max(worst.get(kind, 0.0), abs(miss))
            lines.append(f"| {key[0]} | {key[1]} | {EXCHANGE[key[0]]} | {kind} | {w} | {images} | {a:.1%} | {b:.1%} "
                         f"| {miss:+.1f} |")
    lines += ["", "What 8 GPUs add to one GPU's step (ms): published (batch / images per second) against predicted",
              "", "| model | batch | step on 1 GPU | published at 8 | predicted at 8 | published extra | predicted extra |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for key, (published, predicted) in efficiencies(cross_Bps).items():
        one = key[1] / PUBLISHED[key][0] * 1e3
        lines.append(f"| {key[0]} | {key[1]} | {one:.1f} | {one / published[-1]:.1f} | {one / predicted[-1]:.1f} | "
                     f"{one / published[-1] - one:+.1f} | {one / predicted[-1] - one:+.1f} |")
    lines += ["", curves.targets_line(worst, TARGET_POINTS)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return curves.run(__doc__.strip().splitlines()[0], "the cross-quad bandwidth", fit, FITTED_CROSS_Bps, table,
                      lambda cross: f"fitted on {CALIBRATION}: {cross / 1e9:g} GB/s between the quads, per GPU", argv)


if __name__ == "__main__":
    sys.exit(main())
