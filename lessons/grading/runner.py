"""Load a learner's exercise file, run its check on Gloo ranks, and say what is wrong in words.

A check is a function ``check(rank, world_size, path) -> list[str]`` run on
every rank of a :class:`minddp_lab.rank_pool.RankPool`; it returns the same list of
failures on every rank (empty: passed). It runs at every world size of the
exercise (3, 2, 4, then 1) on one pool of 4 ranks (``sizes``), each
collective matched across ranks before Gloo sees it (``ledger``), so that a
rank that calls one alone, or raises while the others wait, is named within
a second, with the learner's line. A check that needs no ranks (the
sampler) runs in this process instead. Stubs never reach the ranks: a
function whose body is still ``raise NotImplementedError`` is reported as
"not written yet" from the file's text.
"""

from __future__ import annotations

import ast
import gc
import importlib.util
import itertools
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minddp.launch import shutdown
from minddp_lab.rank_pool import RankError, RankPool

from lessons.grading import ledger, sizes

EXERCISES_DIR = Path(__file__).resolve().parent.parent / "exercises"
SOLUTIONS_DIR = EXERCISES_DIR / "_solutions"


@dataclass(frozen=True)
class Exercise:
    number: str
    title: str
    file: str  # under lessons/exercises/
    check: Callable  # check(rank, world_size, path) -> list[str]
    on_ranks: bool = True  # False: check(path) in this process
    world_sizes: tuple = (3, 2, 4, 1)  # graded in this order, each where the pool has the ranks; stops at a failure
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
POOL_SIZE = 4  # the largest world size graded


def patience() -> float:
    """How many times longer than on an idle machine to wait before calling it a hang: the load per core, or 1.

    On a laptop busy with other work each rank gets a fraction of a core; a check
    that takes 10 s alone took 20 s at a load of 19 on 2 cores. A hang does not end
    however long one waits, so waiting longer never passes a wrong solution.
    """
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _ready(rank: int, world_size: int, path: str, world_sizes: tuple, timeout_s: float, remake: tuple) -> None:
    """Make the groups of every world size graded (anew for those in ``remake``), and import the learner's file
    (and what it imports) before the check's clock starts; its errors come later."""
    sizes.prepare(world_sizes, timeout_s, remake)
    try:
        load(path)
    except BaseException:  # noqa: BLE001 -- reported, in words, by the timed run
        pass
    _settle()


def _settle() -> None:
    """Make the checks' ``gc.collect()`` cheap: set aside what exists now (the grader's and torch's own objects).

    [Note: the checks collect garbage after every step to see what the learner's
    objects still hold, and a collection walks every tracked object, torch's own
    modules included (a quarter of a second each once torch's compiler has been
    imported). ``gc.freeze()`` moves what exists now out of the collector's sight,
    so that a later collection walks only what was made since, and frees cycles
    as before.]
    """
    gc.collect()
    gc.freeze()


def _leave_group(rank: int, world_size: int) -> None:
    """Every rank together: wait for the others, then take the process group down (no rank exits mid-collective)."""
    gc.unfreeze()  # what ``_settle`` set aside is freed at exit as usual (native modules check that it is)
    gc.collect()
    shutdown()


def close_cleanly(pool: RankPool) -> None:
    """End a pool the grader made: the process groups first, on every rank at once, then the processes."""
    try:
        pool.run(_leave_group, timeout_s=START_TIMEOUT_S)
    except RankError:
        pass  # a rank already gone: close() below kills what is left
    pool.close()


NOT_WRITTEN_MIDWAY = "not written yet: your code reached a `raise NotImplementedError` (is a helper still a stub?)"


