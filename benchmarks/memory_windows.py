"""Every reading of many memory windows per wrapper: where a peak lands, and what communication adds.

    python benchmarks/memory_windows.py --model mlp --windows 16

``compare.py`` reports each wrapper's peak memory as the lowest of a few
windows (``benchlib/memory.py``). This prints all of them: each wrapper
(torch's DDP and MiniDDP with bucket views, each also with a hook that
communicates nothing) built and stepped ``--steps`` times in a window of
its own, the wrappers taking turns, ``--windows`` times, in processes with
the benchmark's allocator setting; each reading is the max over the ranks.
On the mlp about half the windows of either wrapper read 0.9 MiB more than
the others, and none without communication: Gloo's scratch memory for an
all-reduce in flight, when it runs at backward's peak.
"""

from __future__ import annotations

import argparse
import os

import torch

from minddp.launch import spawn

from benchlib import memory, models
from benchlib.timing import Runner
from benchlib.wrappers import DEFAULT_CAP_MB, NOCOMM

WRAPPERS = ["torch_view", "minddp_view", "torch_view" + NOCOMM, "minddp_view" + NOCOMM]


def _windows(rank: int, world_size: int, model: str, windows: int, steps: int) -> None:
    torch.set_num_threads(1)
    cfg = {"comm_hook": "none", "backend": "gloo"}
    runner = Runner(cfg, model, DEFAULT_CAP_MB, rank, world_size, torch.device("cpu"))  # no cap given
    runner.peak_memory(n_steps=2, windows=1, names=WRAPPERS)  # unmeasured: first-use costs land here
    readings = runner.peak_memory(n_steps=steps, windows=windows, names=WRAPPERS)
    if rank == 0:
        print(f"{model}, {windows} windows per wrapper of {steps} steps each, MiB (max over {world_size} ranks), sorted:")
        for name, values in readings.items():
            print(f"  {name:<20} lowest {min(values):5.1f}  " + " ".join(f"{v:.1f}" for v in sorted(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=models.ALL_MODELS)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="steps per window, past torch's bucket rebuild")
    args = parser.parse_args()
    os.environ.update(memory.ALLOCATOR_ENV)  # read by the ranks' allocator at start-up
    spawn(_windows, 2, args.model, args.windows, args.steps)


if __name__ == "__main__":
    main()
