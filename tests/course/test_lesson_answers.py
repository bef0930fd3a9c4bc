"""The lessons ask; ``lessons/answers.md`` answers, and ``--reveal`` prints the answers beside the questions.

What counts as an answer written inline: in a lesson's "Try this", a
parenthesized passage that opens a sentence -- an opening parenthesis right
after ". ", "? ", "! " or ": " (or those at a line's end), as in
"Predict what happens. (Every rank waits ...)". Parentheses inside a
sentence ("``--link eth25`` (25 Gb/s Ethernet)") are not answers.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LESSONS_DIR = Path(__file__).resolve().parents[2] / "lessons"
LESSONS = sorted(LESSONS_DIR.glob("[0-9][0-9]*_*.py"))
sys.path.insert(0, str(LESSONS_DIR))
import _answers  # noqa: E402

INLINE_ANSWER = re.compile(r"[.?!:]\s+\(")


def try_this(lesson: Path) -> str:
    doc = ast.get_docstring(ast.parse(lesson.read_text()), clean=False)
    section = re.search(r"^Try this\n(.*?)(?=^\S|\Z)", doc, re.M | re.S)
    assert section, f"{lesson.name}: no Try this section"
    return section.group(1)


def test_the_pattern_finds_an_answer_written_inline():
    assert INLINE_ANSWER.search("predict what happens. (Every rank waits)")
    assert INLINE_ANSWER.search("agree?\n       (Yes: same start.)")
    assert not INLINE_ANSWER.search("``--link eth25`` (25 Gb/s Ethernet): predict")


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_lesson_answers_its_try_this_inline(lesson):
    section = try_this(lesson)
    found = [section[m.start():m.start() + 60].replace("\n", " ") for m in INLINE_ANSWER.finditer(section)]
    assert not found, f"{lesson.name}: an answer written beside its question (move it to lessons/answers.md): {found}"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_answer_belongs_to_a_question_of_its_lesson(lesson):
    doc = ast.get_docstring(ast.parse(lesson.read_text()))
    number = _answers.lesson_number(doc)
    asked, answered = _answers.questions(doc), _answers.answers(number)
    assert asked, f"{lesson.name}: no numbered questions found in Try this"
    assert set(answered) <= set(asked), f"lesson {number}: answers {sorted(set(answered) - set(asked))} have no question"
    revealed = _answers.reveal(doc)
    for item, answer in answered.items():
        assert " ".join(answer.split()[:8]) in " ".join(revealed.split()), f"lesson {number}: answer {item} not revealed"


def test_answers_md_has_a_section_only_for_lessons_that_exist():
    sections = re.findall(r"^## Lesson (\S+)$", _answers.ANSWERS.read_text(), re.M)
    numbers = {p.name.split("_")[0] for p in LESSONS}
    assert sections and set(sections) <= numbers, sorted(set(sections) - numbers)
    assert len(sections) >= 20
    assert sum(len(_answers.answers(n)) for n in sections) >= 55


@pytest.mark.parametrize("name", ["01_process_group", "05_gradient_hooks", "21_fully_sharded"])
def test_reveal_prints_the_answers_and_starts_no_rank(name):
    lesson = LESSONS_DIR / f"{name}.py"
    env = dict(os.environ, PYTHONPATH=str(LESSONS_DIR.parent), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(lesson), "--reveal"], cwd=LESSONS_DIR.parent, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    number = name.split("_")[0]
    assert result.stdout.startswith(f"Lesson {number}, Try this, with the answers")
    for answer in _answers.answers(number).values():
        assert " ".join(answer.split()[:6]) in " ".join(result.stdout.split())
    assert "[rank" not in result.stdout and "checked" not in result.stdout, "--reveal ran the lesson"
