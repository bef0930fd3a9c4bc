"""What the READMEs say about the lessons holds: times only with the load they were taken at, one moment to
read the package (after lesson 08), no path outside the repository, and a written answer to every Try this."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]*_*.py"))
sys.path.insert(0, str(ROOT / "lessons"))
import _answers  # noqa: E402

TIME_FIGURE = re.compile(r"\b\d+(\.\d+)? ?s\b(?![a-z])")  # "484 s", "15.5 s", "| 32 s |"


def paragraphs(path: Path) -> list[str]:
    return [" ".join(p.split()) for p in path.read_text().split("\n\n")]


@pytest.mark.parametrize("readme", ["README.md", "lessons/README.md", "lessons/exercises/README.md"])
def test_a_time_figure_for_the_lessons_comes_with_the_load_it_was_measured_at(readme):
    for paragraph in paragraphs(ROOT / readme):
        if "lesson" in paragraph.lower() and TIME_FIGURE.search(paragraph) and "load" not in paragraph:
            pytest.fail(f"{readme}: a time without the load it was taken at: {paragraph[:200]}")
    text = " ".join((ROOT / readme).read_text().split())
    assert "in seconds" not in text and "a few seconds" not in text, f"{readme} promises seconds"


def test_every_guide_says_to_read_the_package_after_lesson_08():
    said = {
        "lessons/README.md": " ".join((ROOT / "lessons/README.md").read_text().split()),
        "README.md": " ".join((ROOT / "README.md").read_text().split()),
        "docs/reading_the_code.md": " ".join((ROOT / "docs/reading_the_code.md").read_text().split()),
        "lessons/08_minddp.py": " ".join((ROOT / "lessons/08_minddp.py").read_text().split()),
    }
    for name, text in said.items():
        others = re.findall(r"after (?:the )?lessons? (\d\d[a-z]?)\b[^.]*?(?:read|the package)", text, re.I)
        assert set(others) <= {"08"}, f"{name} sends the reader to the package after lesson {others}"
    assert "After lesson 08, read the package" in said["lessons/README.md"]
    assert "after lesson 08, the package itself" in said["README.md"]
    assert "lesson 08 switches to the package" in said["docs/reading_the_code.md"]
    assert "Then read ``minddp/ddp/wrapper.py``" in said["lessons/08_minddp.py"]


def test_the_reading_guide_cites_no_tool_outside_the_repository():
    assert "/work/" not in (ROOT / "docs/reading_the_code.md").read_text()


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_try_this_has_a_written_answer(lesson):
    doc = ast.get_docstring(ast.parse(lesson.read_text()), clean=False)
    number = _answers.lesson_number(doc)
    missing = sorted(set(_answers.questions(doc)) - set(_answers.answers(number)), key=int)
    assert not missing, f"lesson {number}: Try this {', '.join(missing)} ha{'s' if len(missing) == 1 else 've'} no answer"
    assert "no written answer" not in _answers.reveal(doc)
