"""The README and the docs describe the project as it is: links resolve, every page says what is on it, every
table names the command that made it, no page carries the project's history, every file in docs/ is shown by a
page, the lesson lists match the lessons, and the figures draw."""

import importlib.util
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LESSONS_README = ROOT / "lessons" / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# Every README of the course and the benchmarks (the exercises', their solutions', the experiments'), and docs/.
READMES = sorted(p for folder in ("lessons", "benchmarks") for p in (ROOT / folder).rglob("README.md"))
PAGES = [README, *READMES, *DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
LOOK_BACK = 40  # lines before a table where the command that made it may stand (same section)
COMMAND = re.compile(r"`(?:python3?|bash|PYTHONPATH=|minddp-train|pytest|sbatch|mpirun|torchrun|NPROC=|NNODES=|NP=)[^`]*`|```(?:bash|sh)")
# History a page must not carry (git keeps it): numbered sittings, who did what, this project's own issue numbers
# (another project's issue is named with its repository), scratch folders and paths on one machine, and dated
# reruns stacked above the current result.
HISTORY = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|\d+(?:st|nd|rd|th))"
    r" (?:session|sitting)\b|\bthis session\b|\bthe lead\b"
    r"|(?<![\w/.-])issues? #?\d+\b|\(#\d+\)|(?<![\w.])/(?:tmp|work)/\w|^#+ .*\brerun\b", re.M | re.I)
ANOTHER_PROJECT = re.compile(r"([\w.-]+/[\w.-]+|nccl-tests|nccl|pytorch|torch|horovod|deepspeed|lightning|accelerate)\s*$", re.I)


def page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def relative_links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+://|mailto:", t)]


def history_in(text: str) -> list[str]:
    found = []
    for m in HISTORY.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if m.group(0).lower().startswith("issue") and ANOTHER_PROJECT.search(text[line_start:m.start()]):
            continue
        line = text[line_start:text.find("\n", m.start())]
        found.append(f"{m.group(0)!r} in: {line.strip()[:120]}")
    return found


def test_history_finds_what_it_must_and_lets_other_projects_issues_be():
    ordinal, number = "third", 47  # spelled apart, so that this file carries no marker itself
    assert history_in(f"### {ordinal.title()} session: the planner")
    assert history_in(f"as measured in issue {number}'s walk")
    assert history_in(f"(issue {number}'s walk)")
    assert history_in("python x.py --json /tmp/s48/compare.json")
    assert history_in("### Rerun after the parts redesign")
    assert not history_in("NVIDIA/nccl-tests issue 252, and pytorch/pytorch#22436; torch issue 22095")
    assert not history_in("the rank pools live for the whole test session")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_page_carries_history(page):
    found = history_in(page.read_text())
    assert not found, f"{page_id(page)} carries history (git keeps it; the page says what is true now): " + "; ".join(found)


def test_the_readme_starts_the_course_and_links_the_limits():
    text = README.read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    assert blocks and re.search(r"python lessons/01_\w+\.py", blocks[0]), (
        "README.md: its first shell block is the learner's install, ending with lesson 01's command")
    assert "docs/limits.md" in relative_links(README), "README.md links the page of what MiniDDP does not do"


def test_the_license_file_matches_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    licence = ROOT / "LICENSE"
    assert licence.exists(), "a LICENSE file belongs beside pyproject.toml"
    assert licence.read_text().splitlines()[0].startswith(f"{declared} License"), (
        f"LICENSE is not the {declared} license pyproject.toml declares")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_page_installs_minddp_from_a_registry(page):
    found = re.findall(r"pip install [\"']?minddp\b[^\s`]*", page.read_text())
    assert not found, f"{page_id(page)}: {found}: minddp is installed from a clone (pip install -e .), not a registry"


