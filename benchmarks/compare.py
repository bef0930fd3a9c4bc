"""MiniDDP against torch's DistributedDataParallel, on the same path, with the limit beside them.

    python benchmarks/compare.py                       # CPU, Gloo, 2 ranks, mlp/cnn/ae
    python benchmarks/compare.py --quick --json r.json # the smoke test (< 1 minute on 2 cores)
    python benchmarks/compare.py --bucket-sweep 1,5,25,100 --plot compare.png
    python benchmarks/compare.py --backend nccl --device cuda --world-size 1

For every model (and bucket cap) one table row, all times in ms per step,
medians over repeated blocks, each block's time the slowest rank's:

* ``local``: forward + backward + SGD step with no communication;
* ``allreduce``: all-reducing the gradient bytes alone, in DDP-like buckets;
* ``ideal`` = max(local, allreduce), the step with perfect overlap, and
  ``no_overlap`` = local + allreduce, the step with none;
* ``naive``: a blocking all-reduce of every gradient after backward;
* ``torch_ddp`` and ``minddp``: full steps with each wrapper, same bucket cap,
  timed in alternating blocks (A/B, B/A, ...) after warm-up steps;
* ``ratio`` = minddp / torch_ddp;
* hidden fraction of communication, for each wrapper with step time ``t``::

      hidden = (no_overlap - t) / allreduce, clipped to [0, 1]

  1 means the step costs no more than local compute would with the
  communication fully overlapped; 0 means it costs local + allreduce or more
  (nothing hidden, or overhead eating what overlap saved);
* peak memory each wrapper adds (construction + steps), in fresh windows:
  ``torch.cuda.max_memory_allocated`` on GPU, peak RSS on CPU (see
  ``_memory.py`` for why ``ru_maxrss`` alone would be unfair);
* ``max_param_diff``: largest parameter difference between the two wrappers
  after the same steps from the same weights on the same data.

How it runs: the ranks are spawned processes (``minddp.launch.spawn``), each
with ``--threads-per-rank`` intra-op threads; the rank side is
``_timing.py``, the table/JSON/plot ``_report.py``. Data are fixed random
tensors of MNIST shape, seeded per rank: this measures steps, not learning.

NCCL refuses two ranks on one GPU; with fewer GPUs than ``--world-size`` the
run drops to one rank per GPU and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report  # noqa: E402
from minddp.models import MODEL_NAMES  # noqa: E402

MODELS = ["mlp", "cnn", "ae"]  # the default; minddp.models.MODEL_NAMES lists all


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"bucket caps must be positive, got {text!r}")
    return values


def _models(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--models needs at least one name")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Compare minddp.MiniDDP with torch's DistributedDataParallel on the same backend, device, "
        "model, data and bucket size, next to the no-communication and communication-only limits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda for nccl, else cpu")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--bucket-sweep", type=_floats, default=None, metavar="1,5,25,100",
                   help="measure every one of these bucket caps (MB) instead of --bucket-cap-mb alone")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="timed steps per implementation (default 30, quick 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed blocks the steps are split into (default 5, quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, quick 2)")
    p.add_argument("--models", type=_models, default=MODELS, help="comma-separated, from " + ",".join(MODEL_NAMES))
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--comm-hook", choices=["none", "fp16", "bf16"], default="none",
                   help="both wrappers get the same hook (torch's own for torch's DDP, minddp.comm_hooks for MiniDDP)")  # fmt: skip
    p.add_argument("--no-bucket-view", action="store_true",
                   help="MiniDDP with gradient_as_bucket_view=False (copy gradients into buckets, like torch's default)")  # fmt: skip
    p.add_argument("--torch-bucket-view", action="store_true", help="torch's DDP with gradient_as_bucket_view=True")
    p.add_argument("--quick", action="store_true", help="few steps: a smoke test, under a minute on 2 cores")
    p.add_argument("--json", metavar="PATH", default=None, help="write config and results as JSON")
    p.add_argument("--plot", metavar="PATH.png", default=None, help="draw the results (needs matplotlib: pip install '.[plot]')")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 30
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    for name in ("steps", "repeats", "world_size", "threads_per_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 2:
        p.error("--warmup must be at least 2: torch's DDP rebuilds its buckets after its first step")
    args.repeats = min(args.repeats, args.steps)
    unknown = [m for m in args.models if m not in MODEL_NAMES]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODEL_NAMES)}")
    if args.backend == "nccl" and args.device != "cuda":
        p.error("NCCL only reduces CUDA tensors: use --device cuda (or --backend gloo)")
    return args


def check_environment(args: argparse.Namespace) -> list[str]:
    """Adjust what the machine cannot do; return the notes to print."""
    notes = []
    if args.plot and not _report.have_matplotlib():
        print(f"error: {_report.PLOT_INSTALL_HINT}", file=sys.stderr)
        sys.exit(2)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
            sys.exit(2)
        n = torch.cuda.device_count()
        if args.backend == "nccl" and args.world_size > n:
            notes.append(
                f"note: NCCL refuses two ranks on one GPU and this machine has {n}; "
                f"measuring world size {n} instead of {args.world_size}"
            )
            args.world_size = n
    return notes


def config(args: argparse.Namespace) -> dict:
    import torch

    return {
        "backend": args.backend,
        "device": args.device,
        "world_size": args.world_size,
        "bucket_cap_mb": args.bucket_cap_mb,
        "bucket_caps": args.bucket_sweep or [args.bucket_cap_mb],
        "models": args.models,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "memory_steps": 1 if args.quick else 2,
        "threads_per_rank": args.threads_per_rank,
        "comm_hook": args.comm_hook,
        "minddp_bucket_view": not args.no_bucket_view,
        "torch_bucket_view": args.torch_bucket_view,
        "quick": args.quick,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"
        + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/compare.py " + " ".join(sys.argv[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes = check_environment(args)
    for note in notes:
        print(note)

    import torch.multiprocessing as mp

    import _memory
    from _timing import memory_main, timing_main
    from minddp.launch import spawn

    cfg = config(args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minddp-compare-") as tmp:
        timed_path, mem_path = os.path.join(tmp, "timed.json"), os.path.join(tmp, "memory.json")
        saved = dict(os.environ)
        try:
            spawn(timing_main, cfg["world_size"], cfg, timed_path, backend=cfg["backend"])
            # Fresh processes for memory, with the allocator setting that
            # makes RSS follow live tensors (_memory.py says why).
            os.environ.update(_memory.ALLOCATOR_ENV)
            spawn(memory_main, cfg["world_size"], cfg, mem_path, backend=cfg["backend"])
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"error: a rank failed:\n{e}", file=sys.stderr)
            return 1
        finally:
            os.environ.clear()
            os.environ.update(saved)
        with open(timed_path) as f:
            timed = json.load(f)
        with open(mem_path) as f:
            memory = json.load(f)
    rows = [_report.make_row(cfg, t, m) for t, m in zip(timed, memory["memory"])]
    cfg["memory_method"] = memory["method"]
    cfg["wall_s"] = round(time.perf_counter() - started, 1)
    cfg["notes"] = notes

    print(_report.header(cfg))
    print()
    print(_report.table(rows))
    print(f"\n{cfg['date']}, {cfg['machine']}, torch {cfg['torch_version']}, {cfg['wall_s']} s in all")
    if args.json:
        _report.write_json(args.json, cfg, rows)
        print(f"wrote {args.json}")
    if args.plot:
        _report.plot(args.plot, cfg, rows)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
