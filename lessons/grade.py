"""Grade your exercises: ``python -m lessons.grade 05`` from the repository's root.

    python -m lessons.grade            # every exercise: passed, failed or not written yet
    python -m lessons.grade 04 07      # only these
    python -m lessons.grade 05 --file my_hooks.py   # grade another file than lessons/exercises/05_*.py

Each exercise runs your code on 3, 2, 4 and 1 Gloo ranks on this machine's CPU (seconds on
an idle machine; on a busy one the grader waits longer, in proportion to the
load, before it calls anything a hang), compares it with one process on the
whole batch, and says what is wrong. Exit status 0 when every exercise
graded passed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lessons.grading.exercises import EXERCISES
from lessons.grading.runner import POOL_SIZE, close_cleanly, grade, unwritten
from minddp_lab.rank_pool import RankPool


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Grade the exercises in lessons/exercises.")
    parser.add_argument("numbers", nargs="*", help=f"exercises to grade (default: all of {', '.join(EXERCISES)})")
    parser.add_argument("--file", help="grade this file instead of the exercise's own (one exercise only)")
    parser.add_argument("--world-size", type=int, help="grade at this world size only (default: 3, 2, 4 and 1 ranks)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.numbers if n not in EXERCISES]
    if unknown:
        parser.error(f"no exercise {', '.join(unknown)}; there are {', '.join(EXERCISES)}")
    if args.file and len(args.numbers) != 1:
        parser.error("--file grades one exercise: name its number, e.g. python -m lessons.grade 05 --file mine.py")
    if args.world_size is not None and args.world_size < 1:
        parser.error("--world-size 1 or more")
    torch.set_num_threads(1)
    passed = True
    pool, ranks_started = RankPool(args.world_size or POOL_SIZE), False
    world_sizes = (args.world_size,) if args.world_size else None
    try:
        for number in args.numbers or EXERCISES:
            exercise = EXERCISES[number]
            ranks_started |= exercise.on_ranks and not unwritten(args.file or exercise.path)
            failures = grade(exercise, args.file, pool, world_sizes)
            passed &= not failures
            if not failures:
                print(f"{number} {exercise.title}: passed", flush=True)
            elif failures[0].startswith("not written yet"):
                print(f"{number} {exercise.title}: {failures[0]} (lessons/exercises/{exercise.file})", flush=True)
            else:
                print(f"{number} {exercise.title}: FAILED", flush=True)
                for failure in failures:
                    print(f"   - {failure}", flush=True)
    finally:
        if ranks_started:
            close_cleanly(pool)  # every rank leaves its process group together, before its process ends
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
