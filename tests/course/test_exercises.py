"""The exercises' grader, run against the reference solutions and other right ones the stubs invite (must
pass), the known-wrong ones (must fail with the words that name the mistake) and the learner's untouched
stubs (must say "not written yet").

All exercises share one pool of 4 Gloo ranks (the ``ranks`` fixture), each graded at 3, 2, 4 and 1 of them; the
grader's checks take a fraction of a second each, a deadlocking solution
its exercise's time limit (8 s for the ring, longer on a loaded machine).
"""

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `lessons.grading` is imported by path, as `python -m lessons.grade` does

from lessons.grading.exercises import EXERCISES  # noqa: E402
from lessons.grading.runner import EXERCISES_DIR, SOLUTIONS_DIR, grade, unwritten  # noqa: E402

NOT_FIRST = re.compile(r"Timed out|timed out after|Connection reset|Connection closed|lessons/grading/|check_\w+\.py:\d")

WRONG = sorted((SOLUTIONS_DIR / "wrong").glob("*.py"))
RIGHT = sorted((SOLUTIONS_DIR / "right").glob("*.py"))  # right solutions other than the reference: must pass


def _hangs(path: Path) -> bool:
    return "deadlock" in path.read_text()


# A solution that deadlocks costs the pool its ranks (they are killed and restarted): those run last.
WRONG.sort(key=_hangs)


