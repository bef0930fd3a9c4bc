"""Lesson 08: ``minddp.MiniDDP`` -- lesson 07c's reducer in the library, and equal to torch's DDP.

What you will learn
    Lesson 07c grew 07b's ``FlatDDP`` into a reducer one small diff at a
    time; its last step is one diff away from the library's own
    ``minddp/ddp/core/reducer.py``, and this lesson prints that diff (run it
    yourself: ``diff lessons/wrappers/observed_reducer.py
    minddp/ddp/core/reducer.py``) and trains the library's reducer on the
    same bench. ``minddp.MiniDDP`` is that reducer inside a module: rank 0's
    start (parameters and buffers), a forward that arms the reducer and
    brings the buffers into line, ``no_sync()``, and torch's DDP arguments.

    Everything else torch's DDP does is a *part* beside that path, one file
    each in ``minddp/ddp/parts/``, chosen by MiniDDP's constructor only when
    asked for, or a *policy* that acts between backwards
    (``minddp/ddp/policies.py``: the learned bucket order); the lesson lists
    them with the lesson that explains each. Then it follows one gradient
    down the path on every rank: ``model.follow(name)``.

What to run
    python lessons/08_minddp.py [--world-size 3] [--bucket-cap-mb 25]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    The test bench's table for MiniDDP and torch's DDP (both exact, with
    accumulation through ``no_sync``); the diffs; the parts; the buckets
    MiniDDP built, in launch order; one gradient's stations with values and
    times on each rank. Then read ``minddp/ddp/wrapper.py`` and ``minddp/ddp/core/``
    top to bottom (``docs/reading_the_code.md``).

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict the order of the names in bucket 0.
    2. ``--bucket-cap-mb 25`` (torch's default): predict how many buckets and
       whether the first one still leaves before the last gradient.
    3. In the followed gradient, predict which stations show the same values
       on every rank.
"""

import ast
import difflib
import importlib
import inspect
import pkgutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp.ddp.parts
from minddp import MiniDDP
from minddp.ddp.core.reducer import Reducer
from minddp.ddp.core.slots import Observer
from _common import is_exact, parse_args, print0, print_ranks, print_results, run, train_and_compare
from wrappers.reducing_module import ReducingModule

ROOT = Path(__file__).resolve().parents[1]
LAST_STEP, CORE = ROOT / "lessons/wrappers/observed_reducer.py", ROOT / "minddp/ddp/core/reducer.py"

# Every part in minddp/ddp/parts/ (the observers in minddp/ddp/observers/, the policies in minddp/ddp/policies.py),
# with what picks it and the lesson that explains the feature. The slot is read from the class (show_the_parts).
PARTS = {
    "EveryHookReady": ("default (the plain path: ready at its hook)", "07b"),
    "CopyGradients": ("default (reduce_dtype sets only the buckets' dtype)", "07b, 13"),
    "AllReduce": ("default", "07b"),
    "UnusedParameters": ("find_unused_parameters=True", "18"),
    "StaticGraph": ("static_graph=True", "08 (docs/reading_the_code.md)"),
    "GradientCases": ("find_unused_parameters, static_graph, or sparse embeddings", "18, 19"),
    "BucketViews": ("gradient_as_bucket_view=True; ZeRO stage 2", "19"),
    "LentBuckets": ("ZeRO stage 2 (its pool); lazy_bucket_allocation=True", "20"),
    "CommHook": ("register_comm_hook(state, hook)", "13"),
    "BuffersInLastBucket": ('buffer_sync="with_gradients"', "10"),
    "RidesInLastBucket": ('buffer_sync="with_gradients"', "10"),
    "ReplicaChecks": ("check_sync_every=N", "18"),
    "MiniDDPJoinHook": ("with model.join():", "18"),
    "Follow": ('model.follow("0.weight")', "08"),
    "StepObserver": ("timeline=True or trace=True", "16"),
    "ProfilerRanges": ("a torch.profiler recording", "16"),
    "ArrivalOrder": ("learn_bucket_order (first backward)", "07b"),
    "LearnedBucketOrder": ("learn_bucket_order=True (the default)", "07b"),
    "Policies": ("a policy attached (the learned order, ZeRO stage 2, plan_buckets)", "07b, 17b, 20"),
}
SLOTS = (("is_ready", "readiness"), ("fill_bucket", "gradients"), ("communicate", "communication"),
         ("pack", "rides along"), ("before_forward", "forward"), ("backwards_until_final", "policy"))


def code_lines(path: Path) -> list:
    """The file's non-blank lines after its module docstring."""
    source = path.read_text()
    first = ast.parse(source).body[0]
    docstring_end = first.end_lineno if isinstance(first, ast.Expr) else 0
    return [line for i, line in enumerate(source.splitlines(), 1) if i > docstring_end and line.strip()]


def show_the_last_diff() -> int:
    """Lesson 07c's last step against the library's reducer, as ``diff`` shows it; the lines changed."""
    diff = list(difflib.unified_diff(code_lines(LAST_STEP), code_lines(CORE), str(LAST_STEP.relative_to(ROOT)),
                                     str(CORE.relative_to(ROOT)), lineterm="", n=1))
    print0(f"\n--- lesson 07c's last step -> the library's reducer (blank lines and docstrings left out):")
    for line in diff:
        print0("  " + line)
    return sum(line[:1] in "+-" for line in diff if not line.startswith(("+++", "---")))


def slot_of(part: type) -> str:
    if part is Observer or inspect.isabstract(part):
        return ""  # a base class, not a part
    if issubclass(part, Observer):
        return "observer"
    return next((slot for method, slot in SLOTS if hasattr(part, method)), "")


