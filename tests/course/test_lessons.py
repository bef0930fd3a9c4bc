"""Every lesson runs to the end, with every exercise flag: its asserts are the lesson's claims.

Each lesson is run as a learner runs it, ``python lessons/NN_name.py``, in a
fresh interpreter with its default two ranks, then once per "Try this" flag
(the broken or alternative variant, whose outcome the lesson predicts and
checks). A lesson that fails prints its own output, so the broken claim is
in the test report. Lessons are found by name, so a new one is picked up.
"""

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LESSONS_DIR = Path(__file__).resolve().parents[2] / "lessons"
LESSONS = sorted(LESSONS_DIR.glob("[0-9][0-9]*_*.py"))
TIMEOUT_S = 150

# The exercise flags, per lesson number: each is run once, and must end with "checked:".
FLAGS = {
    "02": [["--src", "1"], ["--rank-1-skips-all-gather"]],
    "03": [["--blocking-send"]],
    "04": [["--no-broadcast"], ["--forget-divide"]],
    "05": [["--micro-batches", "3"], ["--sync-every-micro-batch"]],
    "06": [["--wait-in-hook"], ["--link", "none"], ["--world-size", "3"]],
    "07": [["--cap", "200"], ["--link", "none"], ["--world-size", "3"], ["--registration-order"]],
    "07b": [["--keep-order"], ["--sum-not-average"]],
    "07c": [["--world-size", "3"]],
    "08": [["--bucket-cap-mb", "25"]],
    "09": [["--forget-set-epoch"], ["--lr", "0.05"]],
    "10": [["--plain-batchnorm-only"], ["--shift", "0"], ["--torch-syncbn"]],
    "11": [["--forward-outside"]],
    "12": [["--save-ddp-state-dict"], ["--no-barrier"]],
    "13": [["--no-scaler"], ["--bf16-hook"]],
    "14": [["--lr", "1e-3", "--epochs", "3"]],
    "15": [["--slurm-nodelist", "node[1,3-4]"], ["--mpi-without-master-addr"]],
    "16": [["--link", "none"], ["--bucket-cap-mb", "25"]],
    "17": [["--compute-scale", "50"], ["--network", "dgx-h100"], ["--algorithm", "tree"]],
    "17b": [["--link", "eth25"]],  # a third link: the fast one, where buckets leave early (--link laptop: the same path)
    "18": [["--timeout-s", "1"], ["--extra-first"]],
    "19": [["--gradient-as-bucket-view"], ["--optimizer", "sgd"]],
    "20": [["--bucket-cap-mb", "25"]],
    "21": [["--world-size", "3"]],
    "22": [["--link", "eth25"], ["--keep-after-forward"]],
    # The default run makes all ten failures happen, each asserted; one flag picks one, here on 3 ranks.
    "23": [["--failure", "uneven-inputs", "--world-size", "3"]],
}


# What a lesson's default run prints, checked beyond its own asserts: (what, a test of the output).
OUTPUT_CLAIMS = {
    "06": [("one saving for one idea, the link model's", lambda out: out.count("saved") == 1)],
    "22": [("a clock figure only where it says it is not checked", lambda out: all(
        "not checked" in line for line in out.splitlines() if "clock" in line and "ms" in line))],
}


def number(lesson: Path) -> str:
    return lesson.name.split("_")[0]


