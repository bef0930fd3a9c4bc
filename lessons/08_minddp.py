"""Lesson 08: ``minddp.MiniDDP`` -- lesson 07b's wrapper grown up, and equal to torch's DDP.

What you will learn
    ``MiniDDP``'s plain path -- what a default ``MiniDDP(model)`` step runs --
    is lesson 07b's ``FlatDDP`` with four changes, which this lesson prints
    as diffs of the real code (07b's methods against minddp's):

    * the hook only *counts* a gradient in its bucket; when the bucket is
      complete, all its gradients are copied in, times 1/N, in one batched
      call, and the complete buckets are launched strictly in order (07).
      torch's DDP copies one gradient at a time unless given
      ``batched_grad_copy=True`` (an argument of every torch minddp
      supports, 2.13 to 2.15); ``lazy_bucket_allocation=True`` (torch's from
      2.15; MiniDDP takes it on 2.13 and 2.14 too) allocates a bucket's
      buffer only at that copy and frees it once ``.grad`` is written, so no
      bucket is held between steps;
    * the end-of-backward callback (07b) is queued again if a nested
      backward pass (a reentrant activation checkpoint) ends first, and
      waits for each bucket before writing its averages into ``.grad``;
    * a parameter that got no gradient is an error naming it, not an assert
      (``find_unused_parameters=True`` makes it count as zero instead);
    * rank 0's broadcast covers buffers at construction and again before
      every forward that follows a synchronized one (``broadcast_buffers``).

    One more change has no diff worth printing: the hooks hold the reducer
    weakly (``minddp/ddp/weak_hooks.py``). A hook lives in the parameter's
    autograd data, in C++, where Python's garbage collector cannot look, so
    07b's hooks, bound methods of the wrapper, keep a dropped wrapper alive,
    and with it the model, its buckets and the process group, until the
    process exits.

    Everything else torch's DDP does is a *part* beside that path, one file
    each in ``minddp/ddp/parts/``, chosen by MiniDDP's constructor only when
    asked for; the lesson lists them with the lesson that explains each. Then it
    follows one gradient down the path on every rank: ``model.follow(name)``.

What to run
    python lessons/08_minddp.py [--world-size 3] [--bucket-cap-mb 25]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    The test bench's table for MiniDDP and torch's DDP (both exact, with
    accumulation through ``no_sync``); the diffs; the parts; the buckets
    MiniDDP built, in launch order; one gradient's stations with values and
    times on each rank. Then read ``minddp/ddp/wrapper.py``, ``minddp/ddp/reducer.py``
    and ``minddp/ddp/buckets.py`` top to bottom (``docs/reading_the_code.md``).

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
import textwrap

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp.ddp.parts
from wrappers.flat_ddp import FlatDDP  # lesson 07b's wrapper
from minddp import MiniDDP
from minddp.ddp.bucket_assignment import LearnedBucketOrder
from minddp.ddp.contracts import Observer
from minddp.ddp.reducer import CopyGradients, Reducer
from _common import is_exact, parse_args, print0, print_ranks, print_results, run, train_and_compare

# What the plain path changed, as (07b's methods, minddp's methods).
DIFFS = [
    ("the hook counts; a complete bucket is filled in one call and launched in order",
     [FlatDDP._average_grad], [Reducer._autograd_hook, Reducer.mark_ready, Reducer.bucket_ready, CopyGradients.fill_bucket]),
    ("the end of backward: nested passes, a named error, wait and write per bucket",
     [FlatDDP._finish_backward], [Reducer._on_pass_end, Reducer.finish_backward, CopyGradients.write_grads,
                                  Reducer._missing_gradients_error]),
    ("rank 0's buffers: at construction (07b) and before each forward after a synchronized one",
     [FlatDDP.forward], [MiniDDP.forward]),
    ("the learned order: out of the path, a policy on the reducer's arrival log",
     [FlatDDP._finish_backward], [LearnedBucketOrder.after_backward]),
]

# Every part in minddp/ddp/parts/ (and the observers in minddp/ddp/observers/), with what picks it and the lesson
# that explains the feature. The slot is read from the class (show_the_parts).
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
    "ReplicaChecks": ("check_sync_every=N", "18"),
    "MiniDDPJoinHook": ("with model.join():", "18"),
    "Follow": ('model.follow("0.weight")', "08"),
    "StepObserver": ("timeline=True or trace=True", "16"),
    "ProfilerRanges": ("a torch.profiler recording", "16"),
    "ArrivalLog": ('learn_bucket_order (first backward), plan_buckets', "07b, 17b"),
}
SLOTS = (("is_ready", "readiness"), ("fill_bucket", "gradients"), ("communicate", "communication"),
         ("pack", "passenger"), ("before_forward", "forward"))


def code_lines(methods) -> list:
    """The methods' code without docstrings and comments, as ``ast.unparse`` writes it."""
    lines = []
    for method in methods:
        node = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
        if ast.get_docstring(node):
            node.body = node.body[1:]
        lines += ast.unparse(node).splitlines()
    return lines


def show_the_diffs() -> None:
    for title, old, new in DIFFS:
        print0(f"\n--- 07b FlatDDP -> minddp: {title}")
        diff = difflib.unified_diff(code_lines(old), code_lines(new), "lessons/wrappers/flat_ddp.py",
                                    "minddp/", lineterm="", n=1)
        for line in list(diff)[2:]:
            print0("  " + line)


def slot_of(part: type) -> str:
    if part is Observer:
        return ""  # the base of the observers, not one
    if issubclass(part, Observer):
        return "observer"
    return next((slot for method, slot in SLOTS if hasattr(part, method)), "")


def show_the_parts() -> list:
    found = {}
    modules = [f"minddp.ddp.parts.{info.name}" for info in pkgutil.iter_modules(minddp.ddp.parts.__path__)]
    for module in map(importlib.import_module, modules + ["minddp.ddp.observers.follow", "minddp.ddp.observers.trace", "minddp.ddp.reducer"]):
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
    print0(f"{world_size} ranks on the test bench of lessons 04-07b:")
    print_results(results)
    show_the_diffs()
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

    assert all(is_exact(r) for r in results), f"every row exact expected, got {results}"
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
    print0(f"         every one of the {len(layers)} parts is listed; the followed .grad is the average of the hooks.")


def options(parser) -> None:
    parser.add_argument("--bucket-cap-mb", type=float, default=0.005, help="bucket cap in MiB (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args)
