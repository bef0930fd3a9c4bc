"""The plain path stays short enough to read: what one MiniDDP step runs, measured three ways.

Measured as the project's reading-path probe (and ``docs/reading_the_code.md``)
measures it: 2 ranks, a 2-layer MLP in ``MiniDDP(model, **options)``, SGD;
after 3 warm-up steps (the first backward learns the bucket order, the
next forward rebuilds), one more step under ``sys.setprofile`` on rank 0 (CPU hooks run
in the thread that called backward), or the first step after construction
(the probe's ``READING_PATH_STEP=first``). Every named minddp function
called counts once (comprehensions, generator expressions and lambdas are
not counted: write the idiomatic form), and every file one came from counts
with all its lines.

Targets (issues 35 and 44, and one step more since every synchronized
forward asks whether a bucket rebuild is due, as torch's does: ``Reducer.rebuild_if_due``):

* default arguments: at most 20 functions, in at most 3 files (the plain
  ones), of at most 910 lines together; none of them is instrumentation,
  join bookkeeping or a part, which run only when asked for;
* ``find_unused_parameters=True`` (the probe's ``READING_PATH_OPTIONS``): at
  most 27 functions in at most 4 files;
* the first step after construction, the bucket-order rebuild included: at
  most 4 files.
"""

import collections
import os
import sys

import pytest
import torch

import minddp
from minddp import MiniDDP
from minddp.launch.rank_pool import RankPool

MAX_FUNCTIONS, MAX_FILES, MAX_LINES = 20, 3, 910
PLAIN_FILES = {"minddp/ddp/wrapper.py", "minddp/ddp/reducer.py", "minddp/ddp/buckets.py"}
UNUSED_MAX_FUNCTIONS, UNUSED_MAX_FILES = 27, 4
FIRST_STEP_MAX_FILES = 4


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


def test_a_plain_step_reads_in_at_most_20_functions_3_files_910_lines(fresh_ranks):
    functions, files, lines = fresh_ranks.run(_reading_path)[0]
    report = _describe(functions, files, lines)
    assert len(functions) <= MAX_FUNCTIONS, report
    assert len(files) <= MAX_FILES, report
    assert lines <= MAX_LINES, report
    assert set(files) <= PLAIN_FILES, report


def test_with_find_unused_parameters_a_step_reads_in_at_most_27_functions_4_files(fresh_ranks):
    functions, files, lines = fresh_ranks.run(_reading_path, find_unused_parameters=True)[0]
    report = _describe(functions, files, lines)
    assert len(functions) <= UNUSED_MAX_FUNCTIONS, report
    assert len(files) <= UNUSED_MAX_FILES, report
    assert "minddp/ddp/parts/unused_parameters.py" in files, report  # not vacuous: its part runs


def test_the_first_step_with_its_bucket_rebuild_reads_in_at_most_4_files(fresh_ranks):
    functions, files, lines = fresh_ranks.run(_reading_path, warm_up=0)[0]
    report = _describe(functions, files, lines)
    assert len(files) <= FIRST_STEP_MAX_FILES, report
    assert ("minddp/ddp/bucket_assignment.py", "after_backward") in functions, report  # not vacuous


def test_instrumentation_and_join_bookkeeping_run_only_when_asked_for(fresh_ranks):
    functions, files, _ = fresh_ranks.run(_reading_path)[0]
    assert not {"minddp/ddp/observers/trace.py", "minddp/ddp/join.py"} & set(files), _describe(functions, files, 0)
    assert not [f for f in files if f.startswith("minddp/ddp/parts/")], _describe(functions, files, 0)
    # Not vacuous: asked for, the timeline does run on that step (an observer of the reducer).
    functions, files, _ = fresh_ranks.run(_reading_path, timeline=True)[0]
    assert ("minddp/ddp/observers/trace.py", "bucket_launched") in functions, _describe(functions, files, 0)


def _print_reading_path(rank, world_size, options):
    torch.set_num_threads(1)
    functions, files, lines = _reading_path(rank, world_size, **options)
    if rank == 0:
        print(_describe(functions, files, lines))


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_reading_path.py: the listing behind the numbers
    from minddp.launch import spawn

    for kwargs in ({}, {"find_unused_parameters": True}, {"warm_up": 0}):
        print(kwargs or "default arguments")
        spawn(_print_reading_path, 2, kwargs, backend="gloo")
