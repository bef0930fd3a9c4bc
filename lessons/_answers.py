"""The answers to a lesson's "Try this", kept in ``lessons/answers.md`` and printed by ``--reveal``.

A lesson asks; it does not answer beside the question. ``answers.md`` holds
one section per lesson (``## Lesson 04``), one numbered answer per question,
continuation lines indented.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ANSWERS = Path(__file__).with_name("answers.md")


def lesson_number(doc: str) -> str:
    """"04" from a docstring that starts "Lesson 04: ..."."""
    match = re.match(r"\s*Lesson (\d+\w?):", doc or "")
    if not match:
        raise ValueError("a lesson's docstring starts with 'Lesson NN:'")
    return match.group(1)


def answers(number: str, text: str | None = None) -> dict[str, str]:
    """{question number: its answer} for lesson ``number``; {} when it has none."""
    text = ANSWERS.read_text() if text is None else text
    section = re.search(rf"^## Lesson {re.escape(number)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not section:
        return {}
    found = {}
    for item in re.finditer(r"^(\d+)\. (.*?)(?=^\d+\. |\Z)", section.group(1), re.M | re.S):
        found[item.group(1)] = " ".join(item.group(2).split())
    return found


def questions(doc: str) -> dict[str, str]:
    """{question number: its text} from the docstring's "Try this" section."""
    section = re.search(r"^Try this\n(.*?)(?=^\S|\Z)", doc, re.M | re.S)
    if not section:
        return {}
    return {m.group(1): " ".join(m.group(2).split())
            for m in re.finditer(r"^    (\d+)\. (.*?)(?=^    \d+\. |\Z)", section.group(1), re.M | re.S)}


def reveal(doc: str) -> str:
    """Every question of the lesson's Try this, each followed by its answer."""
    number = lesson_number(doc)
    asked, answered = questions(doc), answers(number)
    lines = [f"Lesson {number}, Try this, with the answers (from lessons/answers.md):"]
    for item, question in asked.items():
        lines.append(textwrap.fill(f"{item}. {question}", 100, break_on_hyphens=False, initial_indent="  ", subsequent_indent="     "))
        answer = answered.get(item, "no written answer: run it and see.")
        lines.append(textwrap.fill(f"answer: {answer}", 100, break_on_hyphens=False, initial_indent="     ", subsequent_indent="       "))
    return "\n".join(lines)