def expected_words(path: Path) -> str:
    """A wrong solution's EXPECT: the words the grader's answer must contain."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "EXPECT":
            return node.value.value
    raise AssertionError(f"{path.name} has no EXPECT = '...': the words its grade must contain")


def test_at_least_eight_exercises_each_with_a_stub_a_reference_and_a_wrong_solution():
    assert len(EXERCISES) >= 8
    for number, exercise in EXERCISES.items():
        assert exercise.path.exists(), exercise.path
        assert unwritten(exercise.path), f"{exercise.file}: no function left for the learner to write"
        assert ast.get_docstring(ast.parse(exercise.path.read_text())), f"{exercise.file}: no docstring"
        assert (SOLUTIONS_DIR / exercise.file).exists(), f"exercise {number} has no reference solution"
        assert not unwritten(SOLUTIONS_DIR / exercise.file), f"the reference of {number} is still a stub"
        assert any(p.name.startswith(number + "_") for p in WRONG), f"exercise {number} has no known-wrong solution"
    assert {p.name[:2] for p in WRONG + RIGHT} <= set(EXERCISES), "a solution for an exercise that does not exist"
    assert sorted(p.name for p in EXERCISES_DIR.glob("[0-9]*.py")) == sorted(e.file for e in EXERCISES.values())


@pytest.mark.parametrize("number", list(EXERCISES))
def test_an_untouched_stub_is_not_written_yet(number, ranks):
    failures = grade(EXERCISES[number], pool=ranks(4))
    assert len(failures) == 1 and failures[0].startswith("not written yet"), failures


@pytest.mark.parametrize("number", list(EXERCISES))
def test_the_reference_solution_passes(number, ranks):
    exercise = EXERCISES[number]
    assert grade(exercise, SOLUTIONS_DIR / exercise.file, ranks(4)) == []


@pytest.mark.parametrize("path", RIGHT, ids=[p.stem for p in RIGHT])
def test_a_right_solution_written_another_way_passes(path, ranks):
    # e.g. exercise 03 cut by rows as lesson 03 cuts, or with batch_isend_irecv; 06 through futures
    assert grade(EXERCISES[path.name[:2]], path, ranks(4)) == []


def test_the_ring_allowance_admits_every_cut_the_stub_invites_and_no_whole_tensor():
    from lessons.grading.check_collectives import SHAPES, ring_allowance

    assert ring_allowance((4, 5), 3) == 30  # rows 2, 1, 1 of 5: rank 0 sends 40 - 5 - 5 numbers
    assert ring_allowance((12,), 3) == 16  # 2 (p - 1) / p of 12, exactly
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        assert ring_allowance(shape, 3) >= 2 * 2 * -(-n // 3) - 2, shape
        if n >= 3:
            assert ring_allowance(shape, 3) < 2 * n, f"{shape}: a parameter server's rank 0 would pass"


def test_an_async_sum_reaches_the_learners_tensor_at_wait_and_not_before(ranks):
    # Reading before wait() must be wrong every time, not when the network happens to be slow.
    assert all(ranks(4).run(_held_until_wait))


def _held_until_wait(rank, world_size):
    import torch.distributed as dist

    from lessons.grading.watch import Watch

    watch = Watch()
    with watch.active():
        mine = torch.full((4,), float(rank + 1))
        work = dist.all_reduce(mine, async_op=True)
        time.sleep(0.2)  # long enough for Gloo to have finished: the sum must still be held back
        early = mine.clone()
        work.wait()
    kept = watch.handles()
    del work
    total = world_size * (world_size + 1) / 2  # every rank's (rank + 1)
    return (torch.equal(early, torch.full((4,), float(rank + 1))) and torch.equal(mine, torch.full((4,), total))
            and len(kept) == 1 and watch.changed_before_wait == 0)


@pytest.mark.parametrize("name", ["broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                                  "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"])
def test_every_async_collective_the_stubs_invite_is_held_back_until_wait(ranks, name):
    # Exercise 19's all-gather read before wait() must be wrong every time too, as the all-reduce's is.
    if not hasattr(torch.distributed, name):
        pytest.skip(f"torch {torch.__version__} has no dist.{name}: the stubs take the *_tensor name instead")
    early, waited = zip(*ranks(4).run(_held_collective, name))
    assert not any(early) and all(waited), (early, waited)


def _held_collective(rank, world_size, name):
    """(output already final before wait(), output right after wait()) for one async collective."""
    import torch.distributed as dist

    from lessons.grading.watch import Watch

    mine = torch.full((2,), float(rank + 1))
    everyone = torch.arange(1.0, world_size + 1).repeat_interleave(2)  # every rank's (rank + 1), twice
    total = world_size * (world_size + 1) / 2
    calls = {  # (output, the call, its right result)
        "broadcast": (mine, lambda out: dist.broadcast(out, src=2, async_op=True), torch.full((2,), 3.0)),
        "all_gather": ([torch.zeros(2) for _ in range(world_size)],
                       lambda out: dist.all_gather(out, mine, async_op=True), list(everyone.split(2))),
        "all_gather_into_tensor": (torch.zeros(2 * world_size),
                                   lambda out: dist.all_gather_into_tensor(out, mine, async_op=True), everyone),
        "reduce_scatter": (torch.zeros(2), lambda out: dist.reduce_scatter(
            out, [torch.full((2,), float(rank + 1)) for _ in range(world_size)], async_op=True), torch.full((2,), total)),
        "reduce_scatter_tensor": (torch.zeros(2), lambda out: dist.reduce_scatter_tensor(
            out, torch.full((2 * world_size,), float(rank + 1)), async_op=True), torch.full((2,), total)),
        "all_gather_single": (torch.zeros(2 * world_size),
                              lambda out: dist.all_gather_single(out, mine, async_op=True), everyone),
        "reduce_scatter_single": (torch.zeros(2), lambda out: dist.reduce_scatter_single(
            out, torch.full((2 * world_size,), float(rank + 1)), async_op=True), torch.full((2,), total)),
    }
    out, call, right = calls[name]
    before = [t.clone() for t in out] if isinstance(out, list) else out.clone()
    with Watch().active():
        work = call(out)
        time.sleep(0.2)  # long enough for Gloo to have finished: the result must still be held back
        same = lambda a, b: all(map(torch.equal, a, b)) if isinstance(a, list) else torch.equal(a, b)  # noqa: E731
        early = same(out, right) and not same(before, right)
        work.wait()
    return early, same(out, right)


def test_grading_ends_its_ranks_cleanly():
    # The ranks leave the process group together: no "terminate called without an active exception".
    result = _grade_command("21", "--file", str(SOLUTIONS_DIR / "21_fsdp_unit.py"))
    assert result.returncode == 0 and "passed" in result.stdout, result.stdout + result.stderr
    assert "terminate called" not in result.stderr, result.stderr


def _grade_command(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "lessons.grade", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_stub_that_raises_midway_is_reported_as_not_written(ranks, tmp_path):
    # A learner who wrote one function and left a helper raising: not a traceback, a sentence.
    source = (SOLUTIONS_DIR / "04_average_gradients.py").read_text()
    half = tmp_path / "04_half.py"
    half.write_text(source.replace("            p.grad /= world_size", "            p.grad /= helper()")
                    + "\n\ndef helper():\n    x = 1\n    raise NotImplementedError\n")
    assert not unwritten(half)
    failures = grade(EXERCISES["04"], half, ranks(4))
    assert failures and failures[0].startswith("not written yet"), failures
    assert grade(EXERCISES["04"], SOLUTIONS_DIR / "04_average_gradients.py", ranks(4)) == [], "the ranks serve on"


@pytest.mark.parametrize("path", WRONG, ids=[p.stem for p in WRONG])
def test_a_wrong_solution_fails_with_the_words_that_name_its_mistake(path, ranks):
    failures = grade(EXERCISES[path.name[:2]], path, ranks(4))
    assert failures, f"{path.name} passed the grader"
    assert any(expected_words(path) in failure for failure in failures), (
        f"{path.name}: expected a failure saying {expected_words(path)!r}, got {failures}")
    # the first line is the grader's sentence: never what the transport, or the grader's own code, said
    assert not NOT_FIRST.search(failures[0]), failures[0]


def test_the_command_line_grades_one_exercise_and_exits_with_its_verdict():
    run = _grade_command
    passed = run("09", "--file", str(SOLUTIONS_DIR / "09_distributed_sampler.py"))
    assert passed.returncode == 0 and "09 the distributed sampler: passed" in passed.stdout, passed.stdout + passed.stderr
    wrong = run("09", "--file", str(SOLUTIONS_DIR / "wrong" / "09_no_padding.py"))
    assert wrong.returncode == 1 and "FAILED" in wrong.stdout and "same number" in wrong.stdout, wrong.stdout
