"""Is the step-time simulator honest? Predicted against measured step times on this machine.

    python benchmarks/validate_simulator.py                      # world 2, Gloo, mlp/cnn/ae, caps 1,5,25,100
    python benchmarks/validate_simulator.py --quick --json v.json
    python benchmarks/validate_simulator.py --link 1gbit --world-size 4   # over shaped links (root)

One spawned job of ``--world-size`` Gloo ranks (one intra-op thread each) does,
in this order:

1. **the network**: ``dist.all_reduce`` alone of float32 buffers from 4 KiB to
   32 MiB; :func:`minddp_lab.network.fit_link` fits alpha and bandwidth to their
   medians. Nothing the predictions are compared with goes into the fit;
2. **the compute profile** of each model: every rank runs ``MiniDDP(trace=True)``
   on a process group of its own (world size 1: no communication, but both
   cores busy, as in the real run); rank 0's trace gives the profile;
3. **the measurement**: full ``MiniDDP`` steps at world size 2 for each bucket
   cap, each block's time the slowest rank's, the median over rounds.

With ``--link RATE`` every rank runs in a network namespace of its own,
joined to the others by links shaped to that rate (:mod:`minddp_lab.links.namespaces`):
the fit, the profile and the steps all cross the real, rate-limited link.

The three are taken in rounds (each round: every all-reduce size, then per
model a traced block alone and a block per cap), so that a machine whose
load drifts (it is shared) drifts under all of them alike.

Then rank 0 replays each case with :func:`minddp_lab.simulate.simulate_step`, twice:
``overlap`` (communication runs beside backward, as on GPUs with NCCL) and
``shared`` (``overlap=False``: a collective pauses backward, as when Gloo's
thread and autograd compete for one core each rank has). Error = predicted /
measured - 1. The machine may be shared: figures are medians, with the spread
(min-max over rounds) of the measured step beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchlib.outputs import emit, ranks_json  # noqa: E402
from benchlib.timing import Runner  # noqa: E402  (the benchmark's models, batches and step: same as compare.py)
from minddp_lab.links import namespaces as links  # noqa: E402
from minddp_lab.network import fit_link  # noqa: E402
from minddp_lab.simulate import DDPPolicy, profile_from_trace, simulate_step  # noqa: E402

FIT_SIZES = [4 * 1024 * 4**k for k in range(7)]  # 4 KiB .. 16 MiB
FIT_SIZES.append(32 * 1024 * 1024)
CFG = {"comm_hook": "none", "backend": "gloo", "minddp_bucket_view": True, "torch_bucket_view": False}


def _slowest(ms: list[float]) -> list[float]:
    t = torch.tensor(ms, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def allreduce_block(buf: torch.Tensor) -> float:
    """Seconds per all-reduce of ``buf``, over enough repetitions to last a few ms."""
    reps = max(2, min(50, (4 << 20) // buf.nbytes))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(buf)
    return (time.perf_counter() - t0) / reps


def rank_main(rank: int, world_size: int, args: dict, out_path: str) -> None:
    """Every measurement in rounds, so that the machine's load drifts over all of them alike."""
    torch.set_num_threads(1)
    solos = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    buffers = [torch.zeros(n // 4) for n in FIT_SIZES]
    fit: list[list[float]] = [[] for _ in FIT_SIZES]
    alone, ddp, measured, alone_ms = {}, {}, {}, {}
    for model in args["models"]:
        runners = {cap: Runner(CFG, model, cap, rank, world_size, torch.device("cpu")) for cap in args["caps"]}
        first = next(iter(runners.values()))
        # The compute profile: this rank alone, on a process group of its own (no communication).
        alone[model] = first.stepper(first.wrap_minddp(first.fresh(), trace=True, process_group=solos[rank]))
        ddp[model] = {cap: (r, r.stepper(r.wrap_minddp(r.fresh()))) for cap, r in runners.items()}
        measured[model] = {cap: [] for cap in runners}
        alone_ms[model] = []
    for step in [*alone.values(), *(s for caps in ddp.values() for _, s in caps.values())]:
        for _ in range(3):  # allocation, bucket rebuild: not timed, not traced
            step()
    for step in alone.values():
        step.module.tracer.clear()
    for buf in buffers:
        dist.all_reduce(buf)
    k = args["steps_per_block"]
    for _ in range(args["rounds"]):
        for i, buf in enumerate(buffers):
            fit[i].append(allreduce_block(buf))
        for model in args["models"]:
            first = next(iter(ddp[model].values()))[0]
            alone_ms[model].append(first.time_block(alone[model], k))
            for cap, (runner, step) in ddp[model].items():
                measured[model][cap].append(runner.time_block(step, k))
    fit_seconds = [statistics.median(_slowest(t)) for t in fit]
    cases = []
    for model in args["models"]:
        trace = alone[model].module.tracer.chrome_trace(solos[rank])
        steps = {str(cap): _slowest(ms) for cap, ms in measured[model].items()}
        cases.append({"model": model, "trace": trace, "measured_ms": steps, "alone_ms": _slowest(alone_ms[model])})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"fit_seconds": fit_seconds, "cases": cases}, f)


