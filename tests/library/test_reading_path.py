"""What one MiniDDP step runs: the plain path only, and a part only when its option asks for it.

Measured as the project's reading-path probe measures it (its numbers, and
the command, are in ``docs/reading_the_code.md``): 2 ranks, a 2-layer MLP in
``MiniDDP(model, **options)``, SGD; after 3 warm-up steps (the first
backward learns the bucket order, the next forward rebuilds), one more step
under ``sys.setprofile`` on rank 0 (CPU hooks run in the thread that called
backward), or the first step after construction. Every named minddp
function called is listed with its file.

What is checked is behaviour, not size: a default step enters only the
plain path's files (the wrapper, the reducer with its plain parts, the
buckets, the slots' contracts, the hooks that hold the reducer weakly); no part, observer or join code runs unless
asked for; an option brings its own part in.
"""

import collections
import os
import sys

import pytest
import torch

import minddp
from minddp import MiniDDP
from minddp_lab.rank_pool import RankPool

PLAIN_FILES = {"minddp/ddp/wrapper.py", "minddp/ddp/core/reducer.py", "minddp/ddp/core/buckets.py", "minddp/ddp/core/slots.py",
               "minddp/ddp/core/weak_hooks.py"}


def _reading_path(rank, world_size, warm_up=3, **kwargs):
    root = os.path.dirname(os.path.dirname(os.path.abspath(minddp.__file__)))
    package = os.path.join(root, "minddp") + os.sep
    torch.manual_seed(0)
    model = MiniDDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 4)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(warm_up):
        step()
    seen = collections.Counter()

    def profile(frame, event, arg):  # named functions only: not <listcomp>, <genexpr>, <lambda>
        if event == "call" and frame.f_code.co_filename.startswith(package) and not frame.f_code.co_name.startswith("<"):
            seen[(os.path.relpath(frame.f_code.co_filename, root), frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    files = sorted({f for f, _ in seen})
    lines = sum(sum(1 for _ in open(os.path.join(root, f))) for f in files)
    return sorted(seen), files, lines


@pytest.fixture(scope="module")
def fresh_ranks():
    """Ranks of their own, as a user's script starts: the suite's shared ranks may have run
    ``minddp.fsdp``, whose optimizer check stays installed in that process for good."""
    with RankPool(2) as pool:
        yield pool


def _describe(functions, files, lines) -> str:
    return (f"{len(functions)} functions in {len(files)} files of {lines} lines: {files}\n  "
            + "\n  ".join(f"{f}:{name}" for f, name in functions))


def test_a_plain_step_runs_only_the_plain_path(fresh_ranks):
    functions, files, lines = fresh_ranks.run(_reading_path)[0]
    report = _describe(functions, files, lines)
    assert set(files) <= PLAIN_FILES, report
    assert ("minddp/ddp/core/reducer.py", "_autograd_hook") in functions, report  # not vacuous: the step was seen


def test_with_find_unused_parameters_a_step_runs_its_parts_and_no_other(fresh_ranks):
    functions, files, lines = fresh_ranks.run(_reading_path, find_unused_parameters=True)[0]
    report = _describe(functions, files, lines)
    theirs = {"minddp/ddp/parts/unused_parameters.py", "minddp/ddp/parts/gradient_cases.py"}
    assert theirs <= set(files), report  # not vacuous: its readiness and gradients parts run
    assert set(files) <= PLAIN_FILES | theirs, report


def test_the_first_step_learns_the_bucket_order(fresh_ranks):
    functions, files, lines = fresh_ranks.run(_reading_path, warm_up=0)[0]
    report = _describe(functions, files, lines)
    assert ("minddp/ddp/policies.py", "after_backward") in functions, report
    assert not [f for f in files if f.startswith(("minddp/ddp/parts/", "minddp/ddp/observers/"))], report


def test_instrumentation_and_join_bookkeeping_run_only_when_asked_for(fresh_ranks):
    functions, files, _ = fresh_ranks.run(_reading_path)[0]
    assert "minddp/ddp/observers/trace.py" not in files, _describe(functions, files, 0)
    assert not [f for f in files if f.startswith("minddp/ddp/parts/")], _describe(functions, files, 0)
    # Not vacuous: asked for, the timeline does run on that step (an observer of the reducer).
    functions, files, _ = fresh_ranks.run(_reading_path, timeline=True)[0]
    assert ("minddp/ddp/observers/trace.py", "bucket_launched") in functions, _describe(functions, files, 0)


def _print_reading_path(rank, world_size, options):
    torch.set_num_threads(1)
    functions, files, lines = _reading_path(rank, world_size, **options)
    if rank == 0:
        print(_describe(functions, files, lines))


if __name__ == "__main__":  # PYTHONPATH=. python tests/library/test_reading_path.py: the listing behind the numbers
    from minddp.launch import spawn

    for kwargs in ({}, {"find_unused_parameters": True}, {"warm_up": 0}):
        print(kwargs or "default arguments")
        spawn(_print_reading_path, 2, kwargs, backend="gloo")