def show_the_parts() -> list:
    found = {}
    modules = [f"minddp.ddp.parts.{info.name}" for info in pkgutil.iter_modules(minddp.ddp.parts.__path__)]
    for module in map(importlib.import_module, modules + ["minddp.ddp.observers.follow", "minddp.ddp.observers.trace",
                                                       "minddp.ddp.core.reducer", "minddp.ddp.policies"]):
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and slot_of(obj):
                found[name] = (slot_of(obj), module.__name__.replace(".", "/") + ".py")
    print0("\nThe parts (the plain ones too), each chosen at construction or by the call that asks for it:")
    for name, (slot, path) in sorted(found.items(), key=lambda item: item[1]):
        asked, lesson = PARTS.get(name, ("?", "?"))
        print0(f"  {slot:<13} {name:<19} {path:<40} {asked:<58} lesson {lesson}")
    return sorted(found)


def follow_one_gradient(ddp, rank: int) -> tuple:
    """One more synchronized step of the bench's model, following its first layer's weight."""
    name = ddp.bucket_names[-1][-1]
    followed = ddp.follow(name)
    x = torch.randn(8, ddp.module[0].in_features, generator=torch.Generator().manual_seed(rank))
    ddp.zero_grad()
    ddp(x).square().mean().backward()
    print0(f"\nFollowing {name!r} down the path in one synchronized backward (values: its first 3 elements):")
    print_ranks("\n" + followed.report())
    stations = {station: values for _, station, _, values in followed.stations}
    followed.stop()
    return stations


def show_buffers(rank: int) -> None:
    model = nn.Sequential(nn.Linear(20, 8), nn.BatchNorm1d(8))
    model[1].running_mean.fill_(float(rank))  # different on purpose: construction must fix it
    before = model[1].running_mean[0].item()
    MiniDDP(model)
    print0("\nBatchNorm's running mean, before -> after MiniDDP(model):")
    print_ranks(f"{before:+.1f} -> {model[1].running_mean[0].item():+.1f}")
    assert model[1].running_mean[0].item() == 0.0, "rank 0's buffers everywhere"


def main(rank: int, world_size: int, args) -> None:
    cap = args.bucket_cap_mb  # 0.005 MiB ~ 5 KB: several buckets even for a small model (each closes past it)
    variants = [("MiniDDP", lambda m: MiniDDP(m, bucket_cap_mb=cap, timeline=True)),
                ("torch DDP", lambda m: TorchDDP(m, bucket_cap_mb=cap))]
    results, wrappers = [], []
    for k in (1, 2):
        for name, wrap in variants:
            result, ddp = train_and_compare(f"{name}, {k} micro-batch(es)", wrap, rank, world_size, micro_batches=k)
            results.append(result)
            wrappers.append(ddp)
    core = train_and_compare("the core's Reducer alone", lambda m: ReducingModule(m, Reducer, cap * 2**20), rank,
                             world_size, micro_batches=2)[0]
    print0(f"{world_size} ranks on the test bench of lessons 04-07c:")
    print_results(results + [core])
    changed = show_the_last_diff()
    layers = show_the_parts()

    ours = wrappers[0]
    print0(f"\nMiniDDP's buckets after training, in launch order ({len(ours.bucket_names)} buckets; rebuilt before "
           "the second forward, in the order the first backward showed):")
    for i, names in enumerate(ours.bucket_names):
        print0(f"  bucket {i}: {', '.join(names)}")
    tl = ours.timeline
    several = len(ours.bucket_names) > 1
    early = tl.launches[0] < tl.last_hook
    stations = follow_one_gradient(ours, rank)
    show_buffers(rank)

    assert all(is_exact(r) for r in results + [core]), f"every row exact expected, got {results + [core]}"
    assert 0 < changed, "the library's reducer is one more step, not lesson 07c's last one"
    assert [r.all_reduces for r in results[0::2]] == [r.all_reduces for r in results[1::2]], (
        "MiniDDP's buckets are torch's: as many all-reduces in each row pair")
    assert set(layers) == set(PARTS), f"the table above must list every part: {set(layers) ^ set(PARTS)}"
    assert ours.bucket_names[0][:2] == ["4.bias", "4.weight"], (
        f"the learned order starts with the last layer's bias, then its weight; bucket 0 is {ours.bucket_names[0]}")
    assert several == early, "a first bucket leaves early exactly when there are several"
    assert all(abs(s - h / world_size) <= 1e-6 * abs(h) for s, h in zip(stations["slot"], stations["hook"])), (
        "the slot holds the gradient times 1/N")
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (stations["hook"], stations[".grad"]))
    average = [sum(h[i] for h, _ in everyone) / world_size for i in range(len(stations["hook"]))]
    assert all(abs(g - a) <= 1e-6 * max(1.0, abs(a)) for g, a in zip(stations[".grad"], average)), (
        f".grad is the average of the ranks' hooks: {stations['.grad']} against {average}")
    assert all(g == everyone[0][1] for _, g in everyone), "the same .grad on every rank"
    print0("\nchecked: MiniDDP and torch's DDP are both exact on the bench, with and without")
    print0("         accumulation; the learned order starts with the last layer's bias;")
    print0("         " + ("the first bucket left before the last gradient hook;" if several else
                         "one bucket, launched only with the last gradient;") + " construction fixed the buffers;")
    print0(f"         every one of the {len(layers)} parts is listed; the followed .grad is the average of the hooks;")
    print0(f"         the library's reducer is {changed} changed lines from lesson 07c's last step, and as exact.")


def options(parser) -> None:
    parser.add_argument("--bucket-cap-mb", type=float, default=0.005, help="bucket cap in MiB (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args)