def predict(raw: dict, world_size: int) -> dict:
    link = fit_link(FIT_SIZES, raw["fit_seconds"], world_size, "this machine (fitted)")
    rows = []
    for case in raw["cases"]:
        profile = profile_from_trace(case["trace"])
        for cap, ms in case["measured_ms"].items():
            measured = statistics.median(ms)
            row = {"model": case["model"], "bucket_cap_mb": float(cap), "measured_ms": measured,
                   "measured_min_ms": min(ms), "measured_max_ms": max(ms),
                   "compute_ms": profile.forward_ms + profile.backward_ms + profile.after_backward_ms,
                   "alone_ms": statistics.median(case["alone_ms"])}
            for name, overlap in (("overlap", True), ("shared", False)):
                step = simulate_step(profile, link, world_size, DDPPolicy(bucket_cap_mb=float(cap), overlap=overlap))
                row[f"{name}_ms"] = step.step_ms
                row[f"{name}_error"] = step.step_ms / measured - 1
            row["buckets"] = len(step.buckets)
            row["comm_ms"] = step.comm_ms
            rows.append(row)
    fit = {"alpha_us": link.alpha_s * 1e6, "bandwidth_MBps": link.bandwidth_Bps / 1e6,
           "sizes": FIT_SIZES, "median_ms": [t * 1e3 for t in raw["fit_seconds"]]}
    return {"fit": fit, "rows": rows}


def table(result: dict, world_size: int, rounds: int, link: str = "loopback") -> str:
    fit = result["fit"]
    lines = [
        f"world size {world_size}, Gloo, CPU, 1 thread per rank, link: {link}; medians over {rounds} rounds",
        f"network fitted to all-reduce alone: alpha = {fit['alpha_us']:.1f} us per ring step, "
        f"bandwidth = {fit['bandwidth_MBps']:.0f} MB/s",
        "  all-reduce alone, median ms: "
        + ", ".join(f"{n / 1024:.0f} KiB {t:.3f}" for n, t in zip(fit["sizes"], fit["median_ms"])),
        "",
        "| model | cap MB | buckets | compute ms (trace) | alone ms (timed) | comm ms (model) | measured ms (min-max) "
        "| predicted overlap | error | predicted shared cores | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['bucket_cap_mb']:g} | {r['buckets']} | {r['compute_ms']:.1f} | {r['alone_ms']:.1f} "
            f"| {r['comm_ms']:.1f} "
            f"| {r['measured_ms']:.1f} ({r['measured_min_ms']:.1f}-{r['measured_max_ms']:.1f}) "
            f"| {r['overlap_ms']:.1f} | {r['overlap_error']:+.0%} | {r['shared_ms']:.1f} | {r['shared_error']:+.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--link", default="loopback", metavar="RATE",
                   help=f"loopback, or {links.ACCEPTED}: ranks in network namespaces joined by shaped links (root)")
    p.add_argument("--models", default="mlp,cnn,ae")
    p.add_argument("--bucket-mb", default="1,5,25,100")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (median over them)")
    p.add_argument("--steps-per-block", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 rounds of 2 steps: a smoke test")
    p.add_argument("--json", help="write the raw measurements and the table's rows here")
    p.add_argument("--text", help="write the table here too")
    a = p.parse_args(argv)
    args = {"models": a.models.split(","), "caps": [float(c) for c in a.bucket_mb.split(",")],
            "rounds": 3 if a.quick else a.rounds, "steps_per_block": 2 if a.quick else a.steps_per_block,
            "trace_steps": 3 if a.quick else 8}
    link = None
    if a.link != "loopback":
        try:
            link = links.format_rate(links.parse_rate(a.link))
        except links.LinkError as e:
            p.error(f"--link: {e}, or loopback")
        if links.missing():
            p.error(f"--link {link}: {links.missing()}")
    raw = ranks_json(rank_main, a.world_size, args, link)
    result = predict(raw, a.world_size)
    args["link"] = link or "loopback"
    emit(table(result, a.world_size, args["rounds"], args["link"]), a.text, a.json, {"args": args, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