def _guarded(rank: int, pool_size: int, check: Callable, path: str, k: int, port: int, prefix: str,
             patience_s: float):
    """Run a check on ranks 0 .. k-1, as a world of k: ("failures", [...]), ("finding", text) when the ledger
    saw the ranks' collectives disagree, or ("raised", text, the learner's own error?). None on the other ranks."""
    if rank >= k:
        return None
    learner = os.path.abspath(path)
    book = ledger.Ledger(ledger.client(port), prefix, rank, k, learner=learner, patience_s=patience_s)
    with sizes.world_of(k), book.active(), ledger.Watchdog(book, still_s=3.0 + 0.5 * patience()):
        try:
            outcome = ("failures", check(rank, k, path))
        except NotImplementedError:
            outcome = ("failures", [NOT_WRITTEN_MIDWAY])
        except ledger.Finding as finding:
            book.done(str(finding))  # the ranks left waiting for this one are told why
            return ("finding", str(finding))
        except Exception as error:  # noqa: BLE001 -- told in words, and to the other ranks at once
            text, learners = raised_text(error, learner)
            book.done(text)
            return ("raised", text, learners)
        book.done()
    return outcome


def raised_text(error: BaseException, learner: str) -> tuple[str, bool]:
    """(what an exception says, at the learner's line, whether it is the learner's own rather than Gloo's)."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == learner] or [
        f for f in frames if not os.path.abspath(f.filename).startswith((ledger.GRADING_DIR, ledger.TORCH_DIR))]
    why = " ".join(str(error).split()).rstrip(".") or "(no message)"
    comm = any(words in why for words in ("Connection reset", "Connection closed", "Timed out", "timed out"))
    if not mine:
        return f"checking what your code returned raised {type(error).__name__}: {why}", False
    frame = mine[-1]
    where = ledger.place(frame.filename, frame.lineno)
    return f"your code raised {type(error).__name__} at {where}: {why}{_hint(error, frame.line or '')}", not comm


def _source(error: BaseException) -> str:
    """The text of the file the learner's frame that raised is in."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not os.path.abspath(f.filename).startswith((ledger.GRADING_DIR, ledger.TORCH_DIR))]
    try:
        return Path(frames[-1].filename).read_text() if frames else ""
    except OSError:
        return ""


def _hint(error: BaseException, line: str) -> str:
    """A known cause, only where the line and the error show it."""
    if isinstance(error, IndexError) and (".chunk(" in line or ".chunk(" in _source(error)):
        return (". torch.chunk(t, n) gives fewer than n pieces when t is short (chunk(3) of 2 numbers gives 2): "
                "tensor_split(n) always gives n")
    if "expected length" in str(error) and "tensor list" in str(error):
        return (". A list of outputs needs one tensor per rank of the group the call goes to: "
                "dist.get_world_size(group) of them, for the group you pass")
    if "Pair is not connected" in str(error):
        return (". Gloo has no connection to that rank in the group the call went to: is dst (or src) a rank of "
                "that group, numbered as the world numbers them? With group=group pass the group's own numbers as "
                "group_dst= / group_src=; without group= the call goes to every rank")
    if "not part of group" in str(error) or "same as the current" in str(error):
        return (". Inside a group, send and recv take the world's rank numbers as dst and src: pass the group's "
                "own numbers as group_dst= / group_src= (with group=group), or translate them with "
                "dist.get_global_rank")
    if "rank" in str(error).lower() and ("invalid" in str(error).lower() or "out of range" in str(error).lower()):
        return ". Is a number of ranks written into your code? Use dist.get_world_size()"
    return ""


_STORE = None
_runs = itertools.count()
# pool -> the world sizes whose last check failed: it may have left a message in their groups, so they are made
# anew before the pool's next check
_SPOILED: dict = {}


def _store():
    """The store every rank's ledger writes to, hosted by this process (so it can read the states after a hang)."""
    global _STORE
    if _STORE is None:
        import torch.distributed as dist
        _STORE = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return _STORE