def test_every_file_in_docs_is_shown_by_a_page():
    said = "\n".join(p.read_text() for p in PAGES)
    unnamed = []
    for path in sorted((ROOT / "docs").rglob("*")):
        if path.is_dir() or path.suffix == ".md":
            continue
        inside = path.relative_to(ROOT / "docs").as_posix()
        if f"docs/{inside}" not in said and not re.search(rf"\({re.escape(inside)}\)|`{re.escape(inside)}`", said):
            unnamed.append(inside)
    assert not unnamed, "files in docs/ that no page names (delete them, or show them where they belong): " + ", ".join(unnamed)


# A lesson's number: two digits, and a letter for a lesson added after it (07b, 07c, ... come between 07 and 08).
LESSON_NUMBER = r"\d+[a-z]?"


def lesson_numbers() -> set[str]:
    return {p.name.split("_")[0] for p in (ROOT / "lessons").glob("[0-9]*_*.py")}


def lesson_order(number: str) -> tuple[int, str]:
    """Where a lesson comes: '07' < '07b' < '07c' < '08'."""
    match = re.fullmatch(r"(\d+)([a-z]?)", number)
    if not match:
        raise ValueError(f"{number!r} is not a lesson number (two digits, then at most one letter: 07, 07b)")
    return int(match.group(1)), match.group(2)


def numbers_in(cell: str, lessons: set[str] | None = None) -> set[str]:
    """The lessons a cell names: '01-08' is 01 to 08 with 07b (not 08b, after 08); '16-18, 17b' is 16, 17, 17b, 18."""
    lessons = lesson_numbers() if lessons is None else lessons
    found = set()
    for low, high, single in re.findall(rf"(\d+)-(\d+)|\b({LESSON_NUMBER})\b", cell):
        if single:
            found.add(single)
        else:
            found |= {n for n in lessons if lesson_order(low) <= lesson_order(n) <= lesson_order(high)}
    return found


def test_a_lesson_number_takes_any_letter():
    lessons = {"06", "07", "07b", "07c", "08", "08b", "09"}
    assert numbers_in("01-08", lessons) == {"06", "07", "07b", "07c", "08"}
    assert numbers_in("09 (with 07c, 08b)", lessons) == {"09", "07c", "08b"}
    assert sorted(lessons, key=lesson_order) == ["06", "07", "07b", "07c", "08", "08b", "09"]


