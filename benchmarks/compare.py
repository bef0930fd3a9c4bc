"""MiniDDP against torch's DistributedDataParallel, on the same path, with the limit beside them.

    python benchmarks/compare.py                       # CPU, Gloo, 2 ranks, mlp/cnn/ae/gpt, 5 runs
    python benchmarks/compare.py --quick --json r.json # the smoke test (< 1 minute on 2 quiet cores)
    python benchmarks/compare.py --show docs/compare.json   # the tables of an earlier run, measuring nothing
    python benchmarks/compare.py --bucket-sweep 1,5,25,100 --plot compare.png
    python benchmarks/compare.py --backend nccl --device cuda --world-size 1
    python benchmarks/compare.py --models mlp --trace overlap.json --plot compare.png
    python benchmarks/compare.py --learned-order
    python benchmarks/compare.py --link 1gbit          # ranks on real links shaped to 1 Gbit/s (root)

``--link RATE`` (``loopback`` is the default): every rank in a network
namespace of its own, joined to the others by links shaped to that rate
(``minddp/net/links.py``; needs root and iproute2), so that communication waits
on a wire instead of sharing the cores with backward. Then the bucket caps
default to a sweep of 0.25, 1, 5 and 25 MB, and a further table sets beside
each measured step the simulator's (``benchlib/prediction.py``) and each
wrapper's hidden fraction with its spread.

While it runs: one live progress line on a terminal (elsewhere, in a pipe or
CI, one plain line per model and run; ``benchlib/progress.py``), and
``bucket_cap_mb="auto"``'s decision once per model. At the end, first a
summary, one line per model: the ratios with their spread and what the
spread lets one say (faster, slower, even; ``benchlib/summary.py``); then the
tables below (all of them also in ``--json``).

The whole timing runs ``--runs`` times, every row (model and cap) of every
run in fresh rank processes of its own, so that ``auto`` chooses as it would
in a user's script, before any other model has trained in its process
(``benchlib/timing.py``'s ``Runner.warm_up``); every figure below is first
taken within a run, then reported as the median over
runs with its minimum and maximum (``benchlib/spread.py``). One run's ratio is
mostly noise on a shared machine; the spread says how much.

For every model (and bucket cap) one table row, all times in ms per step,
medians over rounds, each block's time the slowest rank's:

* ``local``: forward + backward + SGD step with no communication;
* ``allreduce``: all-reducing the gradient bytes alone, in DDP-like buckets;
* ``ideal`` = max(local, allreduce), the step with perfect overlap;
* ``bound``: the floor under any DDP step here, from ``forward`` (the
  forward pass alone), ``local`` and ``allreduce_flat`` (one all-reduce of
  every gradient in one flat buffer), timed in the same rounds: local + flat
  where the ranks have no core to spare (2 ranks on 2 cores: communication
  cannot overlap compute), else the DDP overlap bound, forward +
  max(backward and step, flat) with backward and step = local - forward (on
  a real link, a GPU, a spare core); the header says which
  (``benchlib/bound.py``). A table of its own gives every wrapper's step as
  a multiple of it and in ms above it, paired by round, median [min, max]
  over runs;
* ``naive``: a blocking all-reduce of every gradient after backward;
* ``torch copy``/``torch view`` and ``minddp copy``/``minddp view``: full
  steps with each wrapper, same bucket cap, ``gradient_as_bucket_view``
  False (both wrappers' default) and True; all implementations timed in
  rounds whose order rotates (``--bucket-view`` picks one setting);
* ``ratio copy``/``ratio view`` = minddp / torch with the same setting;
* ``minddp auto`` (skip it with ``--no-auto``): MiniDDP at its fastest,
  ``MiniDDP(bucket_cap_mb="auto", buffer_sync="with_gradients")``: it
  measures its first steps and the link, proposes buckets with the
  alpha-beta model (``minddp/net/bucket_planner.py``) and keeps the fastest
  of its proposals timed in turn (``minddp/net/plan_trials.py``), and its buffers ride in
  the last gradient bucket (``minddp/ddp/parts/buffers_in_bucket.py``); with how many
  buckets it chose; ``ratio auto`` = minddp auto / torch copy (torch at its
  defaults). It is stepped until its buckets are final before timing;
* ``max diff``: largest parameter difference between torch's DDP and MiniDDP
  after the same steps from the same weights on the same data (0: bit-equal).

A second table, the **wrapper overhead** (skip it with ``--no-overhead``):
the four wrappers again, each with a communication hook that returns its
bucket at once (``wrappers.return_bucket``), so what a step costs beyond the
bare model's step of the same round is the wrapper's own work: hooks,
copies, callbacks, the buffer broadcast. In ms and as a fraction of
``local``; and MiniDDP minus torch's DDP, paired the same way. Where this
figure goes, ``profile_overhead.py`` shows.

A third: the peak memory each wrapper adds (construction + steps, in fresh
windows: ``torch.cuda.max_memory_allocated`` on GPU, peak RSS on CPU; see
``benchlib/memory.py`` for why ``ru_maxrss`` alone would be unfair; the lowest
of 5 windows per wrapper (3 with ``--quick``), the wrappers taking turns), and the fraction
of the all-reduce each wrapper hid behind compute::

      hidden = (local + allreduce - t) / allreduce, clipped to [0, 1]

How it runs: the ranks are spawned processes (``minddp.launch.spawn``), each
with ``--threads-per-rank`` intra-op threads; the rank side is
``benchlib/rank_work.py``, each row measured by ``benchlib/timing.py`` (wrappers in
``benchlib/wrappers.py``, models and their batches in
``benchlib/models.py``), the statistics ``benchlib/spread.py``, the tables/JSON/plot
``benchlib/report.py``. Data are fixed random tensors (images of MNIST shape, or
token sequences for ``gpt``), seeded per rank: this measures steps, not
learning.

Two extras (rank side in ``benchlib/overlap.py``, reading traces in ``minddp/ddp/observers/trace_view.py``):

* ``--trace PATH.json``: after the timings, a few more steps of
  ``MiniDDP(trace=True)`` per model, written as a Chrome trace (open it in
  https://ui.perfetto.dev); with several models the model's name goes into
  the file name (``PATH-mlp.json``). With ``--plot``, a PNG beside each
  trace (``PATH-mlp.png``) shows per rank the backward span and one bar per
  bucket all-reduce, so you see which ones hid under backward;
* ``--learned-order [CAP_MB]``: MiniDDP with ``learn_bucket_order=True``
  against ``False`` on ``shuffled_mlp``, a model whose layers are registered
  in a different order than they run, at bucket cap CAP_MB (default 2): a
  separate table, and a ``learned_order`` list in the JSON (measured in the
  first run only).

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
import time


from benchlib import bound, report, runs, spread, summary
from benchlib.models import ALL_MODELS, DEFAULT_MODELS
from benchlib.wrappers import like_for_like_hook
from minddp.net import links

# The default: 5 runs of 40 steps per implementation (8 rounds of 5). One
# run's ratio moved by +-10% between runs on the shared 2-core machine; five
# give a median and a min-max that a sixth run falls inside 2 times in 3.
RUNS, STEPS, REPEATS, WARMUP = 5, 40, 8, 3
TRACE_STEPS = 3  # steps kept in each --trace file, after warm-up
# At the default 25 MB cap shuffled_mlp's 9.6 MiB are two buckets, and their order barely matters.
LEARNED_ORDER_CAP_MB = 2.0


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"bucket caps must be positive, got {text!r}")
    return values


LINK_SWEEP_MB = [0.25, 1.0, 5.0, 25.0]  # --link without --bucket-sweep: the U of bucket sizes on the wire


def _link(text: str) -> str:
    """``loopback`` or a rate for :mod:`minddp.net.links` (normalised: ``1Gbit`` -> ``1gbit``)."""
    if text == "loopback":
        return text
    try:
        return links.format_rate(links.parse_rate(text))
    except links.LinkError as e:
        raise argparse.ArgumentTypeError(f"{e}, or loopback") from None


def _model_list(text: str) -> list[str]:
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
    p.add_argument("--link", type=_link, default="loopback", metavar="RATE",
                   help="loopback (every rank on this machine's one network stack), or a rate such as 100mbit, "
                   "1gbit, 10gbit: every rank in a network namespace of its own, joined by links shaped to that "
                   f"rate (minddp/net/links.py; needs root and iproute2); then the bucket sweep defaults to "
                   f"{','.join(f'{c:g}' for c in LINK_SWEEP_MB)} MB")  # fmt: skip
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--bucket-sweep", type=_floats, default=None, metavar="1,5,25,100",
                   help="measure every one of these bucket caps (MB) instead of --bucket-cap-mb alone")  # fmt: skip
    p.add_argument("--runs", type=int, default=None,
                   help=f"repeat the whole timing in fresh processes; report medians and min-max over runs "
                   f"(default {RUNS}, quick 1)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps per implementation and run (default {STEPS}, quick 4)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=None,
                   help=f"rounds the steps are split into (default {REPEATS}, quick 2)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps first (default {WARMUP}, quick 2)")
    p.add_argument("--models", type=_model_list, default=DEFAULT_MODELS, help="comma-separated, from " + ",".join(ALL_MODELS))
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--comm-hook", choices=["none", "allreduce", "fp16", "bf16"], default="none",
                   help="both wrappers get the same hook (torch's own for torch's DDP, minddp.ddp.default_hooks for MiniDDP)")  # fmt: skip
    p.add_argument("--bucket-view", choices=["both", "copy", "view"], default="both",
                   help="gradient_as_bucket_view settings to time, each on both wrappers: copy = False "
                   "(both wrappers' default), view = True")  # fmt: skip
    p.add_argument("--no-auto", action="store_true",
                   help="skip the auto column (MiniDDP with bucket_cap_mb='auto' and buffer_sync='with_gradients', against torch's DDP at its defaults)")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the wrapper-overhead measurement (each wrapper with a comm hook that communicates nothing)")  # fmt: skip
    p.add_argument("--show", metavar="PATH.json", default=None,
                   help="measure nothing: print the tables of a JSON file this script wrote")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="few steps: a smoke test, under a minute on 2 cores")
    p.add_argument("--json", metavar="PATH", default=None, help="write config and results as JSON")
    p.add_argument("--plot", metavar="PATH.png", default=None, help="draw the results (needs matplotlib: pip install '.[plot]')")
    p.add_argument("--trace", metavar="PATH.json", default=None,
                   help="after timing, write a Chrome trace of a few MiniDDP(trace=True) steps per model "
                   "(with --plot also a PNG beside it)")  # fmt: skip
    p.add_argument("--learned-order", type=float, nargs="?", const=LEARNED_ORDER_CAP_MB, default=None,
                   metavar="CAP_MB", help="also time MiniDDP with learn_bucket_order True vs False on shuffled_mlp, "
                   f"at this bucket cap (default {LEARNED_ORDER_CAP_MB:g} MB: about ten buckets of its 9.6 MiB)",
                   )  # fmt: skip
    args = p.parse_args(argv)
    if args.runs is None:
        args.runs = 1 if args.quick else RUNS
    if args.steps is None:
        args.steps = 4 if args.quick else STEPS
    if args.repeats is None:
        args.repeats = 2 if args.quick else REPEATS
    if args.warmup is None:
        args.warmup = 2 if args.quick else WARMUP
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    if args.link != "loopback" and args.bucket_sweep is None:
        args.bucket_sweep = list(LINK_SWEEP_MB)
    for name in ("runs", "steps", "repeats", "world_size", "threads_per_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 2:
        p.error("--warmup must be at least 2: torch's DDP rebuilds its buckets after its first step")
    args.repeats = min(args.repeats, args.steps)
    unknown = [m for m in args.models if m not in ALL_MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(ALL_MODELS)}")
    if args.learned_order is not None and args.learned_order <= 0:
        p.error(f"--learned-order CAP_MB must be positive, got {args.learned_order:g}")
    if args.trace and not args.trace.endswith(".json"):
        p.error(f"--trace names a .json file, got {args.trace!r}")
    if args.trace and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
        p.error(f"--trace {args.trace}: its folder does not exist")
    if args.backend == "nccl" and args.device != "cuda":
        p.error("NCCL only reduces CUDA tensors: use --device cuda (or --backend gloo)")
    return args


def check_environment(args: argparse.Namespace) -> list[str]:
    """Adjust what the machine cannot do; return the notes to print."""
    notes = []
    if args.link != "loopback" and links.missing():
        print(f"error: --link {args.link}: {links.missing()}", file=sys.stderr)
        sys.exit(2)
    if args.plot and not report.have_matplotlib():
        print(f"error: {report.PLOT_INSTALL_HINT}", file=sys.stderr)
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
    args.comm_hook, note = like_for_like_hook(args.comm_hook, args.world_size)  # world size 1: both communicate
    return notes + ([note] if note else [])


def config(args: argparse.Namespace) -> dict:
    import torch

    # The auto column (with copy among the settings: it is set against torch_copy) is stepped
    # until its buckets are final before the timing (benchlib.timing.Runner.settle).
    # Alone (world size 1) there is no network to plan for: MiniDDP keeps its default, no column.
    auto = not args.no_auto and args.bucket_view in ("both", "copy") and args.world_size > 1

    return {
        "backend": args.backend,
        "device": args.device,
        "world_size": args.world_size,
        "bucket_cap_mb": args.bucket_cap_mb,
        "bucket_caps": args.bucket_sweep or [args.bucket_cap_mb],
        "models": args.models,
        "runs": args.runs,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "memory_steps": 1 if args.quick else 2,
        "memory_windows": 3 if args.quick else 5,  # each peak: the lowest of these (benchlib/memory.py)
        "threads_per_rank": args.threads_per_rank,
        "comm_hook": args.comm_hook,
        "bucket_views": ["copy", "view"] if args.bucket_view == "both" else [args.bucket_view],
        "overhead": not args.no_overhead,
        "auto": auto,
        "link": args.link,
        "bound_rule": bound.bound_rule(args.device, args.world_size, args.threads_per_rank, link=args.link),
        "quick": args.quick,
        "learned_order_cap_mb": args.learned_order,  # None: not measured
        "trace_files": runs.trace_files(args.trace, args.models) if args.trace else {},
        "trace_steps": TRACE_STEPS,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"
        + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/compare.py " + " ".join(sys.argv[1:]),
    }


def show(cfg: dict, rows: list[dict], learned: list[dict]) -> None:
    """The summary a person reads first, then every table."""
    print(summary.summary(cfg, rows))
    print()
    print(report.all_tables(cfg, rows))
    if learned:
        print()
        print(report.learned_order_text(learned))


def footer(cfg: dict) -> str:
    return f"{cfg['date']}, {cfg['machine']}, torch {cfg['torch_version']}, {cfg['wall_s']} s in all ({cfg['command']})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.show:
        with open(args.show) as f:
            data = json.load(f)
        show(data["config"], data["results"], data.get("learned_order", []))
        print(f"\n{footer(data['config'])}")
        return 0
    notes = check_environment(args)
    for note in notes:
        print(note)

    cfg = config(args)
    started = time.perf_counter()
    measured = runs.measure(cfg)
    if measured is None:
        return 1
    timed_runs, learned_timed, peaks = measured
    rows = spread.make_rows(cfg, timed_runs, peaks["memory"])
    learned = [report.make_learned_order_row(r) for r in learned_timed]
    cfg["memory_method"] = peaks["method"]
    cfg["wall_s"] = round(time.perf_counter() - started, 1)
    cfg["notes"] = notes

    show(cfg, rows, learned)
    if cfg["trace_files"]:
        print()
        runs.report_traces(cfg, plot=bool(args.plot))
    print(f"\n{footer(cfg)}")
    if args.json:
        report.write_json(args.json, cfg, rows, learned)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(args.plot, cfg, rows)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
