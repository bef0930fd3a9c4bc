"""``plan_buckets`` against torch's DDP at every cap of a sweep, all timed in the same rounds.

    python benchmarks/experiments/auto_vs_caps.py --models mlp,gpt --link 1gbit --runs 3

``compare.py`` times one bucket cap after another, so its rows compare
moments as much as caps: on loopback its sweep read torch's DDP 14% (mlp)
and 29% (ae) faster at 1 MB than at its default, where this script, timing
both in the same rounds, finds them within a few percent. Here every rank
builds, per model, torch's DDP at each cap (the 25 MB one: no cap given,
torch's real default) and MiniDDP with ``plan_buckets`` (and
``buffer_sync="with_gradients"``, as in ``compare.py``), warms each up past
``auto``'s choice, then times ``--rounds`` rounds of one block per wrapper,
the order rotating by one each round (each block: the slowest rank's ms per
step). In each run, torch's best cap is the one with the lowest median
step over the even rounds, and ``auto / torch's best`` the median of the
ratio within each odd round (a quiet spell that picks a cap does not also
flatter it). Every run starts fresh processes for each model (``auto``
chooses again, as in a user's script: before any other model has
trained, which had it keep a slower plan on mlp in 14 of 30 runs,
``Runner.warm_up``); reported: the median [min, max] over runs, and the odd rounds'
ratios of every run together, their median with a 95% bootstrap interval
that resamples the runs and, within each, its rounds (runs drift: a
day's runs can move a pair by 2% with nothing changed).
The target, ``auto`` at most 1.02 of torch's best cap, is judged on
that interval: **met** when all of it is at most 1.02, **missed** when all
of it is above, else **not told apart** (more rounds and runs narrow it: 10
rounds a run read a 4% gap on loopback that 150 did not). ``--show`` prints
the table of a saved JSON again; given several, it pools their runs, one
table per link and ranks (runs of the same code, as several days' runs
of one pair), each model from the files that hold it. ``--plans 4:4,5:1`` adds MiniDDP at those
fixed plans (cap and first bucket's cap, MB) to the same rounds, each set
against torch's best cap as ``auto`` is, in a second table: whether what
``auto`` misses is its choice or MiniDDP's step at it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import sys
import tempfile

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),  # the repository
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # benchmarks/: benchlib

import torch  # noqa: E402

from minddp import MiniDDP  # noqa: E402
from minddp.ddp.core.assignment import MiB  # noqa: E402
from minddp_lab.links import spawn  # noqa: E402

from benchlib.timing import Runner  # noqa: E402
from benchlib.wrappers import AUTO, DEFAULT_CAP_MB  # noqa: E402

TARGET = 1.02  # the target: auto at most torch's best cap + 2%
CAPS_MB = (0.25, 1.0, 5.0, DEFAULT_CAP_MB)  # the sweep; 25 is torch's default (no cap given)
WARMUP = 3  # steps of every wrapper before timing (auto's: after its buckets are final)
RESAMPLES = 2000  # bootstrap resamples behind each interval


def _torch_name(cap: float) -> str:
    return f"torch@{cap:g}"


def _plan_name(plan: list[float]) -> str:
    return f"minddp@{plan[0]:g}:{plan[1]:g}"


def _fixed_plan(runner: Runner, plan: list[float]):
    """A step of MiniDDP at ``plan`` (as ``auto``'s wrapper: ``buffer_sync="with_gradients"``), its buckets
    rebuilt with the learned order and ``plan``'s caps, as ``auto`` rebuilds them for a plan it keeps: after
    its second step, a warm-up one (it takes no step before ``auto`` has chosen: ``Runner.warm_up``)."""
    ddp = MiniDDP(runner.fresh(), buffer_sync="with_gradients")
    if runner.minddp_hook is not None:
        ddp.register_comm_hook(None, runner.minddp_hook)
    plain = runner.stepper(ddp)

    def step() -> None:
        plain()
        if plain.count[0] == 2:  # the first backward learned the order, the next forward built its buckets
            ddp.reducer.rebuild(ddp.reducer.bucket_order, int(plan[0] * MiB), int(plan[1] * MiB))

    step.module, step.count = ddp, plain.count
    return step


def _measure(rank: int, world_size: int, cfg: dict, model: str, out_path: str) -> None:
    """One run of every wrapper on ``model``, in processes where no other model has trained."""
    torch.set_num_threads(1)
    runner = {cap: Runner(cfg, model, cap, rank, world_size, torch.device("cpu")) for cap in cfg["caps"]}
    first = runner[cfg["caps"][0]]
    steps = {_torch_name(cap): runner[cap].stepper(runner[cap].wrapped("torch_copy")) for cap in cfg["caps"]}
    steps[AUTO] = first.stepper(first.wrapped(AUTO))
    for plan in cfg.get("plans", []):
        steps[_plan_name(plan)] = _fixed_plan(first, plan)
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # auto's decision line
        blocks = first.block_times(steps)
    decision = next((line for line in printed.getvalue().splitlines() if "bucket_cap_mb=" in line), "")
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"block_ms": blocks, "auto_buckets": len(steps[AUTO].module.bucket_names),
                       "auto_decision": decision,
                       "plan_buckets": {_plan_name(plan): len(steps[_plan_name(plan)].module.bucket_names)
                                        for plan in cfg.get("plans", [])}}, f)


def run_figures(blocks: dict[str, list[float]], caps: list[float], plans: list[str] = ()) -> dict:
    """One run's figures from its block times (every name: one ms per step per round, the same rounds);
    ``plans``: the names of MiniDDP's fixed plans, each set against torch's best cap as ``auto`` is.

    torch's best cap is chosen on the even rounds and ``auto`` is set against it on the odd ones: the
    lowest of four noisy medians is lower than its cap's true step (a quiet spell picks it), so a ratio
    to it taken from the same rounds would count that spell against ``auto``."""
    choose = {name: statistics.median(times[0::2]) for name, times in blocks.items()}
    best = min(caps, key=lambda cap: choose[_torch_name(cap)])

    def ratios(cap: float, rounds: slice, name: str = AUTO) -> list[float]:
        return [a / t for a, t in zip(blocks[name][rounds], blocks[_torch_name(cap)][rounds])]

    judged = ratios(best, slice(1, None, 2))
    return {"ms": {name: statistics.median(times) for name, times in blocks.items()}, "best_cap": best,
            "auto_over_best": statistics.median(judged), "auto_over_best_rounds": judged,
            "auto_over_default": statistics.median(ratios(DEFAULT_CAP_MB, slice(None))),
            "plans_over_best_rounds": {plan: ratios(best, slice(1, None, 2), plan) for plan in plans}}


def pooled_interval(runs: list[list[float]], seed: int = 0) -> tuple[float, float, float]:
    """The median of every run's ratios together, and a 95% bootstrap interval of it.

    Each resample draws as many runs as there are (with replacement), then within each drawn run as
    many of its ratios as it has: a run keeps its weight, and with it the plan its ``auto`` chose.
    Both kinds of doubt are in the interval: the rounds' noise, and how much the runs differ (on
    these shared cores a day's runs move a pair by as much as the target, with nothing
    changed). Resampling the rounds alone would read the runs as all there is."""
    rng = random.Random(seed)
    medians = sorted(statistics.median([r for run in rng.choices(runs, k=len(runs))
                                        for r in rng.choices(run, k=len(run))])
                     for _ in range(RESAMPLES))
    return (statistics.median([r for run in runs for r in run]),
            medians[round(0.025 * (RESAMPLES - 1))], medians[round(0.975 * (RESAMPLES - 1))])


def verdict(low: float, high: float) -> str:
    """The target on an interval: ``met`` when all of it is at most :data:`TARGET`, ``missed`` when all
    of it is above, else ``not told apart``."""
    if high <= TARGET:
        return "met"
    if low > TARGET:
        return "missed"
    return "not told apart"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def pooled_runs(saved: list[dict]) -> list[tuple[dict, list[dict]]]:
    """The runs of several JSONs this script wrote, pooled: one ``(config, runs)`` per link, ranks and
    caps, in the order the files come. A model's runs are those of the files that hold it; MiniDDP's
    fixed plans only if every file of the group timed the same ones."""
    groups: dict[tuple, list[dict]] = {}
    for other in saved:
        cfg = other["config"]
        groups.setdefault((cfg["link"], cfg["world_size"], tuple(cfg["caps"])), []).append(other)
    pooled = []
    for files in groups.values():
        cfg = files[0]["config"]
        models = list(dict.fromkeys(m for other in files for m in other["config"]["models"]))
        rounds = sorted({other["config"]["repeats"] for other in files})
        same_plans = all(other["config"].get("plans", []) == cfg.get("plans", []) for other in files)
        cfg = {**cfg, "models": models, "plans": cfg.get("plans", []) if same_plans else [],
               "repeats": rounds[0] if len(rounds) == 1 else f"{rounds[0]} to {rounds[-1]}"}
        pooled.append((cfg, [{m: run[m] for m in other["config"]["models"]} for other in files
                             for run in other["runs"]]))
    return pooled


def report(cfg: dict, runs: list[dict]) -> str:
    """The table: per model, each wrapper's median step over runs, torch's best cap, and the ratios."""
    caps = cfg["caps"]
    head = [f"torch {cap:g} MB" + (" (default)" if cap == DEFAULT_CAP_MB else "") for cap in caps]
    model_runs = {model: [r[model] for r in runs if model in r] for model in cfg["models"]}  # pooled files may differ
    counts = sorted({len(of_model) for of_model in model_runs.values()})
    how_many = f"{counts[0]} run(s)" if len(counts) == 1 else f"{counts[0]} to {counts[-1]} runs a model,"
    lines = [
        f"auto against torch's DDP at every cap, timed in the same rounds ({cfg['world_size']} ranks, {cfg['link']}, "
        f"{how_many} of {cfg['repeats']} rounds): ms per step, median over runs; ratios median [min, max] "
        f"over runs; pooled: every run's odd rounds together, median [95% bootstrap interval, the runs and their "
        f"rounds resampled]; target: auto at "
        f"most {TARGET:.2f} of torch's best cap, judged on the pooled interval",
        "| model | " + " | ".join(head) + " | auto (buckets) | torch's best cap (per run) | auto / best | "
        "auto / best, pooled | auto / default | target |",
        "|---" * (len(caps) + 7) + "|",
    ]
    for model in cfg["models"]:
        figures = [run_figures(r["block_ms"], caps) for r in model_runs[model]]
        ms = [statistics.median(f["ms"][_torch_name(cap)] for f in figures) for cap in caps]
        auto_ms = statistics.median(f["ms"][AUTO] for f in figures)
        buckets = ",".join(str(r["auto_buckets"]) for r in model_runs[model])
        best = ",".join(f"{f['best_cap']:g}" for f in figures)
        pooled, low, high = pooled_interval([f["auto_over_best_rounds"] for f in figures])
        cells = [f"{m:.1f}" for m in ms] + [f"{auto_ms:.1f} ({buckets})", best,
                                            _spread([f["auto_over_best"] for f in figures]),
                                            f"{pooled:.3f} [{low:.3f}, {high:.3f}]",
                                            _spread([f["auto_over_default"] for f in figures]), verdict(low, high)]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    if cfg.get("plans"):
        lines += ["", "MiniDDP at fixed plans in the same rounds, against torch's best cap as auto is: ms per step, "
                  "median over runs; pooled ratio, median [95% bootstrap interval]",
                  "| model | plan (cap:first MB) | buckets (per run) | ms per step | / torch's best, pooled |",
                  "|---|---|---|---|---|"]
        for model in cfg["models"]:
            names = [_plan_name(plan) for plan in cfg["plans"]]
            figures = [run_figures(r["block_ms"], caps, names) for r in model_runs[model]]
            for name in names:
                buckets = ",".join(str(r["plan_buckets"][name]) for r in model_runs[model])
                ms = statistics.median(f["ms"][name] for f in figures)
                pooled, low, high = pooled_interval([f["plans_over_best_rounds"][name] for f in figures])
                lines.append(f"| {model} | {name.removeprefix('minddp@')} | {buckets} | {ms:.1f} | "
                             f"{pooled:.3f} [{low:.3f}, {high:.3f}] |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn,ae,gpt", help="comma-separated (default: compare.py's four)")
    parser.add_argument("--link", default="loopback", help="loopback, or a rate such as 1gbit (root; minddp_lab/links/namespaces.py)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="fresh processes each; auto chooses again (default 3)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of one block per wrapper (default 30)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block (default 3)")
    parser.add_argument("--plans", default="", help="MiniDDP at fixed plans too, cap:first-bucket cap in MB, "
                        "comma-separated (as 4:4,5:1)")
    parser.add_argument("--json", metavar="PATH", help="also write every run's block times and the table here")
    parser.add_argument("--show", metavar="PATH.json", nargs="+",
                        help="measure nothing: the table of JSONs this script wrote (several: their runs pooled)")
    args = parser.parse_args()
    if args.show:
        saved = []
        for path in args.show:
            with open(path) as f:
                saved.append(json.load(f))
        print("\n\n".join(report(cfg, runs) for cfg, runs in pooled_runs(saved)))
        return
    cfg = {"models": args.models.split(","), "caps": list(CAPS_MB), "link": args.link, "world_size": args.world_size,
           "comm_hook": "none", "backend": "gloo", "warmup": WARMUP, "repeats": args.rounds,
           "steps": args.rounds * args.steps,
           "plans": [[float(x) for x in plan.split(":")] for plan in args.plans.split(",") if plan]}
    runs = []
    with tempfile.TemporaryDirectory(prefix="minddp-auto-vs-caps-") as tmp:
        out_path = os.path.join(tmp, "run.json")
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
            runs.append({})
            for model in cfg["models"]:  # each in processes of its own: no other model trained before auto chose
                spawn(_measure, args.world_size, cfg, model, out_path, link=None if args.link == "loopback" else args.link)
                with open(out_path) as f:
                    runs[-1][model] = json.load(f)
                print(f"  {model}: {runs[-1][model]['auto_decision']}", file=sys.stderr, flush=True)
    table = report(cfg, runs)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {**cfg, "command": " ".join(["python", *sys.argv])}, "runs": runs, "table": table}, f)


if __name__ == "__main__":
    main()
