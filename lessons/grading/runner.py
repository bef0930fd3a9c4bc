"""Load a learner's exercise file, run its check on Gloo ranks, and say what is wrong in words.

A check is a function ``check(rank, world_size, path) -> list[str]`` run on
every rank of a :class:`minddp_lab.rank_pool.RankPool`; it returns the same list of
failures on every rank (empty: passed). A check that needs no ranks (the
sampler) runs in this process instead. Stubs never reach the ranks: a
function whose body is still ``raise NotImplementedError`` is reported as
"not written yet" from the file's text.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minddp.launch import shutdown
from minddp_lab.rank_pool import RankError, RankPool

EXERCISES_DIR = Path(__file__).resolve().parent.parent / "exercises"
SOLUTIONS_DIR = EXERCISES_DIR / "_solutions"


@dataclass(frozen=True)
class Exercise:
    number: str
    title: str
    file: str  # under lessons/exercises/
    check: Callable  # check(rank, world_size, path) -> list[str]
    on_ranks: bool = True  # False: check(path) in this process
    timeout_s: float = 30.0
    hang_hint: str = "did every rank call the same collectives, in the same order?"

    @property
    def path(self) -> Path:
        return EXERCISES_DIR / self.file


EXERCISE_PREFIX = "exercise_"  # the names load() gives the modules it imports


def load(path: str | os.PathLike):
    """Import a learner's file by path (its name starts with a digit, so ``import`` cannot)."""
    path = Path(path)
    name = f"{EXERCISE_PREFIX}{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unwritten(path: str | os.PathLike) -> list[str]:
    """Functions and methods whose body is still only ``raise NotImplementedError(...)`` (a docstring aside)."""
    tree = ast.parse(Path(path).read_text())
    stubs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) else node.body
            if len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0]):
                stubs.append(node.name)
    return stubs


START_TIMEOUT_S = 120.0


def patience() -> float:
    """How many times longer than on an idle machine to wait before calling it a hang: the load per core, or 1.

    On a laptop busy with other work each rank gets a fraction of a core; a check
    that takes 10 s alone took 20 s at a load of 19 on 2 cores. A hang does not end
    however long one waits, so waiting longer never passes a wrong solution.
    """
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _ready(rank: int, world_size: int, path: str) -> None:
    """Import the learner's file (and what it imports) before the check's clock starts; its errors come later."""
    try:
        load(path)
    except BaseException:  # noqa: BLE001 -- reported, in words, by the timed run
        pass


def _leave_group(rank: int, world_size: int) -> None:
    """Every rank together: wait for the others, then take the process group down (no rank exits mid-collective)."""
    shutdown()


def close_cleanly(pool: RankPool) -> None:
    """End a pool the grader made: the process groups first, on every rank at once, then the processes."""
    try:
        pool.run(_leave_group, timeout_s=START_TIMEOUT_S)
    except RankError:
        pass  # a rank already gone: close() below kills what is left
    pool.close()


def _guarded(rank: int, world_size: int, check: Callable, path: str) -> list[str]:
    """Run a check on this rank; a stub reached (on every rank alike) is an answer, not a crash of the pool."""
    try:
        return check(rank, world_size, path)
    except NotImplementedError:
        return [NOT_WRITTEN_MIDWAY]


NOT_WRITTEN_MIDWAY = "not written yet: your code reached a `raise NotImplementedError` (is a helper still a stub?)"


def _explain_rank_error(exercise: Exercise, error: RankError, waited: float) -> str:
    text = str(error)
    if "NotImplementedError" in text:
        return NOT_WRITTEN_MIDWAY
    if "did not finish within" in text:
        return f"the ranks waited for each other for {waited:.0f} s and never finished (a hang): {exercise.hang_hint}"
    if f"rank {error.rank} died" in text:
        why = text.splitlines()[-1].strip()
        if "SIGABRT" in text or "mismatch" in text:  # what Gloo does when ranks' collectives do not match
            why += (" -- Gloo stops a rank so when the ranks' collectives do not match: did one rank call a "
                    "collective the others did not, or with another size, or in another order?")
        return f"rank {error.rank} crashed: {why}"
    lines = [line for line in text.splitlines() if line.strip()]
    where = [line.strip() for line in lines if str(exercise.number) in line and line.strip().startswith("File")]
    last = lines[-1] if lines else text
    place = f" ({where[-1]})" if where else ""
    return f"your code raised on rank {error.rank}{place}: {last}"


def grade(exercise: Exercise, path: str | os.PathLike | None = None, pool: RankPool | None = None,
          world_size: int = 3) -> list[str]:
    """The failures of the file at ``path`` (default: the learner's own stub), in words; [] means it passed."""
    path = Path(path or exercise.path)
    stubs = unwritten(path)
    if stubs:
        return [f"not written yet: {', '.join(stubs)} still raise{'s' if len(stubs) == 1 else ''} NotImplementedError"]
    if not exercise.on_ranks:
        try:
            return exercise.check(str(path))
        except NotImplementedError:
            return [NOT_WRITTEN_MIDWAY]
        except Exception as error:  # noqa: BLE001 -- a learner's bug, reported in one line
            return [f"your code raised {type(error).__name__}: {error}"]
    own_pool = pool is None
    pool = pool or RankPool(world_size)
    try:
        # Starting ranks and importing on a busy machine may take long: not a hang, and not on the check's clock.
        waited = START_TIMEOUT_S * patience()
        pool.run(_ready, str(path), timeout_s=waited)
        waited = exercise.timeout_s * patience()
        return pool.run(_guarded, exercise.check, str(path), timeout_s=waited)[0]
    except RankError as error:
        return [_explain_rank_error(exercise, error, waited)]
    finally:
        if own_pool:
            close_cleanly(pool)