@pytest.mark.parametrize("page", [README, LESSONS_README], ids=["README", "lessons/README"])
def test_the_learning_path_covers_every_lesson_once(page):
    rows = [line for line in page.read_text().splitlines() if re.match(r"\| \d\. ", line)]
    assert rows, f"{page.name}: no learning-path table (rows '| 1. part | lessons | ...')"
    seen: list[str] = []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        seen += sorted(numbers_in(next(c for c in cells if re.match(r"\d\d", c))))
    assert sorted(seen, key=lesson_order) == sorted(lesson_numbers(), key=lesson_order), (
        f"{page.name}'s learning path lists lessons {sorted(seen)}; lessons/ holds {sorted(lesson_numbers())}")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    missing = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            missing.append(f"{target} (no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            missing.append(f"{target} (no heading with anchor #{anchor} in {resolved.name})")
    assert not missing, f"{page.relative_to(ROOT)} links to: " + "; ".join(missing)


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_every_docs_page_starts_with_what_is_here(page):
    lines = [line for line in page.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"{page_id(page)} starts with its title"
    assert not re.match(r"#|\||```|!\[|[-*] ", lines[1]), (
        f"{page_id(page)}: a short paragraph saying what is on the page belongs right under the title")


def tables(text: str) -> list[tuple[int, int]]:
    """(first line, last line) of every Markdown table outside code blocks."""
    lines = text.splitlines()
    found, start, in_code = [], None, False
    for i, line in enumerate(lines + [""]):
        if line.startswith("```"):
            in_code = not in_code
        is_row = not in_code and line.startswith("|")
        if is_row and start is None:
            start = i
        elif not is_row and start is not None:
            found.append((start, i - 1))
            start = None
    return found


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_every_docs_table_names_the_command_that_made_it(page):
    text = page.read_text()
    lines = text.splitlines()
    bare = []
    for first, last in tables(text):
        start = max(0, first - LOOK_BACK)
        headings = [i for i in range(start, first) if re.match(r"#+ ", lines[i])]
        near = "\n".join(lines[headings[-1] if headings else start: last + 6])
        if not COMMAND.search(near):
            bare.append(f"line {first + 1}: {lines[first][:60]}")
    assert not bare, (f"{page_id(page)}: tables with no command in their section within {LOOK_BACK} lines before "
                      "or 5 after: " + "; ".join(bare))


def test_every_test_the_docs_name_exists():
    defined = {m.group(1) for p in (ROOT / "tests").rglob("test_*.py")
               for m in re.finditer(r"^(?:async )?def (test_\w+)", p.read_text(), flags=re.M)}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.py")}
    missing = []
    for page in [p for p in PAGES if p.name != "torch_suites.md"]:  # that page names torch's own tests
        text = page.read_text()
        missing += [f"{page.name}: {name}" for name in re.findall(r"`(?:tests/[\w/]+\.py::)?(test_\w+)`", text)
                    if name not in defined and not any(f.endswith(f"/{name}.py") for f in files)]
        missing += [f"{page.name}: {path}" for path in re.findall(r"(tests/[\w/]+\.py)", text) if path not in files]
    assert not missing, "the docs name tests that do not exist: " + "; ".join(sorted(set(missing)))


def test_the_simulated_link_lessons_are_the_ones_that_use_it():
    using = sorted(p.name.split("_")[0] for p in (ROOT / "lessons").glob("[0-9]*_*.py")
                   if re.search(r"simulated_link|make_link", p.read_text()))
    text = " ".join(LESSONS_README.read_text().split())
    m = re.search(r"lessons ([0-9a-z, ]+?) send their collectives through a \W*simulated link", text)
    assert m, "lessons/README.md names the lessons that use the simulated link"
    named = sorted(re.findall(rf"\b{LESSON_NUMBER}\b", m.group(1)))
    assert named == using, f"lessons/README.md says lessons {named} use the simulated link; the code says {using}"


def load_draw_figures():
    spec = importlib.util.spec_from_file_location("draw_figures", ROOT / "scripts" / "draw_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ring_picture_follows_lesson_03s_ring():
    draw = load_draw_figures()
    states = draw.ring_states(4)
    assert len(states) == 1 + 2 * 3, "a start, 3 reduce-scatter steps and 3 all-gather steps"
    after_reduce_scatter = states[3][1]
    for r in range(4):
        assert after_reduce_scatter[r][(r + 1) % 4] == frozenset(range(4)), (
            f"after reduce-scatter rank {r} holds the whole sum of chunk {(r + 1) % 4} (lesson 03)")
    assert all(chunk == frozenset(range(4)) for row in states[-1][1] for chunk in row), "every rank holds every sum"


@pytest.mark.parametrize("allreduce_time", [None, 5.0], ids=["drawn", "slow-link"])
def test_the_bucket_picture_launches_in_order_one_at_a_time(allreduce_time):
    draw = load_draw_figures()
    _, buckets, backward_end, written = draw.bucket_schedule(*([allreduce_time] if allreduce_time else []))
    for before, after in zip(buckets, buckets[1:]):
        assert after["launched"] >= before["reduced"], "one bucket on the wire at a time, in bucket order"
    for b in buckets:
        assert b["first"] <= b["full"] <= b["launched"] < b["reduced"] <= written
    assert written > backward_end


def test_the_figure_script_writes_both_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "draw_figures.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("bucket_life.png", "ring_allreduce.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, f"{name} was not drawn"
        assert (ROOT / "docs" / "figures" / name).exists(), f"docs/figures/{name} is committed"
