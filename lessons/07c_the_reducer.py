"""Lesson 07c: from 07b's FlatDDP to the library's reducer, one small diff at a time.

What you will learn
    07b's ``FlatDDP`` is a real DDP, and lesson 08's ``minddp.MiniDDP`` is
    the library. Between them lie nine steps, each a file of
    ``lessons/wrappers/`` and each a small diff on the one before; the last
    is not a lesson's file but the library's own ``minddp/ddp/core/reducer.py``.
    From here on the module side (rank 0's start, a forward that arms the
    reducer) stays as it is (``wrappers/reducing_module.py``), and the steps
    grow what happens to a gradient:

    0. ``split_reducer.py``: 07b's path as a class of its own, as torch splits
       ``DistributedDataParallel`` (Python) from its ``Reducer`` (C++);
    1. ``assigned_reducer.py``: buckets assigned as torch assigns them;
    2. ``bucketed_reducer.py``: the library's ``Bucket`` objects;
    3. ``counted_reducer.py``: hooks that only count, one batched copy per bucket;
    4. ``phased_reducer.py``: where a backward is, as one ``BackwardPhase``;
    5. ``nested_reducer.py``: nested passes (a reentrant checkpoint), errors that name the parameter;
    6. ``weak_reducer.py``: hooks that do not keep the reducer alive;
    7. ``slotted_reducer.py``: a part per slot (readiness, gradients, communication);
    8. ``observed_reducer.py``: every event of the path told to one observer; buckets rebuilt in another order;
    9. ``minddp/ddp/core/reducer.py``: buckets given whole, built again for another part, and the setters
       the parts outside use.

    ``diff lessons/wrappers/phased_reducer.py lessons/wrappers/nested_reducer.py``
    shows one step; every step trains exactly like one process on the whole batch.

What to run
    python lessons/07c_the_reducer.py [--world-size 3]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    The table (every step exact), then two steps made visible: under a
    reentrant activation checkpoint step 4 ends the backward at the end of
    the checkpoint's own inner pass, with buckets still to come, and step 5
    waits for the outer one; a dropped step-5 reducer stays alive (its hooks
    hold it), a dropped step-6 reducer is collected.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Which step's diff is the largest, and what does it change?
    2. Predict: under the reentrant checkpoint, does step 4 get a wrong
       gradient or an error?
    3. Predict: after ``del model`` and ``gc.collect()``, what keeps step 5's
       reducer alive?
"""

import ast
import difflib
import gc
import weakref
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from _common import FEATURES, is_exact, parse_args, print0, print_results, run, train_and_compare
from wrappers.assigned_reducer import AssignedReducer
from wrappers.bucketed_reducer import BucketedReducer
from wrappers.counted_reducer import CountedReducer
from wrappers.nested_reducer import NestedReducer
from wrappers.observed_reducer import ObservedReducer
from wrappers.phased_reducer import PhasedReducer
from wrappers.reducing_module import ReducingModule
from wrappers.slotted_reducer import SlottedReducer
from wrappers.split_reducer import SplitReducer
from wrappers.weak_reducer import WeakReducer
from minddp.ddp.core.reducer import Reducer

STEPS = [SplitReducer, AssignedReducer, BucketedReducer, CountedReducer, PhasedReducer, NestedReducer, WeakReducer,
         SlottedReducer, ObservedReducer, Reducer]
ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "lessons/wrappers/flat_ddp.py", *(ROOT / "lessons/wrappers" / f"{name}.py" for name in (
    "split_reducer", "assigned_reducer", "bucketed_reducer", "counted_reducer", "phased_reducer", "nested_reducer",
    "weak_reducer", "slotted_reducer", "observed_reducer")), ROOT / "minddp/ddp/core/reducer.py"]
CAP = 2 * 1024  # bytes: the bench's model makes several buckets of it


def code_lines(path: Path) -> list:
    """The file's non-blank lines after its module docstring."""
    source = path.read_text()
    first = ast.parse(source).body[0]
    docstring_end = first.end_lineno if isinstance(first, ast.Expr) else 0
    return [line for i, line in enumerate(source.splitlines(), 1) if i > docstring_end and line.strip()]


def changed_lines(a: Path, b: Path) -> int:
    """Lines added or removed from ``a`` to ``b`` (blank lines and module docstrings left out), as ``diff`` counts."""
    old, new = code_lines(a), code_lines(b)
    return sum(line[:1] in "+-" for line in difflib.unified_diff(old, new, n=0, lineterm="")
               if not line.startswith(("+++", "---", "@@")))


class CheckpointedTower(nn.Module):
    """Two layers, the last inside a reentrant activation checkpoint: backward starts in a nested pass."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(FEATURES, 32), nn.Linear(32, 4)

    def forward(self, x):
        return checkpoint(lambda t: self.last(torch.relu(t)), self.first(x), use_reentrant=True)


def under_a_checkpoint(reducer_class, x) -> str:
    """One backward through a reentrant checkpoint: 'exact', or the error the step raised."""
    model = CheckpointedTower()
    reference = CheckpointedTower()
    ddp = ReducingModule(model, reducer_class, bucket_cap_bytes=0)  # one parameter per bucket
    try:
        ddp(x).sum().backward()
    except (AssertionError, RuntimeError) as error:
        return f"error: {str(error).splitlines()[0][:90]}"
    reference(x).sum().backward()
    same = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), reference.parameters()))
    return "exact" if same else "wrong gradient"


def survives_its_model(reducer_class) -> bool:
    """Build a model around a step's reducer, drop the model, collect: is the reducer still alive?"""
    model = ReducingModule(nn.Linear(FEATURES, 4), reducer_class, CAP)
    reducer = weakref.ref(model.reducer)
    del model
    gc.collect()
    return reducer() is not None


def main(rank: int, world_size: int, args) -> None:
    print0("changed lines from each file to the next (blank lines and module docstrings left out):")
    for a, b in zip(FILES, FILES[1:]):
        print0(f"  {a.relative_to(ROOT)!s:<40} -> {b.relative_to(ROOT)!s:<40} {changed_lines(a, b):>4}")

    results = [train_and_compare(step.__name__, lambda m, step=step: ReducingModule(m, step, CAP), rank, world_size,
                                 micro_batches=2)[0] for step in STEPS]
    print0(f"\n{world_size} ranks on the test bench, two micro-batches a step:")
    print_results(results)
    assert all(is_exact(r) for r in results), f"every step exact expected, got {results}"

    # The same input on every rank: the average of equal gradients is the gradient itself.
    x = torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(0))
    seen = {step.__name__: under_a_checkpoint(step, x) for step in (PhasedReducer, NestedReducer)}
    print0("\nunder a reentrant activation checkpoint (its layer's gradients come in a nested pass):")
    for name, outcome in seen.items():
        print0(f"  {name:<16} {outcome}")
    assert seen["PhasedReducer"].startswith("error") and "no gradient" in seen["PhasedReducer"], seen
    assert seen["NestedReducer"] == "exact", seen

    alive = {step.__name__: survives_its_model(step) for step in (NestedReducer, WeakReducer)}
    print0("\nafter del model and gc.collect(), is its reducer alive?")
    for name, yes in alive.items():
        print0(f"  {name:<16} {'yes: its hooks hold it' if yes else 'no: collected'}")
    assert alive == {"NestedReducer": True, "WeakReducer": False}, alive
    print0("\nchecked: every step trains exactly as one process; step 5 survives the nested pass that")
    print0("         step 4 mistakes for the end of the backward; step 6's reducer dies with its model.")


if __name__ == "__main__":
    args = parse_args(__doc__, min_world_size=2)
    run(main, args.world_size, args)
