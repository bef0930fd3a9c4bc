"""Every lesson runs to the end: its asserts are the lesson's claims.

Each lesson is run as a learner runs it, ``python lessons/NN_name.py``, in a
fresh interpreter with its default two ranks. A lesson that fails prints its
own output, so the broken claim is in the test report.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

LESSONS_DIR = Path(__file__).resolve().parent.parent / "lessons"
LESSONS = sorted(LESSONS_DIR.glob("[0-9][0-9]_*.py"))
TIMEOUT_S = 150


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
    assert "checked:" in result.stdout, f"{what} printed no 'checked:' line:\n{result.stdout[-2000:]}"


def test_there_are_sixteen_lessons():
    assert [p.name[:2] for p in LESSONS] == [f"{i:02d}" for i in range(1, 17)]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(lesson: Path):
    check(run_lesson([sys.executable, str(lesson)]), lesson.name)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_launching_lesson_runs_under_torchrun():
    lesson = LESSONS_DIR / "15_launching.py"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(lesson)]
    result = run_lesson(args)
    check(result, "torchrun lessons/15_launching.py")
    assert "a real launch through torchrun" in result.stdout
