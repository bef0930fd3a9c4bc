"""Where MiniDDP's per-step time goes, next to torch's DDP, with no communication.

    python benchmarks/experiments/profile_overhead.py                      # mlp,cnn,ae,gpt, both settings
    python benchmarks/experiments/profile_overhead.py --models gpt --view copy --steps 100

Both wrappers run with ``wrappers.return_bucket`` as their communication hook
(the overhead mode of ``compare.py``), on 2 Gloo ranks; rank 0 reports. Three
views of the same steps, per model and ``gradient_as_bucket_view`` setting:

1. **sections**: MiniDDP's own methods timed with ``perf_counter`` around
   each call (a subclass, so the hooks see the timed methods): the
   per-gradient hook, with the copy into the bucket and the bucket launch
   inside it, the end-of-backward callback and the forward's collectives; per
   step and per call. The timer itself costs ~0.1 us per call;
2. **cProfile** of MiniDDP steps: the Python functions with the most own
   time per step (cProfile roughly doubles Python's cost, so read the
   proportions, not the absolute times), and how many calls of MiniDDP's
   Python functions a step makes: a count, which load does not distort;
3. **torch.profiler** of both wrappers: the operators with the most own CPU
   time per step and how many times each runs per step; the ops MiniDDP adds
   (``copy_``, ``mul_``, ``clone``) sit beside the ones torch's C++ reducer
   issues. The total of operator calls per step is again a count: compare
   the two wrappers' totals on a loaded machine rather than their times.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),  # the repository
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # benchmarks/: benchlib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import minddp  # noqa: E402
from minddp import MiniDDP  # noqa: E402
from minddp.launch import spawn  # noqa: E402
from minddp.ddp.core.reducer import CopyGradients, Reducer  # noqa: E402

from benchlib import models  # noqa: E402
from benchlib.timing import Runner  # noqa: E402
from benchlib.wrappers import cap_argument, return_bucket  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(minddp.__file__)) + os.sep
SECTIONS = {  # (class, method) -> what the report calls it
    (Reducer, "prepare_for_backward"): "end of forward: arming the backward (+ parts)",
    (Reducer, "_autograd_hook"): "hook (per gradient), in all",
    (Reducer, "bucket_ready"): "  of which filling and launching buckets",  # once per bucket
    (CopyGradients, "fill_bucket"): "    of which filling the bucket",
    (Reducer, "finish_backward"): "end of backward: wait, write .grad",
}


@contextlib.contextmanager
def timed_sections(totals: dict, calls: dict):
    """While inside, the :data:`SECTIONS` methods add their time to ``totals``
    (patched on the classes, since the reducer registers its hooks at construction)."""

    def timed(key, original):
        def method(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - t0
                calls[key] += 1

        return method

    originals = {key: getattr(*key) for key in SECTIONS}
    for (cls, name), original in originals.items():
        setattr(cls, name, timed((cls, name), original))
    try:
        yield
    finally:
        for (cls, name), original in originals.items():
            setattr(cls, name, original)


def sections(runner: Runner, view: bool, n_steps: int) -> str:
    totals, calls = defaultdict(float), defaultdict(int)
    with timed_sections(totals, calls):
        ddp = MiniDDP(runner.fresh(), bucket_cap_mb=cap_argument(runner.cap_mb), gradient_as_bucket_view=view)
    ddp.register_comm_hook(None, return_bucket)
    step = runner.stepper(ddp)
    with timed_sections(totals, calls):
        for _ in range(3):
            step()
        totals.clear(), calls.clear()
        t0 = time.perf_counter()
        for _ in range(n_steps):
            step()
    per_step = (time.perf_counter() - t0) / n_steps * 1e3
    lines = [f"  sections (MiniDDP, {n_steps} steps; whole step {per_step:.2f} ms):"]
    for key, label in SECTIONS.items():
        n = calls[key] / n_steps
        us = totals[key] / n_steps * 1e6
        per_call = f"{us / n:7.1f} us x {n:5.1f}/step" if n else ""
        lines.append(f"    {label:<38} {us / 1e3:6.3f} ms/step  {per_call}")
    return "\n".join(lines)


def cprofile(runner: Runner, view: bool, n_steps: int, top: int) -> str:
    step = runner.stepper(runner.wrap_minddp(runner.fresh(), view=view, nocomm=True))
    for _ in range(3):
        step()
    profiler = cProfile.Profile() if dist.get_rank() == 0 else None
    if profiler:
        profiler.enable()
    for _ in range(n_steps):
        step()
    if not profiler:
        return ""
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        if path.startswith(PACKAGE):  # MiniDDP's own Python; torch's ops are in the op profile
            rows.append((tottime, ncalls, cumtime, f"minddp/{os.path.relpath(path, PACKAGE)}:{line}({func})"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) / n_steps * 1e3
    calls = sum(r[1] for r in rows) / n_steps
    out = [f"  cProfile (MiniDDP, {n_steps} steps): {total:.3f} ms/step own time in minddp/*.py, "
           f"{calls:.0f} calls/step; top {top}:"]
    for tottime, ncalls, cumtime, name in rows[:top]:
        out.append(f"    own {tottime / n_steps * 1e3:6.3f} ms  cum {cumtime / n_steps * 1e3:6.3f} ms  "
                   f"{ncalls / n_steps:6.1f} calls/step  {name}")  # fmt: skip
    return "\n".join(out)


def op_profile(runner: Runner, view: bool, n_steps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    out = []
    for label, module in (("torch", runner.wrap_torch), ("minddp", runner.wrap_minddp)):
        step = runner.stepper(module(runner.fresh(), view=view, nocomm=True))
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n_steps):
                step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        ops = sum(e.count for e in events if e.key.startswith("aten::")) / n_steps
        out.append(f"  torch.profiler ({label}, {n_steps} steps): {ops:.0f} aten ops/step; own CPU time per step, top {top}:")
        for e in events[:top]:
            out.append(f"    {e.self_cpu_time_total / n_steps / 1e3:6.3f} ms  {e.count / n_steps:6.1f}/step  {e.key}")
    return "\n".join(out)


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cfg = {"backend": "gloo", "device": "cpu", "comm_hook": "none", "bucket_views": args.views, "overhead": True}
    report = []
    for name in args.models:
        runner = Runner(cfg, name, args.bucket_cap_mb, rank, world_size, torch.device("cpu"))
        n_params = sum(1 for p in runner.fresh().parameters())
        for view in args.views:
            report.append(f"{name} ({n_params} parameter tensors), gradient_as_bucket_view={view == 'view'}:")
            report.append(sections(runner, view == "view", args.steps))
            report.append(cprofile(runner, view == "view", args.steps, args.top))
            report.append(op_profile(runner, view == "view", args.steps, args.top))
            report.append("")
            if rank == 0:
                print(f"[profile] {name} {view} done", file=sys.stderr, flush=True)
    if rank == 0:
        text = "\n".join(report)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(models.DEFAULT_MODELS))
    p.add_argument("--view", choices=["both", "copy", "view"], default="both")
    p.add_argument("--steps", type=int, default=30, help="profiled steps per view (after 3 warm-up steps)")
    p.add_argument("--top", type=int, default=12, help="rows per profile")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.views = ["copy", "view"] if args.view == "both" else [args.view]
    spawn(rank_main, 2, args, backend="gloo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