def _verdict(results: list, k: int) -> list[str]:
    """The failures of one world size, from every rank's outcome: the learner's own exception first, then what
    the ledger saw, then anything else raised, then the check's failures (the same on every rank)."""
    outcomes = [(rank, o) for rank, o in enumerate(results) if o is not None]
    for wanted in (lambda o: o[0] == "raised" and o[2], lambda o: o[0] == "finding", lambda o: o[0] == "raised"):
        found = [(rank, o) for rank, o in outcomes if wanted(o)]
        if found:
            rank, o = found[0]
            if o[0] == "raised":
                others = [r for r, other in outcomes if other[0] != "raised"]
                alone = f" (on rank {rank} only)" if others and k > 1 else ""
                return [f"{o[1]}{alone}"]
            return [o[1]]
    return outcomes[0][1][1] if outcomes else []


def _explain_rank_error(exercise: Exercise, error: RankError, waited: float, prefix: str, k: int) -> str:
    text = str(error)
    if "NotImplementedError" in text:
        return NOT_WRITTEN_MIDWAY
    blocked, deadlock = ledger.verdict(_store(), prefix)
    if blocked:
        return f"{blocked}: {exercise.hang_hint}" if deadlock else blocked
    seen = ledger.states(_store(), prefix, k)
    stuck = [f"rank {r} {state[1]}" for r, (_, state) in sorted(seen.items()) if state[0] == "p2p"]
    waiting = [f"rank {r} waited in {state[2].said()}" for r, (_, state) in sorted(seen.items())
               if state[0] == "waiting"]
    if "did not finish within" in text:
        if stuck or waiting:
            return (f"the ranks waited for each other for {waited:.0f} s and never finished (a hang): "
                    f"{'; '.join(stuck + waiting)}: {exercise.hang_hint}")
        return f"the ranks waited for each other for {waited:.0f} s and never finished (a hang): {exercise.hang_hint}"
    if f"rank {error.rank} died" in text:
        why = text.splitlines()[-1].strip()
        if "SIGABRT" in text or "mismatch" in text:  # what Gloo does when ranks' collectives do not match
            why += (" -- Gloo stops a rank so when the ranks' collectives do not match: did one rank call a "
                    "collective the others did not, or with another size, or in another order?")
        return f"rank {error.rank} crashed: {why}"
    lines = [line for line in text.splitlines() if line.strip()]
    return f"rank {error.rank} failed: {lines[-1] if lines else text}"


def grade(exercise: Exercise, path: str | os.PathLike | None = None, pool: RankPool | None = None,
          world_sizes: tuple | None = None) -> list[str]:
    """The failures of the file at ``path`` (default: the learner's own stub), in words; [] means it passed.

    Graded at each of ``world_sizes`` (default: the exercise's that the pool has ranks for) in turn, up to
    the first that fails; its failures start with the world size.
    """
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
            return [raised_text(error, os.path.abspath(path))[0]]
    own_pool = pool is None
    pool = pool or RankPool(POOL_SIZE)
    world_sizes = tuple(k for k in (world_sizes or exercise.world_sizes) if k <= pool.world_size)
    store, passed = _store(), []
    try:
        # Starting ranks and importing on a busy machine may take long: not a hang, and not on the check's clock.
        waited = START_TIMEOUT_S * patience()
        # Gloo's own time limit, longer than the grader's: a hang is the grader's to name, not Gloo's
        pool.run(_ready, str(path), world_sizes, 300.0, tuple(_SPOILED.pop(pool, ())), timeout_s=waited)
        for k in world_sizes:
            prefix = f"{os.getpid()}/{next(_runs)}/{k}"
            waited = exercise.timeout_s * patience()
            try:
                results = pool.run(_guarded, exercise.check, str(path), k, store.port, prefix,
                                   min(10.0, exercise.timeout_s / 2) * patience(), timeout_s=waited)
                failures = _verdict(results, k)
            except RankError as error:
                failures = [_explain_rank_error(exercise, error, waited, prefix, k)]
            if failures:
                _SPOILED.setdefault(pool, set()).add(k)
                if failures[0].startswith("not written yet"):
                    return failures
                right = f", right on {', '.join(map(str, passed))}" if passed else ""
                return [f"on {k} rank{'s' if k > 1 else ''}{right}: {failures[0]}", *failures[1:]]
            passed.append(k)
        return []
    finally:
        if own_pool:
            close_cleanly(pool)
