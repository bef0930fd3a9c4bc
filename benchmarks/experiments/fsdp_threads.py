"""Where the CPU time of a step goes, thread by thread: torch's DDP against ``minddp.fsdp`` (stage 3).

    python benchmarks/experiments/fsdp_threads.py                 # 2 ranks, 7 rounds of 10 steps
    python benchmarks/experiments/fsdp_threads.py --rounds 9 --text docs/fsdp_threads.txt

``minddp_lab.models.GPT`` as in ``fsdp_peers.py`` (each block then the root for
stage 3), AdamW, Gloo on CPU, one intra-op thread per rank. Each round runs
``--steps`` steps of every setup in turn (the order rotating) and reads each
thread's CPU time from ``/proc/self/task/<tid>/stat`` before and after:
the main thread (Python, autograd, the optimizer), Gloo's TCP loop
(``gloo_tcp_loop``: it reads and writes the sockets), Gloo's workers
(``pt_gloo_runloop``: they run the collectives) and the rest. Per step, the
rank whose process spent the most; median over rounds with [min, max].
Linux only (``/proc``); the clock ticks are 10 ms, so steps are summed over
a round before dividing.

A third row, ``stage3 local``, is a floor, not a setup anyone would train
with: the same stage-3 step with each all-gather replaced by a local copy
and each reduce-scatter by reading this rank's own piece (its gradients are
wrong). It is what the step costs with no communication at all: the rest of
the stage-3 row is the collectives' share.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import threading

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),  # the repository
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # benchmarks/: benchlib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchlib.fsdp_setups import build, collectives_made_local, gpt_config, train_step  # noqa: E402
from benchlib.outputs import emit, ranks_json  # noqa: E402

SETUPS = ("torch-ddp", "stage3", "stage3 local")
GROUPS = ("main", "gloo_tcp_loop", "pt_gloo_runloop", "other")


def thread_cpu_ms() -> dict[str, float]:
    """CPU ms so far of this process's threads, by group."""
    ticks = os.sysconf("SC_CLK_TCK")
    main = str(threading.main_thread().native_id)
    out = dict.fromkeys(GROUPS, 0.0)
    for task in glob.glob("/proc/self/task/*"):
        try:
            name = open(f"{task}/comm").read().strip()
            fields = open(f"{task}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        group = "main" if task.endswith("/" + main) else name if name in GROUPS else "other"
        out[group] += (int(fields[11]) + int(fields[12])) * 1e3 / ticks
    return out


def rank_main(rank: int, world_size: int, args: dict, path: str) -> None:
    import json

    torch.set_num_threads(1)
    cfg = gpt_config(False)
    built = {name: build(name.split()[0], cfg) for name in SETUPS}
    step = dict.fromkeys(SETUPS, 0)
    per_round: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for r in range(args["rounds"] + 1):  # round 0 warms up
        for name in SETUPS[r % len(SETUPS):] + SETUPS[:r % len(SETUPS)]:
            dist.barrier()
            before = thread_cpu_ms()
            with collectives_made_local(name.endswith("local")):
                for _ in range(args["steps"]):
                    train_step(built[name], cfg, rank, step[name])
                    step[name] += 1
            after = thread_cpu_ms()
            if r:
                per_round[name].append({g: (after[g] - before[g]) / args["steps"] for g in GROUPS})
    everyone = [None] * world_size
    dist.all_gather_object(everyone, per_round)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)


def table(everyone: list[dict], args: dict) -> str:
    lines = [f"# python benchmarks/experiments/fsdp_threads.py --rounds {args['rounds']} --steps {args['steps']}  "
             f"(2 ranks, Gloo, CPU; load average {os.getloadavg()[0]:.1f})",
             "CPU ms per step by thread, the busiest rank of each round; median over rounds [min, max]",
             "| setup | total | main | gloo_tcp_loop | pt_gloo_runloop | other |", "|---|---:|---:|---:|---:|---:|"]
    for name in SETUPS:
        rounds = []
        for r in range(args["rounds"]):
            busiest = max((ranks[name][r] for ranks in everyone), key=lambda t: sum(t.values()))
            rounds.append({**busiest, "total": sum(busiest.values())})
        cells = [f"{statistics.median(x):.1f} [{min(x):.1f}, {max(x):.1f}]"
                 for x in ([t[g] for t in rounds] for g in ("total", *GROUPS))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--text")
    parser.add_argument("--json")
    options = parser.parse_args()
    args = {"rounds": options.rounds, "steps": options.steps}
    everyone = ranks_json(rank_main, 2, args)
    emit(table(everyone, args), options.text, options.json, {"args": args, "ranks": everyone})


if __name__ == "__main__":
    main()
