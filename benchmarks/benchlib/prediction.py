"""The simulator's prediction beside each measured step of ``compare.py``.

After each row's timings, every rank measures the two things
:func:`minddp_lab.simulate.simulate_step` needs, in the same processes and on the
same link as the timed steps:

* **the compute profile**: a few steps of ``MiniDDP(trace=True)`` on a
  process group of this rank alone (no communication, but every rank
  computing at once, as in the timed run); rank 0's trace gives when each
  gradient is ready (:func:`minddp_lab.simulate.profile_from_trace`);
* **the link**: ``all_reduce`` of a small buffer (64 KiB) and of one as large
  as all the gradients, the fastest of a few tries each (load only adds
  time), fitted as ``plan_buckets`` fits it
  (:func:`minddp_lab.links.probe.fit_latency_bandwidth`).

After each row's timing, rank 0 replays its bucket cap, the profile's
compute scaled to that row's measured bare step (``local``). Whether communication may run beside
backward is the bound's rule (``benchlib/bound.py``): on a real link (``--link``) it
mostly waits on the wire (``overlap=True``); on loopback with no core to
spare it competes with backward (``overlap=False``). The simulator models a
DDP, not one implementation: one prediction per row, set beside both
wrappers' measured steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from benchlib.tables import markdown_table, with_spread
from benchlib.wrappers import first_bucket_mb
from minddp_lab.links.probe import fit_latency_bandwidth
from minddp_lab.simulate import DDPPolicy, profile_from_trace, simulate_step

PROFILE_STEPS = 4  # traced steps after the warm-up ones
# How the simulated step placed communication, by the bound's rule (a file from before the rule: not recorded).
SIMULATED_WITH = {"max": "beside", "sum": "sharing the cores with"}
PROBE_BYTES = 64 * 1024
PROBE_TRIES = 3


def _fastest_allreduce(buffer: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(PROBE_TRIES):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        best = min(best, time.perf_counter() - start)
    t = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's: a collective ends when every rank is done
    return t.item()


def measure_inputs(runner, solo_group):
    """The compute profile and the link (every rank calls: collectives); rank 0 gets them, the others None."""
    model = runner.wrap_minddp(runner.fresh(), trace=True, process_group=solo_group)
    step = runner.stepper(model)
    for _ in range(2):  # allocation, the bucket rebuild: not traced
        step()
    model.tracer.clear()
    for _ in range(PROFILE_STEPS):
        step()
    trace = model.tracer.chrome_trace(solo_group)
    n = sum(p.numel() for p in model.parameters())
    sizes = [PROBE_BYTES, max(4 * n, 2 * PROBE_BYTES)]
    seconds = [_fastest_allreduce(torch.zeros(size // 4)) for size in sizes]
    if dist.get_rank() != 0:
        return None
    return profile_from_trace(trace), fit_latency_bandwidth(sizes, seconds, dist.get_world_size())


def predicted_step(inputs, cap_mb: float, local_ms: float, world_size: int, overlap: bool) -> float:
    """The simulator's step at ``cap_mb``, its compute scaled to this row's measured bare step.

    The trace gives *when* each gradient is ready within the step; its clock runs slow (a traced
    step of the small models took 2 to 3 times the bare step timed in the same run, on this loaded
    machine), so the total is taken from ``local_ms``, timed beside the wrappers.
    """
    profile, link = inputs
    traced = profile.forward_ms + profile.backward_ms + profile.after_backward_ms
    profile = profile.scaled(traced / local_ms) if traced > 0 and local_ms > 0 else profile
    policy = DDPPolicy(bucket_cap_mb=cap_mb, first_bucket_cap_mb=first_bucket_mb(cap_mb), overlap=overlap)
    return simulate_step(profile, link, world_size, policy).step_ms


def table(cfg: dict, rows: list[dict]) -> str:
    """Measured against simulated, and how much of the all-reduce each wrapper hid, per model and cap."""
    auto = all("ratio_auto" in r for r in rows)
    where = "loopback" if cfg.get("link", "loopback") == "loopback" else f"links shaped to {cfg['link']} (minddp_lab/links/namespaces.py)"
    titles = ["model", "cap MB", "local", "allreduce", "simulated", "torch copy", "minddp copy", "minddp / torch",
              "sim error torch", "hidden torch", "hidden minddp"] + (["auto (buckets)", "auto predicted", "auto / torch"] if auto else [])
    cells_all = []
    for r in rows:
        sim, t, m = r["predicted_ms"], r["torch_copy_ms"], r["minddp_copy_ms"]
        cells = [r["model"], f"{r['bucket_cap_mb']:g}", f"{r['local_ms']:.1f}", f"{r['allreduce_ms']:.1f}",
                 f"{sim:.1f}", f"{t:.1f}", f"{m:.1f}", with_spread(r, "ratio_copy", "{:.3f}"), f"{sim / t - 1:+.0%}",
                 with_spread(r, "hidden_fraction_torch_copy", "{:.2f}"), with_spread(r, "hidden_fraction_minddp_copy", "{:.2f}")]
        if auto:
            predicted = f"{r['auto_predicted_ms']:.1f}" if "auto_predicted_ms" in r else "-"
            cells += [f"{r['minddp_auto_ms']:.1f} ({r['auto_buckets']:g})", predicted, with_spread(r, "ratio_auto", "{:.3f}")]
        cells_all.append(cells)
    lines = [
        f"On {where}, {cfg['world_size']} ranks: ms per step, median over runs (ratios and hidden: median [min, max]);",
        "  simulated: minddp_lab.simulate's step from this run's compute profile (scaled to local) and link fit (benchlib/prediction.py),",
        f"  communication {SIMULATED_WITH.get(cfg.get('bound_rule'), 'beside or with')} backward; sim error against torch copy;",
        "  hidden = (local + allreduce - step) / allreduce; auto predicted: the step plan_buckets's planner",
        "  predicted for the buckets it chose (rank 0, minddp_lab/auto/planner.py); auto / torch: plan_buckets(MiniDDP(...))",
        "  against torch's DDP at this row's cap (the 25 MB row: torch's default)",
    ]
    return "\n".join(lines) + "\n" + markdown_table(titles, cells_all)