def run_lesson(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        return subprocess.run(
            args, cwd=LESSONS_DIR.parent, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        pytest.fail(f"{' '.join(args)} did not finish within {TIMEOUT_S} s; output so far:\n{out[-4000:]}")


def check(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, (
        f"{what} exited with {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}"
        f"\n--- stderr ---\n{result.stderr[-6000:]}"
    )
    assert "checked" in result.stdout, f"{what} printed no 'checked' line:\n{result.stdout[-2000:]}"


def test_lessons_are_numbered_in_order_and_have_exercises():
    numbers = [int(re.match(r"\d+", number(p)).group()) for p in LESSONS]
    assert set(range(1, 17)) | {18} <= set(numbers), numbers
    for lesson in LESSONS:
        assert "Try this" in ast.get_docstring(ast.parse(lesson.read_text())), f"{lesson.name}: no exercises"
    assert set(FLAGS) <= {number(p) for p in LESSONS}


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(lesson: Path):
    result = run_lesson([sys.executable, str(lesson)])
    check(result, lesson.name)
    for what, holds in OUTPUT_CLAIMS.get(number(lesson), []):
        assert holds(result.stdout), f"{lesson.name}: {what}\n{result.stdout[-3000:]}"


FLAG_RUNS = [(p, flags) for p in LESSONS for flags in FLAGS.get(number(p), [])]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("lesson,flags", FLAG_RUNS, ids=[f"{p.stem} {' '.join(f)}" for p, f in FLAG_RUNS])
def test_lesson_exercise_runs(lesson: Path, flags: list[str]):
    check(run_lesson([sys.executable, str(lesson), *flags]), f"{lesson.name} {' '.join(flags)}")


def test_a_lesson_that_needs_two_ranks_says_so_in_one_line():
    result = run_lesson([sys.executable, str(LESSONS_DIR / "04_average_gradients.py"), "--world-size", "1"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "this lesson compares ranks with each other: run it with --world-size 2 or more"
    ]


@pytest.mark.parametrize("name", ["03_ring_all_reduce", "10_batchnorm", "18_failure_modes", "23_when_ddp_goes_wrong"])
def test_lessons_that_compare_ranks_refuse_one_rank_in_one_line_and_say_so(name):
    lesson = LESSONS_DIR / f"{name}.py"
    result = run_lesson([sys.executable, str(lesson), "--world-size", "1"])
    assert (result.returncode, result.stderr.strip().splitlines()) == (
        2, ["this lesson compares ranks with each other: run it with --world-size 2 or more"]), result.stderr
    what_to_run = ast.get_docstring(ast.parse(lesson.read_text())).split("What to run")[1].split("What to look at")[0]
    assert "--world-size 1" in what_to_run, f"{name}: its 'What to run' does not say it refuses one rank"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_launching_lesson_runs_under_torchrun():
    lesson = LESSONS_DIR / "15_launching.py"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(lesson)]
    result = run_lesson(args)
    check(result, "torchrun lessons/15_launching.py")
    assert "a real launch through torchrun" in result.stdout


# ---------------------------------------------------------------------------
# Lessons 04 -> 07b build one wrapper up, a small diff at a time. Each step's
# wrapper lives alone in lessons/wrappers/, so that ``diff`` between
# neighbours shows the idea and nothing else; the lessons keep the
# instrumentation (timelines, counters) and the mistaken variants.

WRAPPERS_DIR = LESSONS_DIR / "wrappers"
# (lesson, its wrapper's file, the class) in the order the course builds them.
# (lesson, file, class): the wrappers of lessons 04-07b, then lesson 07c's reducers, and last the library's own
# reducer, which lesson 08 shows. Each file is a small diff on the one before.
ROOT = LESSONS_DIR.parent
WRAPPERS = "lessons/wrappers"
CHAIN = [("04", f"{WRAPPERS}/hand_ddp.py", "HandDDP"), ("05", f"{WRAPPERS}/hook_ddp.py", "HookDDP"),
         ("06", f"{WRAPPERS}/async_ddp.py", "AsyncDDP"), ("07", f"{WRAPPERS}/bucket_ddp.py", "BucketDDP"),
         ("07b", f"{WRAPPERS}/flat_ddp.py", "FlatDDP"),
         ("07c", f"{WRAPPERS}/split_reducer.py", "SplitReducer"),
         ("07c", f"{WRAPPERS}/assigned_reducer.py", "AssignedReducer"),
         ("07c", f"{WRAPPERS}/bucketed_reducer.py", "BucketedReducer"),
         ("07c", f"{WRAPPERS}/counted_reducer.py", "CountedReducer"),
         ("07c", f"{WRAPPERS}/phased_reducer.py", "PhasedReducer"),
         ("07c", f"{WRAPPERS}/nested_reducer.py", "NestedReducer"),
         ("07c", f"{WRAPPERS}/weak_reducer.py", "WeakReducer"),
         ("07c", f"{WRAPPERS}/slotted_reducer.py", "SlottedReducer"),
         ("07c", f"{WRAPPERS}/observed_reducer.py", "ObservedReducer"),
         ("08", "minddp/ddp/core/reducer.py", "Reducer")]
CORE_REDUCER = ROOT / CHAIN[-1][1]
# Changed lines (added + removed, blank lines and the module docstring left out) between
# neighbouring files, as measured when the wrappers were split out: 04->05 23, 05->06 21,
# 06->07 50, 07->07b 63. The whole lessons' diffs were 249-364 lines. The bound leaves room
# for a line or two more, not for instrumentation or a harness moved into a wrapper.
MAX_WRAPPER_DIFF = 75


def _code_lines(path: Path) -> list[str]:
    """Non-blank lines after the module docstring."""
    source = path.read_text()
    tree = ast.parse(source)
    docstring_end = tree.body[0].end_lineno if isinstance(tree.body[0], ast.Expr) else 0
    return [line.rstrip() for i, line in enumerate(source.splitlines(), 1) if i > docstring_end and line.strip()]


def wrapper_diff(a: Path, b: Path) -> int:
    """Lines added or removed from wrapper ``a`` to wrapper ``b``, as ``diff`` counts them."""
    return sum(line[:1] in "+-" for line in difflib.unified_diff(_code_lines(a), _code_lines(b), n=0, lineterm="")
               if not line.startswith(("+++", "---", "@@")))


def _module_name(path: str) -> str:
    return path.removeprefix("lessons/").removesuffix(".py").replace("/", ".")


def _classes(path: Path) -> list[str]:
    return [node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)]


def test_the_chain_ends_in_the_librarys_reducer():
    assert CHAIN[-1][1] == "minddp/ddp/core/reducer.py", "the course's last step is the library's reducer file"


@pytest.mark.parametrize("a,b", list(zip(CHAIN, CHAIN[1:])), ids=lambda step: Path(step[1]).stem)
def test_each_step_of_the_chain_changes_the_wrapper_by_a_small_diff(a, b):
    changed = wrapper_diff(ROOT / a[1], ROOT / b[1])
    assert 0 < changed <= MAX_WRAPPER_DIFF, f"{a[1]} -> {b[1]}: {changed} changed lines"


@pytest.mark.parametrize("step", CHAIN, ids=lambda step: Path(step[1]).stem)
def test_each_lesson_uses_its_wrapper_file_and_the_file_holds_only_the_wrapper(step):
    n, path, cls = step
    lesson = {number(p): p for p in LESSONS}[n]
    source = lesson.read_text()
    assert f"from {_module_name(path)} import {cls}" in source, f"lesson {n} must use {path}"
    assert f"class {cls}(" not in source, f"lesson {n} defines {cls} again instead of importing it"
    assert "train_and_compare(" in source, f"lesson {n} must run on the shared bench"
    assert "def make_model" not in source and "CrossEntropyLoss" not in source, f"lesson {n} grew its own harness"
    tree = ast.parse((ROOT / path).read_text())
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    classes = _classes(ROOT / path)
    # Beside its own class, a step may hold only what the library's reducer file holds too (its phase, its
    # plain parts), so that the diff to the next step stays a diff of ideas.
    assert cls in classes and set(classes) - {cls} <= set(_classes(CORE_REDUCER)) and not functions, (
        f"{path} holds {classes + functions}, not {cls} (and the core reducer's own classes) alone")
    wrapper_source = (ROOT / path).read_text()
    if f"class {cls}(nn.Module)" in wrapper_source:
        assert "self.require_sync = True" in wrapper_source, f"{cls} dropped require_sync"
    else:
        assert "def prepare_for_backward" in wrapper_source, f"{cls}: a reducer is armed by prepare_for_backward"
    for instrument in ("perf_counter", "print(", "_common"):
        assert instrument not in wrapper_source, f"{path} holds instrumentation: {instrument}"


def test_the_wrapper_chain_is_listed_in_order():
    listed = (LESSONS_DIR / "wrappers" / "__init__.py").read_text()
    positions = [listed.index(path.removeprefix(f"{WRAPPERS}/")) for _, path, _ in CHAIN]
    assert positions == sorted(positions), "lessons/wrappers/__init__.py lists the chain out of order"